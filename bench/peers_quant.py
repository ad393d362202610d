"""The quantized copies' accuracy on a model trained here, and their speed (`python -m bench peers-quant`).

For a trained fp32 artifact (default: artifacts/rope from `make models`), every `export quantize` method
(dynamic, int8, int4) is written to a temporary folder with the budget check set so the copy is always written,
and its measured figures are compared here with the method's own default budget (export/quantize.py's
DEFAULT_BUDGET): top-1 agreement with fp32 on held-out text, nats/byte against fp32's, model size, and the
logits-only forward at 128 tokens and one decode step after it, each copy timed against fp32 in alternating
blocks (ratio = fp32 time / copy time, the median of paired block ratios).

Results: bench/results/peers_quant.{json,md} in the results convention.  Benchmarks report; they never assert.
"""

from __future__ import annotations

import json
import os
import platform
import tempfile
from datetime import UTC, datetime
from pathlib import Path

import numpy as np

from bench.engines import feeds as engine_feeds
from bench.engines import session
from bench.lib.results import write
from bench.timing import interleaved, paired_ratio
from export.quantize import DEFAULT_BUDGET, METHODS, quantize_artifact
from model.cli import Parser

ROOT = Path(__file__).resolve().parent.parent


def step_feeds(sess, meta: dict, n: int) -> dict:
    """Feeds of one decode step after an n-token prompt (the prompt's present cache)."""
    ids = np.random.default_rng(n).integers(32, 128, (1, n)).astype(np.int64)
    res = sess.run(["logits"] + [st["output"] for st in meta["state"]], engine_feeds(sess, ids))
    return {"input_ids": res[0][:, -1:].argmax(-1).astype(np.int64), "attention_mask": np.ones((1, n + 1), np.int64),
            **{st["input"]: r for st, r in zip(meta["state"], res[1:], strict=True)}}


def main(argv: list[str] | None = None) -> int:
    p = Parser(prog="python -m bench peers-quant", description=__doc__.split("\n\n")[0])
    p.add_argument("--artifact", type=Path, default=ROOT / "artifacts" / "rope")
    p.add_argument("--repeat", type=int, default=20)
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = p.parse_args(argv)
    if not (args.artifact / "manifest.json").is_file():
        p.exit(2, f"python -m bench peers-quant: error: no artifact at {args.artifact} (make models makes it)\n")
    meta = json.loads((args.artifact / "model.json").read_text())
    res: dict = {"meta": {"date": datetime.now(UTC).isoformat(timespec="seconds"),
                          "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.node()}",
                          "load": [round(x, 2) for x in os.getloadavg()], "command": "python -m bench peers-quant",
                          "artifact": str(args.artifact), "trained": bool(meta.get("training"))},
                 "methods": {}}
    fp32 = session(args.artifact / "model.onnx")
    ids = np.random.default_rng(0).integers(32, 128, (1, 128)).astype(np.int64)
    with tempfile.TemporaryDirectory() as tmp:
        for method in METHODS:
            out = Path(tmp) / f"{args.artifact.name}-{method}"
            report = quantize_artifact(args.artifact, out, method, min_top1=0.0, max_nats_ratio=1e9)
            low, high = DEFAULT_BUDGET[method]
            q = session(out / "model.onnx")
            f_fwd, q_fwd = engine_feeds(fp32, ids), engine_feeds(q, ids)
            f_step, q_step = step_feeds(fp32, meta, 128), step_feeds(q, meta, 128)
            times = interleaved({"fp32 forward": lambda f=f_fwd: fp32.run(["logits"], f),
                                 "copy forward": lambda f=q_fwd, s=q: s.run(["logits"], f),
                                 "fp32 step": lambda f=f_step: fp32.run(["logits"], f),
                                 "copy step": lambda f=q_step, s=q: s.run(["logits"], f)}, args.repeat)
            res["methods"][method] = {
                "budget": {"min_top1": low, "max_nats_ratio": high}, "rows": report["rows"],
                "within_budget": all(r["top1_agreement"] >= low and r["nats_ratio"] <= high for r in report["rows"]),
                "bytes": sum(f.stat().st_size for f in out.glob("model.onnx*")),
                "fp32_bytes": sum(f.stat().st_size for f in args.artifact.glob("model.onnx*")),
                "forward_ms": round(times["copy forward"]["median_ms"], 2),
                "fp32_forward_ms": round(times["fp32 forward"]["median_ms"], 2),
                "forward_speedup": round(paired_ratio(times, "fp32 forward", "copy forward"), 3),
                "step_ms": round(times["copy step"]["median_ms"], 3),
                "fp32_step_ms": round(times["fp32 step"]["median_ms"], 3),
                "step_speedup": round(paired_ratio(times, "fp32 step", "copy step"), 3)}
    res["meta"]["load_end"] = [round(x, 2) for x in os.getloadavg()]
    res["tables"] = {
        "budget": {"columns": ["method", "tokens", "top-1 agreement", "nats/byte fp32", "nats/byte copy", "ratio",
                               "budget", "within"],
                   "rows": [[m, r["length"], f"{r['top1_agreement']:.3f}", f"{r['nats_per_byte_fp32']:.4f}",
                             f"{r['nats_per_byte_int8']:.4f}", f"x{r['nats_ratio']:.3f}",
                             f">= {d['budget']['min_top1']}, <= x{d['budget']['max_nats_ratio']}",
                             r["top1_agreement"] >= d["budget"]["min_top1"]
                             and r["nats_ratio"] <= d["budget"]["max_nats_ratio"]]
                            for m, d in res["methods"].items() for r in d["rows"]]},
        "speed": {"columns": ["method", "MB (fp32 MB)", "forward 128 ms (fp32)", "forward speedup",
                              "decode step ms (fp32)", "step speedup"],
                  "rows": [[m, f"{d['bytes'] / 1e6:.1f} ({d['fp32_bytes'] / 1e6:.1f})",
                            f"{d['forward_ms']} ({d['fp32_forward_ms']})", f"{d['forward_speedup']:.2f}x",
                            f"{d['step_ms']} ({d['fp32_step_ms']})", f"{d['step_speedup']:.2f}x"]
                           for m, d in res["methods"].items()]}}
    print(write(args.out, "peers_quant", res))
    return 0

