"""Smoothing a gated MLP's down projection before dynamic int8 quantization.

Dynamic quantization (onnxruntime's DynamicQuantizeLinear + MatMulInteger) gives each call's activations one int8
scale for the whole tensor.  The input of a gated MLP's down projection, act(gate(x)) * up(x), has a few channels
tens of times larger than the rest in trained models (Dettmers et al., LLM.int8(), arXiv:2208.07339, section 3.4;
Xiao et al., SmoothQuant, arXiv:2211.10438, figure 4).  One scale sized for those channels leaves the others a few
int8 steps, and that input is where a quantized LLaMA loses most of its top-1 agreement with fp32 (measured on
bench.peers_accuracy's trained model: 0.964 with every MatMul quantized, 0.985 with the down projections kept fp32).

SmoothQuant moves the outliers into the weights: with s_j = max|X_j|^alpha / max|W_j|^(1 - alpha) over channel j
of the down projection's input X (max|X_j| measured on calibration text) and row j of its weight W,
X diag(1/s) . diag(s) W = X W.  Here diag(1/s) is folded into the up projection's output columns, which scale
channel j of act(gate(x)) * up(x) by 1/s_j exactly, so the fp32 graph computes the same (to rounding) and no node
is added.  Only the pattern Mul(f(gate), MatMul(x, U)) -> MatMul(., W) with U, W constants used nowhere else is
rewritten; a plain MLP (act(up(x)) is not linear in up's scale) is left alone.

The calibration text is the corpus's training part, never the held-out text the budget is scored on.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper, numpy_helper

from export.rewrite import Graph

ALPHA = 0.5  # SmoothQuant's default migration strength
WINDOWS = 4  # calibration windows
LENGTH = 256  # tokens per calibration window (at most the trained context)


def _weight(gr: Graph, node: onnx.NodeProto | None) -> onnx.TensorProto | None:
    """node's 2-D constant weight (a MatMul's second input) if no other node reads it."""
    w = gr.inits.get(node.input[1]) if node is not None and node.op_type == "MatMul" else None
    return w if w is not None and len(w.dims) == 2 and len(gr.consumers[w.name]) == 1 else None


def _sole_use(gr: Graph, name: str, node: onnx.NodeProto) -> bool:
    return gr.consumers.get(name) == [node] and name not in gr.outputs


def targets(proto: onnx.ModelProto) -> list[dict[str, Any]]:
    """Activations whose channels can be rescaled without changing what the graph computes, each {"x": its
    name, "matmuls": the MatMuls reading it (their weights' rows get s), "divided": (constant, axis) whose
    channels along axis get 1/s}: a gated MLP's down input, Mul(f(gate), MatMul(., U)) -> MatMul(., W), whose U's
    columns take 1/s.  Every constant involved is read by that node alone."""
    gr = Graph(proto)
    found = []
    for down in proto.graph.node:
        w = _weight(gr, down)
        mul = gr.producer.get(down.input[0]) if w is not None else None
        if w is None or mul is None or mul.op_type != "Mul" or not _sole_use(gr, mul.output[0], down):
            continue
        for side in mul.input:
            up = gr.producer.get(side)
            u = _weight(gr, up)
            if u is not None and _sole_use(gr, side, mul) and u.dims[1] == w.dims[0]:
                found.append({"x": down.input[0], "matmuls": [down], "divided": [(u, 1)]})
                break
    return found


def channel_maxima(path: Path, names: Sequence[str], windows: Sequence[np.ndarray],
                   feeds: Callable[[ort.InferenceSession, np.ndarray], dict]) -> list[np.ndarray]:
    """Per activation, max |x| of each channel over the calibration windows: the graph at `path` run in
    onnxruntime with those activations as extra outputs (a probe graph beside it, reading its weights)."""
    proto = onnx.load(str(path), load_external_data=False)
    proto.graph.output.extend(helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, None) for n in names)
    probe = path.with_name(f"{path.stem}.probe.onnx")  # beside src: external data paths stay valid
    onnx.save_model(proto, str(probe))
    try:
        opts = ort.SessionOptions()
        opts.log_severity_level = 3
        session = ort.InferenceSession(str(probe), opts, providers=["CPUExecutionProvider"])
        maxima = [np.zeros(0, np.float32)] * len(names)
        for ids in windows:
            for k, x in enumerate(session.run(names, feeds(session, ids))):
                m = np.abs(x.reshape(-1, x.shape[-1])).max(0)
                maxima[k] = m if not maxima[k].size else np.maximum(maxima[k], m)
        return maxima
    finally:
        probe.unlink(missing_ok=True)


def scales(x_max: np.ndarray, w_max: np.ndarray, alpha: float = ALPHA) -> np.ndarray:
    """SmoothQuant's per-channel factors from max |x| and the weights' max |w| per row; 1 for a channel
    calibration never saw or a zero weight row."""
    ok = (x_max > 0) & (w_max > 0)
    s = np.ones_like(x_max, dtype=np.float64)
    s[ok] = x_max[ok].astype(np.float64) ** alpha / w_max[ok].astype(np.float64) ** (1 - alpha)
    return s


def smooth(src: Path, dest: Path, windows: Sequence[np.ndarray],
           feeds: Callable[[ort.InferenceSession, np.ndarray], dict], alpha: float = ALPHA) -> dict[str, Any]:
    """dest (weights in dest + .data) <- src with every target smoothed; returns the record for model.json
    (activations rewritten, alpha, calibration tokens, how outlying the worst channel was)."""
    proto = onnx.load(str(src))
    found = targets(proto)
    record: dict[str, Any] = {"method": "smoothquant", "alpha": alpha, "activations": len(found),
                              "calibration_tokens": int(sum(len(w) for w in windows))}
    if found:
        maxima = channel_maxima(src, [t["x"] for t in found], windows, feeds)
        inits = {i.name: i for i in proto.graph.initializer}
        ratios = []
        for t, x_max in zip(found, maxima, strict=True):
            ws = [numpy_helper.to_array(inits[m.input[1]]) for m in t["matmuls"]]
            s = scales(x_max, np.max([np.abs(w).max(1) for w in ws], axis=0), alpha)
            for m, w in zip(t["matmuls"], ws, strict=True):
                inits[m.input[1]].CopyFrom(numpy_helper.from_array((w * s[:, None]).astype(w.dtype), m.input[1]))
            for tensor, axis in t["divided"]:
                v = numpy_helper.to_array(tensor)
                v = v / np.expand_dims(s, tuple(i for i in range(v.ndim) if i != axis))
                tensor.CopyFrom(numpy_helper.from_array(v.astype(numpy_helper.to_array(tensor).dtype), tensor.name))
            ratios.append(float(x_max.max() / max(float(np.median(x_max)), 1e-12)))
        record["input_max_over_median"] = round(max(ratios), 1)  # how outlying the worst channel was
    onnx.save_model(proto, str(dest), save_as_external_data=True, location=dest.name + ".data")
    return record
