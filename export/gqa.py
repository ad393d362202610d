"""The fast graph's "compact" layout: each Attention-23 node replaced by onnxruntime's GroupQueryAttention.

GroupQueryAttention (com.microsoft, CPU) keeps each row's cache from slot 0 and takes the row's length from an input
instead of a mask: row b attends its first seqlens_k[b] + 1 keys and writes its new keys and values at the slots
after its past.  So rows of different lengths share a batch without left padding, the caller keeps one
(batch, kv_heads, max_length, head_dim) buffer per layer and binds it as past and present alike (the kernel writes
only the new slots), and the graph computes no (batch, heads, new, total) mask.

The rewrite is exact only where the Attention nodes take nothing but the causal and padding mask: the models whose
positions enter as rotations of q and k before attention (RoPE, per layer or not, NoPE layers included) or not at
all (NoPE), without soft-capped scores, without chunked attention (GroupQueryAttention has no block mask) or a query
temperature (Llama 4's; not checked against the compact rows), without a sliding window (its
meaning in GroupQueryAttention's local_window_size has changed between onnxruntime versions), without a RoPE scaling
that reads a row's length from its last position (dynamic NTK, LongRoPE: the exact graph takes it from the mask's
width), with head_dim a multiple of 8 (the kernel's vector width).  Every Attention node must be one this module
can replace, or nothing is replaced: a graph is compact or padded, never half of each.

The compact graph's inputs beyond the exact graph's: seqlens_k (batch,) int32, each row's past + new - 1, and
total_sequence_length () int32, the longest row's past + new; S == total_sequence_length marks a first prompt (every
row's past taken as empty).  attention_mask only gives positions (cumsum - 1 over its last S columns) and zeroes pad
query rows, as in the exact graph.  onnxruntime refuses several rows of several new tokens over a past: such a call
runs row by row.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper

MS_DOMAIN = "com.microsoft"
SEQLENS, TOTAL = "seqlens_k", "total_sequence_length"
CACHE_DIM, PRESENT_DIM = "max_length", "present_length"  # past: the caller's buffer; present: max(total, past)


def ineligible(meta: dict[str, Any]) -> str | None:
    """Why the model cannot have a compact graph (None: it can, if every Attention node is replaceable).  The
    variant's class says whether its attention takes the mask alone (PositionalVariant.compact_layout), the RoPE
    scaling's whether it reads a row's length from its last position (RopeScaling.length_dependent)."""
    from model import rope_scaling  # lazy: both import torch (1.4 s), which quantizing a graph without
    from model.variants import REGISTRY  # lazy: a fast graph never needs
    cfg = meta.get("config") or {}
    variant = meta.get("variant", cfg.get("variant"))
    if variant not in REGISTRY or not REGISTRY[variant].compact_layout:
        return f"variant {variant!r}'s attention reads more than the mask and the rotated queries and keys"
    if cfg.get("sliding_window"):
        return f"a sliding window of {cfg['sliding_window']}"
    if cfg.get("attention_chunk"):  # GroupQueryAttention's mask is causal (or a local window): no blocks
        return f"chunked attention (blocks of {cfg['attention_chunk']} positions)"
    if cfg.get("temperature_floor"):  # kept padded: not checked against GroupQueryAttention's rows from slot 0
        return "queries scaled by a position's temperature"
    if cfg.get("attn_sinks"):  # GroupQueryAttention has no sink input (its smooth_softmax is a sink fixed at 0)
        return "attention sinks (a learned logit per head in the softmax)"
    if cfg.get("attn_softcap"):  # kept padded: GroupQueryAttention's softcap is not checked against the mask order
        return f"attention scores soft-capped at {cfg['attn_softcap']}"
    if rope_scaling.get(cfg.get("rope_scaling", rope_scaling.NONE)).length_dependent:
        return f"rope scaling {cfg['rope_scaling']!r} depends on the row's length"
    head_dim = int(meta["sizes"]["head_dim"])
    if head_dim % 8:
        return f"head_dim {head_dim} is not a multiple of 8"
    if any(spec.get("sequence_axis") is None for spec in meta["state"]):
        return "the model carries a state besides its KV cache"
    return None


def _attrs(node: onnx.NodeProto) -> dict[str, Any]:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def _replaceable(node: onnx.NodeProto, inputs: set[str], outputs: set[str]) -> bool:
    """An Attention-23 node on 3D q/k/v (head counts given), a mask, the past from graph inputs, the present to graph
    outputs, no probabilities, not causal by itself (the mask carries it)."""
    a = _attrs(node)
    return (node.domain in ("", "ai.onnx") and len(node.input) == 6 and len(node.output) == 3
            and "q_num_heads" in a and "kv_num_heads" in a and not a.get("is_causal", 0)
            and not a.get("qk_matmul_output_mode", 0)
            and node.input[4] in inputs and node.input[5] in inputs
            and node.output[1] in outputs and node.output[2] in outputs)


def rewrite(proto: onnx.ModelProto, layers: int) -> int:
    """Replace the graph's Attention nodes with GroupQueryAttention in place and add seqlens_k and
    total_sequence_length; returns how many were replaced, 0 (graph untouched) unless all `layers` could be.
    The mask chain the old nodes read is left dead (the caller prunes it)."""
    g = proto.graph
    inputs, outputs = {i.name for i in g.input}, {o.name for o in g.output}
    nodes = [n for n in g.node if n.op_type == "Attention"]
    if len(nodes) != layers or not all(_replaceable(n, inputs, outputs) for n in nodes):
        return 0
    for at, node in enumerate(g.node):
        if node.op_type != "Attention":
            continue
        a = _attrs(node)
        q, k, v, _mask, past_k, past_v = node.input
        extra = {"softcap": float(a["softcap"])} if a.get("softcap") else {}
        gqa = helper.make_node("GroupQueryAttention", [q, k, v, past_k, past_v, SEQLENS, TOTAL], list(node.output),
                               name=f"{node.name}_gqa", domain=MS_DOMAIN, num_heads=int(a["q_num_heads"]),
                               kv_num_heads=int(a["kv_num_heads"]), scale=float(a["scale"]), do_rotary=0, **extra)
        g.node[at].CopyFrom(gqa)
    for vi in g.input:
        if vi.name.startswith("past_key_values."):
            vi.type.tensor_type.shape.dim[2].dim_param = CACHE_DIM
        elif vi.name == "attention_mask":  # free the name total_sequence_length for the input
            vi.type.tensor_type.shape.dim[1].dim_param = "mask_length"
    for vi in g.output:
        if vi.name.startswith("present."):
            vi.type.tensor_type.shape.dim[2].dim_param = PRESENT_DIM
    g.input.extend([helper.make_tensor_value_info(SEQLENS, onnx.TensorProto.INT32, ["batch_size"]),
                    helper.make_tensor_value_info(TOTAL, onnx.TensorProto.INT32, [])])
    return len(nodes)


def _real(mask: np.ndarray, b: int) -> np.ndarray:
    return np.flatnonzero(mask[b])


def check_parity(a: ort.InferenceSession, b: ort.InferenceSession, meta: dict[str, Any], positions: str,
                 steps: int = 3, seed: int = 0) -> float:
    """Largest |compact - exact|: the exact graph's left-padded prefill of two rows (7 and 4 tokens) against the
    compact graph's right-padded one (each row's real logits and cache slots), the rows' last logits alone through
    `positions`, then `steps` cache steps (the exact graph's mask grows; the compact rows' lengths do)."""
    names = ["logits"] + [spec["output"] for spec in meta["state"]]
    past_names = [spec["input"] for spec in meta["state"]]
    shapes = {i.name: i.shape for i in a.get_inputs()}
    vocab = int(meta["sizes"]["vocab_size"])
    rng = np.random.default_rng(seed)
    lens = np.array([7, 4])
    width = int(lens.max())
    rows = [rng.integers(0, vocab, n) for n in lens]
    left, right = np.zeros((2, width), np.int64), np.zeros((2, width), np.int64)
    lmask, rmask = np.zeros((2, width), np.int64), np.zeros((2, width), np.int64)
    for i, row in enumerate(rows):
        left[i, width - len(row):], lmask[i, width - len(row):] = row, 1
        right[i, :len(row)], rmask[i, :len(row)] = row, 1
    empty = {n: np.zeros((2, int(shapes[n][1]), 0, int(shapes[n][3])), np.float32) for n in past_names}
    want = a.run(names, {"input_ids": left, "attention_mask": lmask, **empty})
    every = np.tile(np.arange(width, dtype=np.int64), (2, 1))
    feeds = {"input_ids": right, "attention_mask": rmask, **empty, SEQLENS: (lens - 1).astype(np.int32),
             TOTAL: np.array(width, np.int32)}
    got = b.run(names, {**feeds, positions: every})
    last = b.run(["logits"], {**feeds, positions: (lens - 1)[:, None].astype(np.int64)})[0]
    if last.shape != (2, 1, vocab):
        return float("inf")
    worst = float(np.abs(last[:, 0] - want[0][:, -1]).max())
    mask = lmask
    for step in range(steps + 1):
        new = want[0].shape[1]
        for i in range(2):  # row i's real positions: its real slots of this call (exact) / its first ones (compact)
            real = _real(mask[:, -new:], i)
            worst = max(worst, float(np.abs(want[0][i, real] - got[0][i, :len(real)]).max()))
            slots = _real(mask, i)
            for x, y in zip(want[1:], got[1:], strict=True):
                worst = max(worst, float(np.abs(x[i][:, slots] - y[i][:, :len(slots)]).max()))
        if step == steps:
            break
        token = want[0][:, -1:].argmax(-1).astype(np.int64)
        mask = np.concatenate([mask, np.ones((2, 1), np.int64)], axis=1)
        past = dict(zip(past_names, want[1:], strict=True))
        want = a.run(names, {"input_ids": token, "attention_mask": mask, **past})
        lens = lens + 1
        cmask = (np.arange(int(lens.max()))[None, :] >= (lens.max() - lens)[:, None]).astype(np.int64)  # left-padded
        got = b.run(names, {"input_ids": token, "attention_mask": cmask, **dict(zip(past_names, got[1:], strict=True)),
                            SEQLENS: (lens - 1).astype(np.int32), TOTAL: np.array(lens.max(), np.int32),
                            positions: np.zeros((2, 1), np.int64)})
    return worst
