"""encoding.onnx: a variant's positional function on its own, exported from the same module the model uses.

The lab draws what an encoding *is* (the sinusoidal matrix, a learned table, per-head biases, RoPE's rotations)
from this graph, run by onnxruntime in the worker, so the pictures come from the artifact rather than from a
second implementation of each formula.  Input `positions` int64 [length]; outputs by hook:

  position_embedding [length, d_model]       embed(): what is added to the token embeddings (cpe: what its
                                             convolution adds to a constant input, from the zero start state)
  score_bias [heads, length, length]         score_bias(): added to the attention scores (Shaw's, XL's,
                                             DeBERTa's and CoPE's depend on the query or keys: they are shown for
                                             constant unit-norm probe queries and keys, all but Shaw's at layer 0;
                                             CoPE's gates are then equal, its counts a multiple of the distance)
  rotary_cos, rotary_sin [length, d_rot/2]   rotate() of a constant vector: cos/sin of each pair's angle (d_rot:
                                             the rotated dims per head, half-split or interleaved pairs)
  rotary_scores [length, length]             q.k / head_dim of constant vectors after rotation (score vs distance)
  rotary_frequencies [d_rot/2]               each pair's angle per position (radians) after the RoPE scaling, at
                                             the length asked for (dynamic and longrope change with it); the
                                             attention factor scales rotary_cos and rotary_sin (a variant's own
                                             pair_frequencies where its pairs turn otherwise: fope's, 0 if clipped)
  layer_frequencies [layers, d_rot/2]        only where the layers' positions differ (NoPE layers, a local base):
                                             each layer's pair frequencies as rotary_frequencies gives the model's,
                                             a row of zeros for a layer that rotates nothing
  query_scale [layers, heads, length]        what each query is multiplied by, per layer and head, at each
                                             position (a variant's query_scale(): ssmax's s log(position + 1))

model.json's entry carries a note for people: the scaling, its attention factor, ALiBi's slopes, the window.

A variant with none of the hooks (NoPE) gets no graph; model.json says so.

Many models share one graph (tiny LLaMA-shaped families with the same rotary settings, a model exported again
under another name): it is exported once and kept by a digest of what it is exported from (export.dynamo's
graph_key: the variant's classes and attributes, the config fields the graph reads, the opset), 0.5-1 s an
export.
"""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import torch
from torch import nn
from torch.export import Dim

from export import dynamo
from export.dynamo import onnx_export
from export.report import Check
from model import rope_scaling
from model.variants.base import PositionalVariant

FILE = "encoding.onnx"
LENGTH = "length"
EXAMPLE_LENGTH = 7  # the positions the graph is traced with


def hooks_of(variant: PositionalVariant) -> list[str]:
    cls = type(variant)
    return [h for h in ("embed", "score_bias", "rotate", "embed_state")
            if getattr(cls, h) is not getattr(PositionalVariant, h)]


def output_spec(variant: PositionalVariant) -> list[dict[str, Any]]:
    cfg, hooks = variant.cfg, hooks_of(variant)
    out = []
    if "embed" in hooks or "embed_state" in hooks:
        out.append({"name": "position_embedding", "shape": [LENGTH, cfg.d_model],
                    "constant_input": "embed_state" in hooks})
    if "score_bias" in hooks:
        out.append({"name": "score_bias", "shape": [cfg.n_heads, LENGTH, LENGTH],
                    "probe_query": variant.query_dependent_bias})
    if "rotate" in hooks:
        half = cfg.rope_dim // 2
        out += [{"name": "rotary_cos", "shape": [LENGTH, half]}, {"name": "rotary_sin", "shape": [LENGTH, half]},
                {"name": "rotary_scores", "shape": [LENGTH, LENGTH]}, {"name": "rotary_frequencies", "shape": [half]}]
        if per_layer_rope(variant):
            out.append({"name": "layer_frequencies", "shape": [cfg.n_layers, half]})
    if callable(getattr(variant, "query_scale", None)):
        out.append({"name": "query_scale", "shape": [cfg.n_layers, cfg.n_heads, LENGTH]})
    for o in out:
        o["dtype"] = "float32"
    return out


class EncodingGraph(nn.Module):
    def __init__(self, variant: PositionalVariant):
        super().__init__()
        self.pos = variant
        self.names = [o["name"] for o in output_spec(variant)]

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        cfg = self.pos.cfg
        pos = positions[None]  # (1, N)
        n = positions.shape[0]
        out = []
        if "position_embedding" in self.names:
            if self.pos.state_spec():  # cpe: what the convolution adds to a constant input (all ones) per position
                ones = torch.ones(1, n, cfg.d_model)
                state = tuple(torch.zeros(1, *shape) for _, shape in self.pos.state_spec())
                mixed, _ = self.pos.embed_state(ones, torch.ones(1, n, dtype=torch.int64), state)
                out.append((mixed - ones)[0])
            else:
                out.append(self.pos.embed(torch.zeros(1, n, cfg.d_model), pos)[0])
        if "score_bias" in self.names:
            probe = None
            if self.pos.query_dependent_bias:  # unit-norm queries and keys, the same at every position and head
                probe = torch.ones(1, cfg.n_heads, n, cfg.head_dim) / math.sqrt(cfg.head_dim)
            bias = self.pos.score_bias(probe, pos, pos, k=probe, layer=0)
            out.append(bias.expand(1, cfg.n_heads, n, n)[0])
        if "rotary_cos" in self.names:
            # Rotating the all-ones vector: each pair (a, b) = (cos - sin, sin + cos) of its angle.
            ones = torch.ones(1, 1, n, cfg.head_dim)
            q, k = self.pos.rotate(ones, ones, pos)
            r = q[0, 0, :, :cfg.rope_dim]  # the rotated dims; pair k is (k, k + d_rot/2) or (2k, 2k+1)
            if cfg.rope_pairing == "interleaved":
                a, b = r[:, 0::2], r[:, 1::2]
            else:
                a, b = r[:, :cfg.rope_dim // 2], r[:, cfg.rope_dim // 2:]
            out += [(a + b) / 2, (b - a) / 2, q[0, 0] @ k[0, 0].transpose(0, 1) / cfg.head_dim]
            own = getattr(self.pos, "pair_frequencies", None)  # pairs that turn otherwise than RoPE's (fope)
            out.append(own(pos) if callable(own) else frequencies(cfg, pos))
        if "layer_frequencies" in self.names:  # each layer's own RoPE (model constants: chosen while tracing)
            rows = [torch.zeros(cfg.rope_dim // 2) + 0 * out[-1][:1] if c is None else frequencies(c, pos)
                    for c in self.pos.layer_cfgs]
            out.append(torch.stack(rows))
        if "query_scale" in self.names:
            out.append(self.pos.query_scale(positions))
        return tuple(out)


def per_layer_rope(variant: PositionalVariant) -> bool:
    """Whether the variant rotates its layers differently (some by another base, some not at all)."""
    cfgs = getattr(variant, "layer_cfgs", None)
    return bool(cfgs) and any(c is not variant.cfg for c in cfgs)


def frequencies(cfg, pos: torch.Tensor) -> torch.Tensor:
    """Each rotary pair's angle per position (radians) under cfg's RoPE scaling, at the length of pos."""
    scaling = rope_scaling.get(cfg.rope_scaling)
    if scaling.length_dependent:
        return scaling.inv_freq(cfg, rope_scaling.row_lengths(pos))[0]
    return scaling.inv_freq(cfg) + 0 * pos[0, :1].to(torch.float32)  # a graph output


def describe(variant: PositionalVariant) -> str:
    """A line for people (the Encoding RPC's note, the viewer): what shapes this model's positions beyond the
    pictures: RoPE's scaling and attention factor, ALiBi's slopes, a sliding window."""
    cfg, parts = variant.cfg, []
    if "rotate" in hooks_of(variant):
        parts.append(rope_scaling.describe(cfg))
    note = getattr(variant, "note", None)  # a variant's own line (ssmax: its length scaling)
    if callable(note):
        parts.append(note())
    slopes = getattr(variant, "slopes", None)
    if isinstance(slopes, torch.Tensor):
        parts.append("ALiBi slopes " + ", ".join(f"{v:.4g}" for v in slopes.tolist()))
    window = getattr(cfg, "sliding_window", 0)
    if window:
        layers = [i for i in range(cfg.n_layers) if cfg.layer(i).attention == "sliding"]
        where = f"layers {', '.join(map(str, layers))}" if len(layers) < cfg.n_layers else "every layer"
        parts.append(f"sliding window of {window} positions in {where}")
    parts += per_layer(cfg)
    return "; ".join(parts)


def per_layer(cfg) -> list[str]:
    """Where the layers' positions differ (model.json's layers): which rotate by what, which have none, which are
    convolutions (a mixer layer), which have a mixer beside their attention, chunks, query temperatures, sinks,
    soft-caps.  The pictures show the model's own RoPE (the global layers')."""
    parts = []
    if cfg.local_rope_base or any(cfg.layer(i).encoding == "none" or not cfg.attends(i) or cfg.layer(i).beside != "none"
                                  for i in range(cfg.n_layers)):
        groups: dict[str, list[int]] = {}
        for i, layer in enumerate(cfg.layer_plan()):
            rope = layer.get("rope")
            mixed = {"convolution": f"a gated causal convolution over {layer.get('kernel')} tokens, no attention "
                                    "(order from its kernel)",
                     "recurrence": "a Mamba-2 state-space layer, no attention (order from its recurrence and a "
                                   f"convolution over {layer.get('kernel')} tokens)",
                     "delta": "a Gated DeltaNet layer, no attention (order from its decaying delta-rule state and a "
                              f"convolution over {layer.get('kernel')} tokens)"}
            source = "delta" if layer.get("mixer") == "gated_deltanet" else layer["encoding"]
            kind = mixed[source] if source in mixed else \
                "an MLP alone, no token mixing" if layer.get("mixer") == "none" else \
                "no positional encoding (NoPE)" if rope is None else (
                f"RoPE base {rope['base']:g}" + (f", {rope['scaling']} x{rope['factor']:g}"
                                                 if rope["scaling"] != "none" else ""))
            if layer.get("beside", "none") != "none":
                kind += (" beside a Mamba-2 state-space layer (order also from its recurrence and a convolution over "
                         f"{layer.get('kernel')} tokens)")
            groups.setdefault(kind, []).append(i)
        parts += [f"layer{'s' if len(at) > 1 else ''} {', '.join(map(str, at))}: {kind}" for kind, at in groups.items()]
    chunked = [i for i in range(cfg.n_layers) if cfg.layer(i).attention == "chunked"]
    if chunked:
        parts.append(f"chunked attention in layer{'s' if len(chunked) > 1 else ''} {', '.join(map(str, chunked))}: "
                     f"a query sees the keys of its own block of {cfg.attention_chunk} positions")
    tempered = [i for i in range(cfg.n_layers) if cfg.layer(i).temperature]
    if tempered:
        parts.append(f"queries of layer{'s' if len(tempered) > 1 else ''} {', '.join(map(str, tempered))} scaled by "
                     f"log1p(floor((position + 1) / {cfg.temperature_floor:g})) x {cfg.temperature_scale:g} + 1")
    if getattr(cfg, "attn_sinks", False):
        parts.append("attention sinks in every layer: a learned logit per head joins each softmax and takes part of "
                     "the row (Predict's maps report it as sink_mass)")
    if cfg.attn_softcap:
        parts.append(f"attention scores soft-capped at {cfg.attn_softcap:g} before the mask")
    if cfg.final_softcap:
        parts.append(f"final logits soft-capped at {cfg.final_softcap:g}")
    return parts


def export_encoding(variant: PositionalVariant, folder: Path, opset: int) -> dict[str, Any]:
    """Write folder/encoding.onnx (when the variant has a hook) and return model.json's "encoding" entry."""
    spec = output_spec(variant)
    entry: dict[str, Any] = {"file": None, "input": {"name": "positions", "dtype": "int64", "shape": [LENGTH]},
                             "outputs": spec}
    if not spec:
        note = describe(variant)
        cfg = variant.cfg
        reach = "the model" if all(map(cfg.attends, range(cfg.n_layers))) else "the attention layers"
        entry["note"] = f"no positional encoding: order reaches {reach} only through the causal mask" + (
            f"; {note}" if note else "")
        return entry
    note = describe(variant)
    if note:
        entry["note"] = note
    key = cache_key(variant, opset)
    data = dynamo.cached(key)
    if data is None:
        data = _export_graph(variant, spec, opset)
        dynamo.keep(key, data)
    (folder / FILE).write_bytes(data)
    entry["file"] = FILE
    return entry


def _export_graph(variant: PositionalVariant, spec: list[dict[str, Any]], opset: int) -> bytes:
    """encoding.onnx's bytes, exported."""
    graph = EncodingGraph(variant).eval()
    example = torch.arange(EXAMPLE_LENGTH, dtype=torch.int64)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        program = onnx_export(graph, (example,), opset_version=opset, input_names=["positions"],
                              output_names=[o["name"] for o in spec], dynamic_shapes=({0: Dim("length", min=1)},),
                              external_data=False, optimize=False, verbose=False)
    proto = program.model_proto
    for value in list(proto.graph.input) + list(proto.graph.output):  # name the symbolic dim "length"
        for dim in value.type.tensor_type.shape.dim:
            if dim.dim_param:
                dim.dim_param = LENGTH
    return proto.SerializeToString()


def cache_key(variant: PositionalVariant, opset: int) -> str | None:
    """The digest encoding.onnx is kept under (export.dynamo.graph_key; None for a variant it cannot read): the
    variant's classes, tensors and other attributes, the outputs, and of its configs only the fields the graph
    reads (its forward at the export's example length, run once in PyTorch): the families that differ in their
    norms, biases or MLP but rotate alike share one graph."""
    spec = output_spec(variant)
    graph = EncodingGraph(variant).eval()
    with torch.no_grad():
        read = dynamo.fields_read(lambda: graph(torch.arange(EXAMPLE_LENGTH, dtype=torch.int64)))
    # the graph's stack traces name this file
    return dynamo.graph_key(variant, FILE, opset, __file__, json.dumps(spec, sort_keys=True), read=read)


def check_encoding(variant: PositionalVariant, folder: Path, lengths: list[int], atol: float = 1e-5) -> list:
    """onnxruntime against the PyTorch module at each length, as validation report rows (tolerance atol times
    the largest magnitude, at least atol)."""
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    session = ort.InferenceSession(str(folder / FILE), opts, providers=["CPUExecutionProvider"])
    graph = EncodingGraph(variant).eval()
    rows = []
    for n in lengths:
        positions = np.arange(n, dtype=np.int64)
        got = session.run(graph.names, {"positions": positions})
        with torch.no_grad():
            want = [t.numpy() for t in graph(torch.from_numpy(positions))]
        for name, g, w in zip(graph.names, got, want, strict=True):
            if g.shape != w.shape:
                rows.append(Check(f"encoding length {n}", name, str(list(g.shape)), None, atol, False,
                                  f"PyTorch shape {list(w.shape)}"))
                continue
            diff = float(np.max(np.abs(g - w))) if g.size else 0.0
            # Biases grow with distance (ALiBi reaches -slope * length): float32 keeps ~7 digits of them, so the
            # tolerance scales with the largest magnitude, like the attention logits' would.
            tol = atol * max(1.0, float(np.max(np.abs(w))) if w.size else 1.0)
            rows.append(Check(f"encoding length {n}", name, str(list(g.shape)), diff, tol, diff <= tol))
    return rows
