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


def markdown(q: dict) -> list[str]:
    b = q["budget"]
    if b.get("passed"):
        said = "; ".join(f"{r['length']} tokens: top-1 agreement {r['top1_agreement']:.3f}, nats/byte "
                         f"x{r['nats_ratio']:.3f}" for r in b["rows"])
        verdict = f"within the budget (top-1 >= {b['min_top1_agreement']}, nats/byte <= x{b['max_nats_ratio']}): {said}"
    else:
        verdict = f"MISSED the budget ({b.get('error', '')}); timed anyway"
    size = q["size"]
    out = ["", f"**7. int8 copy** (`export quantize`, dynamic, MatMul/Gemm weights per channel) vs fp32, logits "
           f"only, batch 1; speedup = fp32 / int8, median of paired block ratios. model.onnx "
           f"{size['fp32_bytes'] / 1e6:.1f} MB -> {size['int8_bytes'] / 1e6:.1f} MB; {verdict}", "",
           "| model | tokens | fp32 ms | int8 ms | int8 speedup |", "|---|---|---|---|---|"]
    out += [f"| {r['model']} | {r['tokens']} | {r['fp32_ms']:.2f} | {r['int8_ms']:.2f} | {r['int8_speedup']:.2f}x |"
            for r in q["rows"]]
    return out
