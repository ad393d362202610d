"""int8 and int4 copies of artifacts (onnxruntime's own quantization), held to a budget against the fp32 artifact.

    python -m export quantize artifacts/rope --out artifacts/rope-int8 [--method dynamic|int8|int4]

`dynamic`: MatMul/Gemm weights become int8 per output channel (onnxruntime.quantization.quantize_dynamic);
activations are quantized at run time per call, one scale per tensor.  The weights take 7 of the 8 bits
(`reduce_range`): a CPU without VNNI (AVX2 only, as AMD's Zen 3) multiplies uint8 activations by int8 weights with
an instruction that saturates pairs of products at 16 bits, and with full-range weights such a CPU computed another
answer than a VNNI or AMX machine (top-1 agreement with fp32 0.969 against 0.992 for the same copy of a tiny rope
model).  With 7-bit weights no pair can saturate, so the copy computes the same on every x86-64 CPU and the budget
measured where it was made holds where it is served (tests/export/test_quantize_fast.py runs one on an emulated
Zen 3).  A gated MLP's down projection is smoothed first (export/smooth.py, SmoothQuant): its input's outlier
channels are moved into its weight, calibrated on a few windows of the corpus's training part; the fp32 graph
computes the same, and model.json records it.
`int8` / `int4`: weight-only, block-wise (32 weights share a scale, symmetric): every MatMul with a constant weight
becomes onnxruntime's MatMulNBits (onnxruntime.quantization's MatMulNBitsQuantizer) with accuracy level 4, so the
CPU kernel multiplies int8-quantized activations with the 8- or 4-bit weights.  This is the layout of llama.cpp's
q8_0 / q4_0 (blocks of 32 with one scale).  The embedding table stays fp32 (a tied head gets its own quantized copy).
In every method attention, norms and every positional computation stay fp32.
The exporter feeds weights through Transpose nodes, which the quantizer does not see through, so those transposes
are folded into the initializers first (the fp32 graph computes the same).

A quantized copy cannot match fp32 to 1e-4, so instead of the parity tolerances it must meet a budget on held-out
text the model never trained on (export/budget.py), at the trained context and at 4x it (where the model's positions
allow): the top-1 next token agrees with fp32's on >= 97% of positions, and nats per byte rise by at most 2%.  A copy
that misses is not written.  model.json records the method, the source artifact's sha256 and the measured budget.

A source with a fast graph (export/fuse.py; `fast="on"` for any source) gives its copy one too: the fp32 fast graph
(fused norms, the last-position head, the compact cache where the model allows it) is rebuilt from the source's
exact graph and quantized by the same method, so the copy's worker calls get the fused graph's gains.  It cannot be
held to the fp32 fast graph's 1e-4 parity (a fused norm rounding apart moves a quantized activation a whole step),
so it is held to the same budget against the fp32 exact graph instead, recorded as model.json's `fast.budget`; a
fast graph that misses refuses the whole copy.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import numpy_helper
from onnxruntime.quantization import QuantType, quantize_dynamic
from onnxruntime.quantization.matmul_nbits_quantizer import DefaultWeightOnlyQuantConfig, MatMulNBitsQuantizer
from tokenizers import Tokenizer

from export import artifact, fuse, profile, smooth
from export.budget import MAX_NATS_RATIO, MIN_TOP1, check_budget, feeds, missed
from export.errors import ExportError
from model.corpus import train_text
from model.files import sha256_file

METHODS = ("dynamic", "int8", "int4")
BITS = {"int8": 8, "int4": 4}
BLOCK = 32
# int4 loses more: its default budget is looser (measured on the trained default models: docs/peers.md)
DEFAULT_BUDGET = {"dynamic": (MIN_TOP1, MAX_NATS_RATIO), "int8": (MIN_TOP1, MAX_NATS_RATIO), "int4": (0.90, 1.05)}
DYNAMIC_WEIGHTS = "int8 per channel, 7-bit range"  # model.json's quantization.weights for a dynamic copy
FAST_CHOICES = ("auto", "on", "off")  # auto: a fast graph when the source has one


def fold_weight_transposes(model):
    """Transpose(initializer) nodes replaced by the transposed initializer, so MatMul weights are constants."""
    graph = model.graph
    inits = {i.name: i for i in graph.initializer}
    users: dict[str, int] = {}
    for n in graph.node:
        for name in n.input:
            users[name] = users.get(name, 0) + 1
    kept = []
    for n in graph.node:
        if n.op_type == "Transpose" and n.input[0] in inits:
            perm = next((list(a.ints) for a in n.attribute if a.name == "perm"), None)
            value = numpy_helper.to_array(inits[n.input[0]])
            value = value.transpose(perm) if perm else value.T
            graph.initializer.append(numpy_helper.from_array(np.ascontiguousarray(value), n.output[0]))
            users[n.input[0]] -= 1
        else:
            kept.append(n)
    del graph.node[:]
    graph.node.extend(kept)
    unused = [i for i in graph.initializer if users.get(i.name, 0) == 0 and i.name in inits]
    for i in unused:
        graph.initializer.remove(i)
    onnx.checker.check_model(model)
    return model


def calibration_windows(meta: dict[str, Any], folder: Path, corpus: str | None) -> list[np.ndarray]:
    """smooth.WINDOWS windows of the corpus's training part (never the held-out text) as the model's tokens."""
    text = train_text(corpus)
    tok = meta.get("tokenizer") or {}
    if tok.get("file"):
        ids = Tokenizer.from_file(str(folder / tok["file"])).encode(text[:200_000], add_special_tokens=False).ids
    else:
        ids = list(text.encode("utf-8"))
    n = max(2, min(smooth.LENGTH, int(meta["trained_context"])))
    return [np.asarray(ids[i:i + n], np.int64) for i in range(0, min(len(ids), smooth.WINDOWS * n), n)
            if len(ids[i:i + n]) > 1]


def quantize_nbits(folded: Path, dest: Path, bits: int) -> None:
    """MatMul(x, constant W) -> MatMulNBits(x, W in `bits`-bit blocks of BLOCK along K, symmetric)."""
    cfg = DefaultWeightOnlyQuantConfig(block_size=BLOCK, is_symmetric=True, accuracy_level=4, bits=bits)
    q = MatMulNBitsQuantizer(onnx.load(str(folded)), bits=bits, block_size=BLOCK, is_symmetric=True,
                             accuracy_level=4, algo_config=cfg)
    q.process()
    model = q.model.model
    if not any(n.op_type == "MatMulNBits" for n in model.graph.node):
        raise ExportError("the quantizer found no MatMul with a constant weight to make MatMulNBits")
    onnx.save_model(model, str(dest))


def quantize_graph(src: Path, dest: Path, method: str,
                   calibration: tuple[dict[str, Any], list[np.ndarray]] | None = None) -> dict[str, Any] | None:
    """dest <- src's MatMul (and, for dynamic, Gemm) weights quantized by `method`; src's weights are constants.
    With calibration (model.json and token windows), dynamic first smooths the gated MLPs' down projections
    (export/smooth.py) and returns that record."""
    record = None
    if method == "dynamic" and calibration is not None:
        meta, windows = calibration
        smoothed = dest.with_name("smoothed.onnx")
        record = smooth.smooth(src, smoothed, windows, lambda session, ids: feeds(session, meta, ids))
        src = smoothed
    logging.disable(logging.WARNING)  # "consider pre-processing": constant weights are the part that matters
    try:
        if method == "dynamic":
            quantize_dynamic(str(src), str(dest), weight_type=QuantType.QInt8, per_channel=True,
                             reduce_range=True, op_types_to_quantize=["MatMul", "Gemm"])
        else:
            quantize_nbits(src, dest, BITS[method])
    finally:
        logging.disable(logging.NOTSET)
        if record is not None:
            for stale in (src, src.with_name(src.name + ".data")):
                stale.unlink(missing_ok=True)
    return record


def quantized_fast(src: Path, tmp: Path, method: str, meta: dict[str, Any],
                   calibration: tuple[dict[str, Any], list[np.ndarray]] | None = None) -> dict[str, Any]:
    """tmp/fast.onnx (+ .data): the fp32 fast graph built from src's exact graph, quantized by `method`; returns its
    model.json entry (its budget still to be added).  The fast graph's weights are already MatMul's constants."""
    work = tmp / "fast-fp32"
    work.mkdir()
    made = fuse.build_fast(src / artifact.MODEL_ONNX, work / fuse.FAST_ONNX, meta,
                           (meta.get("fast") or {}).get("layout"))
    smoothing = quantize_graph(work / fuse.FAST_ONNX, work / "quantized.onnx", method, calibration)
    dest = tmp / fuse.FAST_ONNX
    data = dest.with_name(dest.name + ".data")
    # weights in fast.onnx.data, which onnxruntime maps, as the fp32 fast graph has them
    onnx.save_model(onnx.load(str(work / "quantized.onnx")), str(dest), save_as_external_data=True,
                    location=data.name)
    shutil.rmtree(work)
    entry = {"file": fuse.FAST_ONNX, "external_data": data.name if data.exists() else None, **made}
    return entry if smoothing is None else {**entry, "smoothing": smoothing}


def quantize_artifact(src: str | Path, out: str | Path, method: str = "dynamic", force: bool = False,
                      corpus: str | None = None, min_top1: float | None = None,
                      max_nats_ratio: float | None = None, fast: str = "auto",
                      smoothing: bool = True) -> dict[str, Any]:
    """Write a quantized copy of `src` at `out` (atomically) and return its budget report; a missed budget (of
    the exact graph or of the fast graph) writes nothing and raises ExportError naming the figure.  The budget
    defaults to the method's (DEFAULT_BUDGET).  fast: auto (a fast graph when src has one), on, off.  smoothing:
    dynamic smooths gated MLPs' down projections first (export/smooth.py), calibrated on the corpus's training part."""
    src, out = Path(src), Path(out)
    if method not in METHODS:
        raise ExportError(f"unknown quantization method {method!r}; supported: {', '.join(METHODS)}")
    if fast not in FAST_CHOICES:
        raise ExportError(f"fast graph must be one of {', '.join(FAST_CHOICES)}, got {fast!r}")
    min_top1 = DEFAULT_BUDGET[method][0] if min_top1 is None else min_top1
    max_nats_ratio = DEFAULT_BUDGET[method][1] if max_nats_ratio is None else max_nats_ratio
    manifest = artifact.verify(src)
    meta = artifact.read_json(src / artifact.MODEL_JSON)
    if meta.get("quantization"):
        raise ExportError(f"{src} is already quantized ({meta['quantization']['method']}); quantize the fp32 one")
    with artifact.staging(out, force) as tmp:
        folded = tmp / "folded.onnx"
        onnx.save_model(fold_weight_transposes(onnx.load(str(src / artifact.MODEL_ONNX))), str(folded))
        calibration = (meta, calibration_windows(meta, src, corpus)) if smoothing and method == "dynamic" else None
        smoothed = quantize_graph(folded, tmp / artifact.MODEL_ONNX, method, calibration)
        folded.unlink()
        fp32_fast = meta.get("fast") or {}
        dropped = {artifact.MODEL_ONNX, artifact.MODEL_DATA, artifact.MODEL_JSON, fp32_fast.get("file"),
                   fp32_fast.get("external_data"), (meta.get("profile") or {}).get("file"),
                   *[(meta.get("intervene") or {}).get(k) for k in ("file", "profile_file", "maps_file",
                                                                       "maps_profile_file")]}
        # a fast graph is the fp32 one: the copy keeps its exact graph alone; its profile graph is rebuilt below
        # from the quantized model.onnx, so a profile shows the attention of the weights the copy serves
        for name in manifest["files"]:
            if name not in dropped:
                shutil.copyfile(src / name, tmp / name)
        report = check_budget(src / artifact.MODEL_ONNX, tmp / artifact.MODEL_ONNX, meta, src, corpus,
                              min_top1=min_top1, max_nats_ratio=max_nats_ratio)
        if not report["passed"]:
            raise ExportError(missed(f"{method} copy of {src.name}", report))
        entry = None
        if fast == "on" or (fast == "auto" and meta.get("fast")):
            entry = quantized_fast(src, tmp, method, meta, calibration)
            entry["budget"] = check_budget(src / artifact.MODEL_ONNX, tmp / fuse.FAST_ONNX, meta, src, corpus,
                                           min_top1=min_top1, max_nats_ratio=max_nats_ratio)
            if not entry["budget"]["passed"]:
                raise ExportError(missed(f"{method} fast graph of {src.name}", entry["budget"]))
            entry["source_sha256"] = sha256_file(tmp / artifact.MODEL_ONNX)  # served with this copy's exact graph
        meta = dict(meta, name=out.name, onnx_external_data=None)
        meta.pop("fast", None)
        meta.pop("intervene", None)  # traced from the fp32 model: the copy answers no interventions
        if entry is not None:
            meta["fast"] = entry
        if meta.get("profile"):
            meta["profile"] = profile.add_profile(tmp, meta)
        weights = DYNAMIC_WEIGHTS if method == "dynamic" else f"{method} blocks of {BLOCK}, symmetric"
        meta["quantization"] = {"method": method, "weights": weights,
                                "ops": ["MatMul", "Gemm"] if method == "dynamic" else ["MatMulNBits"],
                                "source": str(src), "source_sha256": manifest["files"][artifact.MODEL_ONNX]["sha256"],
                                "smoothing": smoothed, "budget": report}
        artifact.write_json(tmp / artifact.MODEL_JSON, meta)
        artifact.write_manifest(tmp, {"kind": f"{method} budget against the fp32 artifact", **report})
    return report
