"""A float16 copy of a compact fast graph, for a GPU (`python -m export.fuse ARTIFACT --half`).

onnxruntime's CUDA GroupQueryAttention takes float16 or bfloat16 only: with the float32 fast graph, every layer's
attention runs on the CPU under `--provider cuda`, its queries, keys and values copied to the host and back each
step (bench/results/peers_gpu.json's placement table).  fast16.onnx holds weights, activations and the KV cache in
float16, so every node has a CUDA kernel, and the cache a stream carries is half the bytes.

What stays float32: the positions' arithmetic, every node the rotary inputs (position ids, cos and sin tables) are
computed from, and the Sin/Cos themselves.  float16 has 11 significant bits, so an angle of position 2,000 times a
frequency near 1 would be off by about a radian; the tables are computed in float32 and cast after.  And the
logits, cast back to float32 at the end (the worker's sampling reads float32).

The copy is onnxruntime's own converter (onnxruntime.transformers.float16, its node_block_list keeping those nodes
float32 with casts at their edges).  float16 cannot be held to the fast graph's 1e-4 parity, so, like a quantized
copy, it is held to a budget against the float32 exact graph on held-out text (export/budget.py),
recorded as model.json's `fast.half`.  Only a compact fast graph gets one: the worker's padded rows keep float32.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any

import onnx

from export import artifact
from export.budget import check_budget
from export.errors import ExportError
from export.gqa import MS_DOMAIN

HALF_ONNX = "fast16.onnx"
MIN_TOP1, MAX_NATS_RATIO = 0.98, 1.01  # float16 against float32 (the trained tiny model: 0.985, x1.000)
ROTARY_INPUTS = (1, 2, 3)  # com.microsoft RotaryEmbedding: position_ids, cos_cache, sin_cache
POSITIONAL = ("Sin", "Cos")


def positional_nodes(proto: onnx.ModelProto) -> set[str]:
    """Names of the nodes the rotary inputs and every Sin/Cos are computed from (up to graph inputs and
    constants), Sin/Cos included."""
    g = proto.graph
    producer = {o: n for n in g.node for o in n.output}
    stack = [n for n in g.node if n.op_type in POSITIONAL]
    stack += [producer[n.input[i]] for n in g.node if n.op_type == "RotaryEmbedding" and n.domain == MS_DOMAIN
              for i in ROTARY_INPUTS if i < len(n.input) and n.input[i] in producer]
    kept: set[str] = set()
    while stack:
        node = stack.pop()
        if node.name in kept:
            continue
        kept.add(node.name)
        stack.extend(producer[i] for i in node.input if i in producer)
    return kept


def build_half(fast: Path, dest: Path) -> dict[str, Any]:
    """dest (weights in dest + .data) <- the float32 fast graph at `fast` in float16, positional nodes and logits
    float32; returns what was kept float32."""
    from onnxruntime.transformers.float16 import convert_float_to_float16  # lazy: only this command needs it

    proto = onnx.load(str(fast))
    names = {n.name for n in proto.graph.node}
    for i, node in enumerate(proto.graph.node):  # the converter keeps nodes float32 by name: every node gets one
        if not node.name:
            node.name = next(f"{node.op_type}_{i}_{k}" for k in range(len(names) + 1)
                             if f"{node.op_type}_{i}_{k}" not in names)
            names.add(node.name)
    kept = positional_nodes(proto)
    logging.disable(logging.WARNING)  # the converter warns of every weight it clips to float16's range
    try:
        half = convert_float_to_float16(proto, keep_io_types=["logits"], node_block_list=sorted(kept))
    except ValueError as err:  # a graph over 2 GB cannot be shape-inferred in one piece
        raise ExportError(f"float16 conversion of {fast.name} failed: {err}") from None
    finally:
        logging.disable(logging.NOTSET)
    dropped = drop_round_trips(half, kept)
    for stale in (dest, dest.with_name(dest.name + ".data")):
        stale.unlink(missing_ok=True)
    onnx.save_model(half, str(dest), save_as_external_data=True, location=dest.name + ".data")
    if (data := dest.with_name(dest.name + ".data")).exists():  # onnx writes it owner-only: fast.onnx's mode
        shutil.copymode(fast, data)
    return {"kept_float32": len(kept), "round_trips_dropped": dropped}


def _to(node: onnx.NodeProto) -> int | None:
    return next((a.i for a in node.attribute if a.name == "to"), None)


def drop_round_trips(proto: onnx.ModelProto, kept: set[str]) -> int:
    """The converter casts every output of a kept node to float16 and every input back to float32, also between
    two kept nodes: the angles went float32 -> float16 -> float32 before Sin and Cos, which is the very rounding
    the kept nodes are there to avoid.  Each Cast(float32) of a Cast(float16) of a kept node's output is bypassed
    (its readers read the float32 original) and the casts no one reads are removed; returns the bypassed count."""
    g = proto.graph
    producer = {o: n for n in g.node for o in n.output}
    bypass = {}
    for node in g.node:
        first = producer.get(node.input[0]) if node.op_type == "Cast" and _to(node) == onnx.TensorProto.FLOAT \
            else None
        source = producer.get(first.input[0]) if first is not None and first.op_type == "Cast" and \
            _to(first) == onnx.TensorProto.FLOAT16 else None
        if source is not None and source.name in kept:
            bypass[node.output[0]] = first.input[0]
    for node in g.node:
        for i, name in enumerate(node.input):
            if name in bypass:
                node.input[i] = bypass[name]
    outputs = {o.name for o in g.output}
    while True:  # casts whose outputs nothing reads, the second of each pair first
        read = {i for n in g.node for i in n.input} | outputs
        dead = [n for n in g.node if n.op_type == "Cast" and not any(o in read for o in n.output)]
        if not dead:
            return len(bypass)
        for n in dead:
            g.node.remove(n)


def add_half(folder: Path, meta: dict[str, Any], fast: dict[str, Any], min_top1: float = MIN_TOP1,
             max_nats_ratio: float = MAX_NATS_RATIO) -> dict[str, Any]:
    """fast16.onnx beside the folder's fast graph, held to its budget against model.onnx (missed: removed,
    ExportError naming the figure); model.json's `fast.half` entry."""
    if fast.get("layout") != "compact":
        raise ExportError("a float16 fast graph needs the compact layout (GroupQueryAttention); this model's fast "
                          f"graph is {fast.get('layout')}")
    dest = folder / HALF_ONNX
    data = dest.with_name(dest.name + ".data")
    made = build_half(folder / fast["file"], dest)
    budget = check_budget(folder / artifact.MODEL_ONNX, dest, meta, folder, min_top1=min_top1,
                          max_nats_ratio=max_nats_ratio)
    if not budget["passed"]:
        worst = min(budget["rows"], key=lambda r: r["top1_agreement"] - r["nats_ratio"])
        dest.unlink(missing_ok=True)
        data.unlink(missing_ok=True)
        raise ExportError(f"the float16 fast graph misses its budget at {worst['length']} tokens: top-1 agreement "
                          f"{worst['top1_agreement']:.3f} (>= {min_top1} needed), nats/byte "
                          f"x{worst['nats_ratio']:.3f} (<= {max_nats_ratio}); not written")
    return {"file": HALF_ONNX, "external_data": data.name if data.exists() else None, "budget": budget, **made}
