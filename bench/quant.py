"""Section 7 of make bench: an int8 copy (export quantize, the default budget) against its fp32 artifact at 128 and
512 tokens, logits only, in one onnxruntime process, interleaved like every other ratio here."""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np

from bench.engines import feeds, session
from bench.timing import interleaved, paired_ratio
from export.errors import ExportError
from export.quantize import quantize_artifact


def bench_quant(art_dir: Path, model: str, lengths: list[int], repeat: int) -> dict:
    src = art_dir / model
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / f"{model}-int8"
        try:
            budget = quantize_artifact(src, out)
        except ExportError as err:  # the budget missed: say so, and time the copy anyway under a loose budget
            budget = {"passed": False, "error": str(err)}
            quantize_artifact(src, out, force=True, min_top1=0.0, max_nats_ratio=10.0)
        fp32, int8 = session(src / "model.onnx"), session(out / "model.onnx")
        size = {"fp32_bytes": (src / "model.onnx").stat().st_size, "int8_bytes": (out / "model.onnx").stat().st_size}
        rows = []
        for n in lengths:
            ids = np.random.default_rng(n).integers(32, 128, (1, n)).astype(np.int64)
            f32, f8 = feeds(fp32, ids), feeds(int8, ids)
            times = interleaved({"fp32": lambda f=f32: fp32.run(["logits"], f),
                                 "int8": lambda f=f8: int8.run(["logits"], f)}, repeat)
            rows.append({"model": model, "tokens": n, "fp32_ms": times["fp32"]["median_ms"],
                         "int8_ms": times["int8"]["median_ms"], "int8_speedup": paired_ratio(times, "fp32", "int8")})
    return {"budget": budget, "size": size, "rows": rows}


def tables(q: dict) -> dict:
    """Section 7 in the results convention: the int8 copy's speed, and its accuracy against the budget."""
    b, size = q["budget"], q["size"]
    speed = {"title": f"7. int8 copy (`export quantize`, dynamic, MatMul/Gemm weights per channel) vs fp32, logits "
                      f"only, batch 1; speedup = fp32 / int8, median of paired block ratios. model.onnx "
                      f"{size['fp32_bytes'] / 1e6:.1f} MB -> {size['int8_bytes'] / 1e6:.1f} MB",
             "columns": ["model", "tokens", "fp32 ms", "int8 ms", "int8 speedup"],
             "rows": [[r["model"], r["tokens"], f"{r['fp32_ms']:.2f}", f"{r['int8_ms']:.2f}",
                       f"{r['int8_speedup']:.2f}x"] for r in q["rows"]]}
    top1, ratio = b.get("min_top1_agreement", 0.97), b.get("max_nats_ratio", 1.02)  # absent when the budget failed
    budget = {"title": f"int8 accuracy against fp32 on held-out text (budget: top-1 agreement >= {top1}, nats/byte "
                       f"at most x{ratio})",
              "columns": ["tokens", "top-1 agreement", "nats/byte fp32", "nats/byte int8", "ratio", "within budget"],
              "rows": [[r["length"], f"{r['top1_agreement']:.3f}", f"{r['nats_per_byte_fp32']:.4f}",
                        f"{r['nats_per_byte_int8']:.4f}", f"x{r['nats_ratio']:.3f}",
                        r["top1_agreement"] >= top1 and r["nats_ratio"] <= ratio]
                       for r in b.get("rows", [])],
              "note": None if b.get("passed") else f"Missed the budget: {b.get('error', '')}"}
    return {"quant": speed, "quant_budget": budget}
