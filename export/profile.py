"""The profile graph (profile.onnx): model.onnx with its attention maps reduced per query row inside the graph, so
what comes out grows with the prompt, not with its square.

Built from the artifact's own model.onnx (never from the PyTorch model): the per-layer probabilities the exact graph
stacks into `attentions` (B, H, T, S) are each read by a few nodes appended here, and the `attentions` output goes,
with the stack, so onnxruntime frees each layer's probabilities once its reduction has read them.  For every query
row (B, T), layer and head the output `profile` (B, T, L, H, C) holds C columns:

  buckets 0 .. K-1   the probability mass on keys at relative distance d = q_pos - k_pos in log-2 buckets: bucket 0
                     is d = 0, bucket b >= 1 is 2^(b-1) <= d < 2^b (1, 2-3, 4-7, ...), the last open-ended, K from
                     the longest distance the model serves (bit_length(max_positions - 1) + 1; 21 when unbounded);
  first              the mass on the key at position 0 (the first real token, the "sink");
  entropy            the row's entropy, -sum p ln p, in nats;
  (a mixer layer's rows, signed matrix rows rather than probabilities, are read as p = |m| / sum |m|: the share of
  the row's weight at each distance)
  learned_sink       only for models with learned attention sinks (config attn_sinks): 1 - the row's mass over the
                     keys, the probability the sink logit took.

Positions are the exact graph's (cumsum of the mask - 1), so left padding and a cached past give the distances a
whole unpadded forward does; a pad query's row is all zeros (the exact graph zeroes its probabilities).  The worker
averages the rows it is asked for (service/profile.py), across the pieces a long prompt runs in: the rows of one call
never need more than that call's maps, one layer at a time.

Where model.onnx keeps its weights in model.onnx.data, profile.onnx refers to the same file: nothing is copied.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from export import artifact
from export.errors import ExportError
from export.rewrite import prune
from model.files import sha256_file

PROFILE_ONNX = "profile.onnx"
OUTPUT = "profile"
UNBOUNDED_BUCKETS = 21  # a model with no position limit: the last bucket holds distances from 2^19 on
P = "profile/"  # the prefix of every name this module adds to the graph


def bucket_count(max_positions: int | None) -> int:
    """Buckets for distances 0 .. max_positions - 1: d = 0, then one per bit length of d."""
    if max_positions is None:
        return UNBOUNDED_BUCKETS
    return max(int(max_positions) - 1, 1).bit_length() + 1


def columns(buckets: int, learned_sink: bool = False, max_positions: int | None = None) -> list[str]:
    """The names of the C columns: each bucket's distances ("0", "1", "2-3", ..., the last up to max_positions - 1,
    or "2^(K-2)+" when unbounded), then "first", "entropy" and, with learned sinks, "learned_sink"."""
    names = ["0"]
    for b in range(1, buckets):
        lo, hi = 2 ** (b - 1), 2 ** b - 1
        if b == buckets - 1:
            hi = -1 if max_positions is None else max_positions - 1
        names.append(f"{lo}+" if hi < 0 else str(lo) if lo == hi else f"{lo}-{hi}")
    return names + ["first", "entropy"] + (["learned_sink"] if learned_sink else [])


def layer_probabilities(graph: onnx.GraphProto, output: str = "attentions") -> list[str]:
    """The tensor names of each layer's (B, H, T, S) probabilities: the inputs of the Unsqueeze nodes the exact graph
    stacks (Concat along axis 1) into its maps output."""
    producer = {o: n for n in graph.node for o in n.output}
    stack = producer.get(output)
    if stack is None:
        raise ExportError(f"the graph has no {output!r} output to reduce")
    parts = list(stack.input) if stack.op_type == "Concat" else [output]
    names = []
    for part in parts:
        node = producer.get(part)
        if node is None or node.op_type != "Unsqueeze":
            raise ExportError(f"{output!r} is not a stack of per-layer probabilities (found {node and node.op_type})")
        names.append(node.input[0])
    return names


def _const(name: str, value: np.ndarray) -> onnx.NodeProto:
    return helper.make_node("Constant", [], [P + name], value=numpy_helper.from_array(value, P + name))


def _node(op: str, inputs: list[str], output: str, **attrs: Any) -> onnx.NodeProto:
    return helper.make_node(op, [i if i in ("input_ids", "attention_mask") else P + i for i in inputs], [P + output],
                            name=P + output, **attrs)


def _positions(buckets: int) -> list[onnx.NodeProto]:
    """Nodes shared by every layer: `onehot` (B, T, S, K) float, 1 where key s is in query t's distance bucket, and
    `first` (B, 1, S, 1) float, 1 on the key at position 0."""
    lo = np.array([0.0] + [2.0 ** (b - 1) for b in range(1, buckets)], np.float32)
    hi = np.array([1.0] + [2.0 ** b for b in range(1, buckets - 1)] + [np.inf], np.float32)
    return [
        _const("axis1", np.array(1, np.int64)), _const("one", np.array(1, np.int64)),
        _const("zero", np.array(0, np.int64)), _const("ax1", np.array([1], np.int64)),
        _const("ax2", np.array([2], np.int64)), _const("ax3", np.array([3], np.int64)),
        _const("ax_last", np.array([-1], np.int64)), _const("big", np.array([2**62], np.int64)),
        _const("lo", lo), _const("hi", hi),
        _node("CumSum", ["attention_mask", "axis1"], "cum"),
        _node("Sub", ["cum", "one"], "cum1"),
        _node("Max", ["cum1", "zero"], "k_pos"),  # (B, S): the exact graph's positions
        _node("Shape", ["input_ids"], "new", start=1, end=2),
        _node("Neg", ["new"], "minus_new"),
        _node("Slice", ["k_pos", "minus_new", "big", "ax1"], "q_pos"),  # (B, T): the new tokens' positions
        _node("Unsqueeze", ["q_pos", "ax2"], "q_col"),  # (B, T, 1)
        _node("Unsqueeze", ["k_pos", "ax1"], "k_row"),  # (B, 1, S)
        _node("Sub", ["q_col", "k_row"], "dist"),  # (B, T, S)
        _node("Cast", ["dist"], "dist_f", to=TensorProto.FLOAT),
        _node("Unsqueeze", ["dist_f", "ax3"], "dist_k"),  # (B, T, S, 1)
        _node("GreaterOrEqual", ["dist_k", "lo"], "above"),
        _node("Less", ["dist_k", "hi"], "below"),
        _node("And", ["above", "below"], "inside"),
        _node("Cast", ["inside"], "onehot", to=TensorProto.FLOAT),  # (B, T, S, K)
        _node("Equal", ["k_pos", "zero"], "at_zero"),
        _node("Cast", ["at_zero"], "zero_f", to=TensorProto.FLOAT),
        _node("Cast", ["attention_mask"], "mask_f", to=TensorProto.FLOAT),
        _node("Mul", ["zero_f", "mask_f"], "first_row"),  # (B, S): the real key at position 0
        _node("Unsqueeze", ["first_row", "ax1"], "first_1"),
        _node("Unsqueeze", ["first_1", "ax_last"], "first"),  # (B, 1, S, 1)
        _const("fzero", np.array(0.0, np.float32)), _const("fone", np.array(1.0, np.float32)),
        _const("tiny", np.array(np.finfo(np.float32).tiny, np.float32)),
    ]


def _layer(i: int, probs: str, learned_sink: bool, mixer: bool = False) -> list[onnx.NodeProto]:
    """Layer i's (B, T, 1, H, C) columns from its (B, H, T, S) probabilities `probs` (a name of the exact graph); a
    mixer layer's signed rows are read as their magnitudes' shares, |m| / sum |m| (0 on an all-zero row)."""
    x = f"l{i}/"
    if mixer:
        nodes = [helper.make_node("Abs", [probs], [P + x + "abs"], name=P + x + "abs"),
                 _node("ReduceSum", [x + "abs", "ax_last"], x + "sum", keepdims=1),
                 _node("Max", [x + "sum", "tiny"], x + "den"),
                 _node("Div", [x + "abs", x + "den"], x + "p")]
    else:
        nodes = [helper.make_node("Identity", [probs], [P + x + "p"], name=P + x + "p")]
    nodes += [
             _node("Transpose", [x + "p"], x + "p_t", perm=[0, 2, 1, 3]),  # (B, T, H, S)
             _node("MatMul", [x + "p_t", "onehot"], x + "mass"),  # (B, T, H, K)
             _node("MatMul", [x + "p", "first"], x + "first"),  # (B, H, T, 1)
             _node("Greater", [x + "p", "fzero"], x + "pos"),
             _node("Log", [x + "p"], x + "log"),
             _node("Mul", [x + "p", x + "log"], x + "plogp"),
             _node("Where", [x + "pos", x + "plogp", "fzero"], x + "terms"),  # p ln p, 0 where p = 0
             _node("ReduceSum", [x + "terms", "ax_last"], x + "neg_entropy", keepdims=1),
             _node("Neg", [x + "neg_entropy"], x + "entropy")]  # (B, H, T, 1)
    extra = [x + "first", x + "entropy"]
    if learned_sink:  # what the row's keys did not take: the sink logit's share (0 on a pad query's row)
        nodes += [_node("ReduceSum", [x + "p", "ax_last"], x + "kept", keepdims=1),
                  _node("Sub", ["fone", x + "kept"], x + "sink_all"),
                  _node("Greater", [x + "kept", "fzero"], x + "real"),  # a pad query's row keeps nothing
                  _node("Where", [x + "real", x + "sink_all", "fzero"], x + "sink")]
        extra.append(x + "sink")
    nodes += [_node("Concat", extra, x + "tail", axis=-1),  # (B, H, T, 2 or 3)
              _node("Transpose", [x + "tail"], x + "tail_t", perm=[0, 2, 1, 3]),  # (B, T, H, 2 or 3)
              _node("Concat", [x + "mass", x + "tail_t"], x + "cols", axis=-1),  # (B, T, H, C)
              _node("Unsqueeze", [x + "cols", "ax2"], x + "layer")]  # (B, T, 1, H, C)
    return nodes


def append_profile(proto: onnx.ModelProto, buckets: int, learned_sink: bool = False,
                   mixers: frozenset[int] = frozenset(), source: str = "attentions") -> None:
    """The exact graph `proto` becomes the profile graph, in place: the `profile` output added, `attentions` gone.
    mixers: the layers whose maps are a mixer's signed matrix rows, profiled as shares of their magnitudes.
    source "mixer_maps" (the maps graph, export/intervene.py): the mixers' own matrices profiled instead, every one
    signed, the profile's layers being mixer_maps' (B, T, M, heads, C)."""
    g = proto.graph
    layers = layer_probabilities(g, source)
    nodes = _positions(buckets)
    for i, probs in enumerate(layers):
        nodes += _layer(i, probs, learned_sink, i in mixers or source == "mixer_maps")
    parts = [f"l{i}/layer" for i in range(len(layers))]
    nodes.append(_node("Concat", parts, "all", axis=2) if len(parts) > 1 else _node("Identity", parts, "all"))
    nodes.append(helper.make_node("Identity", [P + "all"], [OUTPUT], name=P + OUTPUT))
    g.node.extend(nodes)
    for o in [o for o in g.output if o.name in ("attentions", "logits", source)]:  # no maps, and no output head: a
        g.output.remove(o)  # profile's call wants neither, and the head's weights are not held for it
    width = len(columns(buckets, learned_sink))
    g.output.insert(0, helper.make_tensor_value_info(OUTPUT, TensorProto.FLOAT,
                                                     ["batch_size", "sequence_length", len(layers), None, width]))
    heads = g.output[0].type.tensor_type.shape.dim[3]
    heads.ClearField("dim_value")
    heads.dim_param = "heads"
    prune(proto)


def write_profile(proto: onnx.ModelProto, meta: dict[str, Any], out: Path) -> None:
    """`proto` (a graph with the exact graph's attentions output, read without its external data) with the profile
    reduction appended, saved to `out`: its external initializers keep pointing where they did (model.onnx.data)."""
    mixers = frozenset(i for i, layer in enumerate(meta.get("layers") or ()) if layer.get("mixer", "attention") !=
                       "attention")
    append_profile(proto, bucket_count(meta.get("max_positions")), bool((meta.get("config") or {}).get("attn_sinks")),
                   mixers)
    dim = proto.graph.output[0].type.tensor_type.shape.dim[3]
    dim.ClearField("dim_param")
    dim.dim_value = int(meta["sizes"]["n_heads"])
    onnx.save_model(proto, str(out))


def write_mixer_profile(proto: onnx.ModelProto, meta: dict[str, Any], out: Path, heads: int) -> None:
    """The maps graph `proto` with its mixer_maps reduced as the profile graph reduces maps, saved to `out`: output
    `profile` (B, T, layers with a mixer, heads, C), every row read as |m| / sum |m|."""
    append_profile(proto, bucket_count(meta.get("max_positions")), source="mixer_maps")
    dim = proto.graph.output[0].type.tensor_type.shape.dim[3]
    dim.ClearField("dim_param")
    dim.dim_value = heads
    onnx.save_model(proto, str(out))


def add_profile(folder: Path, meta: dict[str, Any]) -> dict[str, Any]:
    """profile.onnx beside the folder's model.onnx (sharing model.onnx.data where it has one); model.json's entry."""
    src = folder / artifact.MODEL_ONNX
    write_profile(onnx.load(str(src), load_external_data=False), meta, folder / PROFILE_ONNX)
    learned = bool((meta.get("config") or {}).get("attn_sinks"))
    buckets = bucket_count(meta.get("max_positions"))
    heads = int(meta["sizes"]["n_heads"])
    names = columns(buckets, learned, meta.get("max_positions"))
    return {"file": PROFILE_ONNX, "output": OUTPUT, "buckets": buckets, "columns": names,
            "shape": ["batch_size", "sequence_length", int(meta["sizes"]["n_layers"]), heads, len(names)],
            "source_sha256": sha256_file(src)}
