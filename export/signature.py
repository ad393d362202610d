"""The graph's calling convention (ARCHITECTURE.md section 4), in one place for the builder, the validator and the
wrapper: which tensors go in and come out, in which order, with which symbolic dimensions, and how the carried
decoding state (the attention layers' keys and values, then the mixer layers' and the variant's own fixed-size
states) is flattened into that order.

  in   input_ids [batch, new], attention_mask [batch, past + new],
       past_key_values.{i}.key/.value [batch, kv_heads, past, Dh] for each attention layer i, then
       past_conv.{i} [batch, conv_kernel - 1, width] (and a mamba2 layer's past_ssm.{i} [batch, heads, head_dim,
       state], a gated_deltanet layer's [batch, heads, state, head_dim]) for each layer i with a mixer
       (ModelConfig.mixer_states: a mixer layer's, or the one beside an attention layer's attention), then
       past_{name} [batch, ...] for each entry of the variant's state_spec (cpe: past_conv_state)
  out  logits [batch, new, V], attentions [batch, L, H, new, past + new],
       present.{i}.key/.value [batch, kv_heads, past + new, Dh], present_conv.{i}, present_{name} [batch, ...]
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar

import onnx

# Human-readable names for the symbolic dimensions (Optimum's convention), set on the graph's inputs/outputs.
BATCH, NEW, PAST, TOTAL = "batch_size", "sequence_length", "past_sequence_length", "total_sequence_length"
FIXED_INPUTS = ("input_ids", "attention_mask")  # the inputs before the carried state

T = TypeVar("T")


def io_spec(cfg, variant_states: Sequence[tuple[str, tuple[int, ...]]] = ()) -> dict[str, Any]:
    """The graph's inputs, outputs and carried decoding state, as recorded in model.json.  KV entries grow along
    their sequence_axis; a mixer layer's state (past_conv.{i}) and a variant's own (cpe) have a fixed shape and
    sequence_axis null."""
    L, H, Dh, V = cfg.n_layers, cfg.n_heads, cfg.head_dim, cfg.vocab_size
    KVH = cfg.kv_heads
    inputs = [{"name": "input_ids", "dtype": "int64", "shape": [BATCH, NEW]},
              {"name": "attention_mask", "dtype": "int64", "shape": [BATCH, TOTAL]}]
    outputs = [{"name": "logits", "dtype": "float32", "shape": [BATCH, NEW, V]},
               {"name": "attentions", "dtype": "float32", "shape": [BATCH, L, H, NEW, TOTAL]}]
    state = []

    def fixed(past: str, present: str, shape: tuple[int, ...]) -> None:
        inputs.append({"name": past, "dtype": "float32", "shape": [BATCH, *shape]})
        outputs.append({"name": present, "dtype": "float32", "shape": [BATCH, *shape]})
        state.append({"input": past, "output": present, "sequence_axis": None, "shape": [BATCH, *shape]})

    for i in filter(cfg.attends, range(L)):  # every key/value first (a row's cache length is read from state[0])
        for part in ("key", "value"):
            inputs.append({"name": f"past_key_values.{i}.{part}", "dtype": "float32",
                           "shape": [BATCH, KVH, PAST, Dh]})
            outputs.append({"name": f"present.{i}.{part}", "dtype": "float32", "shape": [BATCH, KVH, TOTAL, Dh]})
            state.append({"input": f"past_key_values.{i}.{part}", "output": f"present.{i}.{part}",
                          "sequence_axis": 2})
    for i in range(L):
        for name, shape in cfg.mixer_states(i):
            fixed(f"past_{name}.{i}", f"present_{name}.{i}", shape)
    for name, shape in variant_states:
        fixed(f"past_{name}", f"present_{name}", shape)
    return {"inputs": inputs, "outputs": outputs, "state": state}


def past_dims(spec: dict[str, Any], batch: Any, past: Any) -> list[dict[int, Any]]:
    """torch.export's dynamic shapes of the carried inputs: batch, and the past length where an entry grows."""
    return [{0: batch} if s["sequence_axis"] is None else {0: batch, s["sequence_axis"]: past} for s in spec["state"]]


def spec_of(model) -> dict[str, Any]:
    """io_spec of a posenc Transformer."""
    return io_spec(model.cfg, model.pos.state_spec())


def input_names(spec: dict[str, Any]) -> list[str]:
    return [d["name"] for d in spec["inputs"]]


def output_names(spec: dict[str, Any]) -> list[str]:
    return [d["name"] for d in spec["outputs"]]


def carried_names(spec: dict[str, Any]) -> list[str]:
    """The carried inputs in graph order (every input after input_ids and attention_mask)."""
    return [s["input"] for s in spec["state"]]


def symbolic_axes(spec: dict[str, Any]) -> dict[str, list[int]]:
    """For each input, the axes that must stay symbolic in the graph."""
    return {d["name"]: [i for i, dim in enumerate(d["shape"]) if isinstance(dim, str)] for d in spec["inputs"]}


def split_past(flat: Sequence[T], cfg) -> tuple[tuple[tuple[T, ...], ...], tuple[T, ...]]:
    """Carried tensors in graph order -> (each layer's: (key, value) for attention, then its mixer's states (a mixer
    layer's, or the one's beside the attention); the variant's own state)."""
    attending = [i for i in range(cfg.n_layers) if cfg.attends(i)]
    layers: dict[int, tuple[T, ...]] = {i: (flat[2 * n], flat[2 * n + 1]) for n, i in enumerate(attending)}
    at = 2 * len(attending)
    for i in range(cfg.n_layers):
        n = len(cfg.mixer_states(i))
        layers[i], at = layers.get(i, ()) + tuple(flat[at:at + n]), at + n
    return tuple(layers[i] for i in range(cfg.n_layers)), tuple(flat[at:])


def flatten_past(layers: Sequence[Sequence[T]], state: Sequence[T], cfg) -> list[T]:
    """The inverse of split_past: what present.* / present_conv.* / present_* hold, in graph order."""
    kv = [t for i, carried in enumerate(layers) if cfg.attends(i) for t in carried[:2]]
    return kv + [t for i, carried in enumerate(layers) for t in carried[2 if cfg.attends(i) else 0:]] + list(state)


def name_dims(proto: onnx.ModelProto, spec: dict[str, Any]) -> None:
    """Give each graph input/output symbolic dim its contract name (the exporter calls them s0, s1 + s2...)."""
    by_name = {d["name"]: d["shape"] for d in spec["inputs"] + spec["outputs"]}
    for value in list(proto.graph.input) + list(proto.graph.output):
        shape = by_name.get(value.name)
        if shape is None:
            continue
        dims = value.type.tensor_type.shape.dim
        if len(dims) != len(shape):  # e.g. attentions declared with an unknown rank: write it out
            value.type.tensor_type.ClearField("shape")
            dims = value.type.tensor_type.shape.dim
            for _ in shape:
                dims.add()
        for dim, want in zip(dims, shape, strict=True):
            if isinstance(want, str):
                dim.ClearField("dim_value")
                dim.dim_param = want
            else:
                dim.dim_value = want
