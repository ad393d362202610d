"""make bench: ONNX Runtime against PyTorch, serving overhead, batching, KV-cache generation, footprint.

  python -m bench run [--artifacts artifacts] [--quick] [--out bench/results]

Every ratio is measured against its baseline in the same run on the same machine; results go to
<out>/latest.json and <out>/latest.md.  Benchmarks report; they never assert.
"""

from __future__ import annotations

import json
import os
import platform
import tempfile
import time
from pathlib import Path

import numpy as np

from bench import http as http_bench
from bench import logprobs as logprobs_bench
from bench import profile_memory
from bench import quant as quant_bench
from bench.engines import feeds, iobinding_runner, session, torch_forward
from bench.lib.results import write
from bench.lib.worker import Worker
from bench.serving import bench_batching, bench_serving
from bench.timing import interleaved, paired_ratio
from model.cli import Parser

ROOT = Path(__file__).resolve().parent.parent
PYTORCH = "pytorch eager (2 threads)"


def reference(artifact: Path):
    """The PyTorch model with the artifact's own weights (export.validate rebuilds it from the graph)."""
    import onnx
    import torch

    from export.validate import reference_from_graph
    from model.config import ModelConfig

    torch.set_num_threads(2)
    meta = json.loads((artifact / "model.json").read_text())
    return reference_from_graph(onnx.load(str(artifact / "model.onnx")), ModelConfig.from_dict(meta["config"]))


# --- 1. in-process forward with attention maps --------------------------------------------------------------

def other_graph(art: Path, model, out: Path) -> tuple[str, Path]:
    """The same weights exported with the other attention kind (not the artifact's): its engine name and path."""
    from export.build import export_onnx

    kind = json.loads((art / "model.json").read_text()).get("attention", "explicit")
    other, opset = ("explicit", 18) if kind == "onnx" else ("onnx", 23)
    export_onnx(model, out, opset, other)
    return f"ort, {other} attention graph (opset {opset})", out


def bench_forward(art: Path, lengths: list[int], repeat: int) -> list[dict]:
    model = reference(art)
    kind = json.loads((art / "model.json").read_text()).get("attention", "explicit")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        other_name, other_path = other_graph(art, model, Path(tmp) / "other.onnx")
        for n in lengths:
            ids = np.random.default_rng(n).integers(0, 256, (1, n)).astype(np.int64)
            default = session(art / "model.onnx")
            f = feeds(default, ids)
            saved = Path(tmp) / "optimized.onnx"
            session(art / "model.onnx", level="EXTENDED", optimized_out=saved)  # writes the optimised graph
            preopt = session(saved, level="DISABLE")
            sessions = {f"ort ALL, 2 threads ({kind} attention: the artifact)": default,
                        other_name: session(other_path),
                        "ort ALL, 1 thread": session(art / "model.onnx", threads=1),
                        "ort BASIC": session(art / "model.onnx", level="BASIC"), "ort saved EXTENDED graph": preopt,
                        "ort ALL, no spinning": session(art / "model.onnx", spinning=False)}
            engines = {PYTORCH: torch_forward(model, ids)}
            engines.update({name: (lambda s=s, f=f: s.run(None, f)) for name, s in sessions.items()})
            engines["ort ALL + IOBinding"] = iobinding_runner(default, f)
            times = interleaved(engines, repeat)
            for name, t in times.items():
                rows.append({"model": art.name, "seq": n, "engine": name, **t,
                             "speedup_vs_pytorch": paired_ratio(times, PYTORCH, name)})
    return rows


# --- 4. generation: KV cache against recomputing the prefix ---------------------------------------------------

def bench_generation(art: Path, new_tokens: int) -> dict:
    sess = session(art / "model.onnx")
    prompt = np.random.default_rng(0).integers(32, 128, (1, 8)).astype(np.int64)
    n_state = len(sess.get_inputs()) - 2
    names = ["logits"] + [o.name for o in sess.get_outputs() if o.name.startswith("present")]

    def cached() -> list[float]:
        out = sess.run(names, feeds(sess, prompt))
        steps = []
        for _ in range(new_tokens):
            nxt = np.array([[out[0][0, -1].argmax()]], np.int64)
            t = time.perf_counter()
            out = sess.run(names, feeds(sess, nxt, out[1:1 + n_state]))
            steps.append(time.perf_counter() - t)
        return steps

    def recompute() -> None:
        seq = prompt
        for _ in range(new_tokens):
            logits = sess.run(["logits"], feeds(sess, seq))[0]
            seq = np.concatenate([seq, [[logits[0, -1].argmax()]]], axis=1)

    cached()  # warm-up
    t = time.perf_counter()
    steps = cached()
    kv_s = time.perf_counter() - t
    t = time.perf_counter()
    recompute()
    full_s = time.perf_counter() - t
    at = lambda p: float(np.median(steps[max(0, p - 3):p + 2]) * 1000)  # noqa: E731 - median around position p
    late = min(256, new_tokens) - 1
    return {"model": art.name, "new_tokens": new_tokens, "kv_tokens_per_s": new_tokens / kv_s,
            "recompute_tokens_per_s": new_tokens / full_s, "speedup": full_s / kv_s,
            "step_ms_at_16": at(min(16, late)), f"step_ms_at_{late + 1}": at(late),
            "late_over_early": at(late) / at(min(16, late))}


# --- 5. footprint -------------------------------------------------------------------------------------------

def bench_footprint(art_dir: Path, soak_paths: list[Path]) -> dict:
    """The worker's resident memory idle, right after it reports SERVING (every model loaded and warmed up once),
    and, beside it, the soak's memory under load from the newest soak.json found (make soak)."""
    with Worker(art_dir) as worker:
        rss_kb = int(next(x for x in Path(f"/proc/{worker.proc.pid}/status").read_text().splitlines()
                          if x.startswith("VmRSS")).split()[1])
        seconds = worker.started_s
    models = sorted(p.name for p in art_dir.iterdir() if (p / "manifest.json").is_file())
    out = {"models": models, "rss_mb": rss_kb / 1024, "rss_when": "idle, right after SERVING",
           "start_to_serving_s": seconds, "soak": None}
    found = [p for p in soak_paths if p.is_file()]
    if found:
        newest = max(found, key=lambda p: p.stat().st_mtime)
        soak = json.loads(newest.read_text())
        mem = soak.get("memory_mb", {})
        out["soak"] = {"file": str(newest), "models": len(soak.get("settings", {}).get("models", [])),
                       "requests": soak.get("requests"), "callers": soak.get("settings", {}).get("callers"),
                       "rss_start_mb": mem.get("start"), "rss_last_tenth_mb": mem.get("last_tenth_mean"),
                       "rss_peak_mb": mem.get("peak")}
    return out


# --- report -------------------------------------------------------------------------------------------------

def ms(x: dict) -> list:
    return [f"{x['median_ms']:.2f}", f"{x['p10_ms']:.2f}-{x['p90_ms']:.2f}"]


def targets(r: dict) -> dict:
    """Each target of make bench beside this run's figure."""
    art = next((x for x in r["forward"] if x["engine"].endswith("the artifact)") and x["seq"] == 128), None)
    serving = {x["path"]: x["ratio_vs_in_process"] for x in r["serving"]}
    predict = {(x["batching"], x["concurrency"]): x for x in r["batching"]["predict"]}
    streams = {(x["batching"], x["streams"]): x for x in r["batching"]["generate"]}
    g, f = r["generation"], r["footprint"]
    late = next(k for k in g if k.startswith("step_ms_at_") and k != "step_ms_at_16")
    rows = []
    if art:
        rows.append(["onnxruntime >= 2x PyTorch eager at 128 tokens, with attention maps",
                     f"{art['speedup_vs_pytorch']:.2f}x", art["speedup_vs_pytorch"] >= 2])
    for path, most, what in (("gRPC Predict (no maps)", 1.3, "no maps"),
                             ("gRPC Predict (full maps)", 1.6, "full maps")):
        if path in serving:
            rows.append([f"Predict over gRPC <= {most}x the in-process call, {what}", f"{serving[path]:.2f}x",
                         serving[path] <= most])
    top = max(c for b, c in predict if b)
    x = predict.get((True, top))
    if x:
        rows.append([f"Predict batching: >= 3x the requests/s at {top} callers vs 1",
                     f"{x['speedup_vs_concurrency_1']:.2f}x", x["speedup_vs_concurrency_1"] >= 3])
    top = max(s for b, s in streams if b)
    x = streams.get((True, top))
    if x:
        rows.append([f"Generate: {top} streams >= 3x the tokens/s of one", f"{x['speedup_vs_concurrency_1']:.2f}x",
                     x["speedup_vs_concurrency_1"] >= 3])
    rows.append([f"KV cache >= 5x recomputing the prefix ({g['new_tokens']} tokens)", f"{g['speedup']:.1f}x",
                 g["speedup"] >= 5])
    rows.append([f"step at position {late.rsplit('_', 1)[1]} <= 2x the step at 16", f"{g['late_over_early']:.2f}x",
                 g["late_over_early"] <= 2])
    if "profile_memory" in r:
        pm = r["profile_memory"]
        rows.append([f"a {pm['length']}-token profile's peak RSS <= 1.5x the same call without maps (GPT-2 small)",
                     f"{pm['ratio']:.2f}x", pm["ratio"] <= 1.5])
    rows.append(["worker RSS idle <= 400 MB, every default model loaded", f"{f['rss_mb']:.0f} MB", f["rss_mb"] <= 400])
    rows.append(["start to SERVING <= 3 s", f"{f['start_to_serving_s']:.2f} s", f["start_to_serving_s"] <= 3])
    return {"title": "Targets", "columns": ["target", "this run", "met"], "rows": rows}


def tables(r: dict) -> dict:
    """Every table of the run, in the results convention (docs/tools/fill.py renders them into the docs; latest.md)."""
    b, g, f = r["batching"], r["generation"], r["footprint"]
    late = next(k for k in g if k.startswith("step_ms_at_") and k != "step_ms_at_16")
    soak = f.get("soak")
    out = {"targets": targets(r)}
    out["forward"] = {
        "title": "1. Forward with attention maps, batch 1 (median ms; speedup = PyTorch eager / engine, the median of "
                 "ratios between blocks run back to back)",
        "columns": ["model", "seq", "engine", "median ms", "p10-p90", "speedup"],
        "rows": [[x["model"], x["seq"], x["engine"], *ms(x), f"{x['speedup_vs_pytorch']:.2f}x"] for x in r["forward"]]}
    out["serving"] = {
        "title": "2. Serving overhead (Predict over gRPC on loopback to a worker in its own process vs the same "
                 "onnxruntime call in this process, fetching what the worker's engine fetches; ratio = median of "
                 "paired block ratios)",
        "columns": ["path", "seq", "median ms", "p10-p90", "ratio"],
        "rows": [[x["path"], x["seq"], *ms(x), f"{x['ratio_vs_in_process']:.2f}"] for x in r["serving"]]}
    out["batching"] = {
        "title": "3. Dynamic batching (Predict requests/s, the same prompts of 16-128 tokens at every concurrency, "
                 "after a warm-up round; req/s = median over rounds, speedup = median of per-round ratios)",
        "columns": ["batching", "concurrency", "requests", "req/s", "vs concurrency 1"],
        "rows": [["on" if x["batching"] else "off", x["concurrency"], x["requests"], f"{x['rps']:.1f}",
                  f"{x['speedup_vs_concurrency_1']:.2f}x"] for x in b["predict"]]}
    out["streams"] = {
        "title": "Generate streams (the same streams at every level, N open at once; tokens/s, all together; batching "
                 "on = the decode loop steps every open stream in one onnxruntime call, off = --max-batch 1)",
        "columns": ["batching", "streams at once", "tokens", "tokens/s", "vs 1 at once", "first token p50", "p99"],
        "rows": [["on" if x["batching"] else "off", x["streams"], x["tokens"], f"{x['tokens_per_s']:.0f}",
                  f"{x['speedup_vs_concurrency_1']:.2f}x", f"{x['ttft_p50_ms']:.1f} ms", f"{x['ttft_p99_ms']:.1f} ms"]
                 for x in b["generate"]]}
    out["rows"] = {
        "title": "onnxruntime alone, one call of B rows x 72 tokens (what batching prompts can gain)",
        "columns": ["rows", "median ms", "ms per row", "cost of a row vs batch 1"],
        "rows": [[x["batch"], f"{x['median_ms']:.2f}", f"{x['ms_per_row']:.2f}", f"{x['row_cost_vs_batch_1']:.2f}"]
                 for x in b["onnxruntime_per_row"]]}
    out["generation"] = {
        "title": f"4. Generation ({g['new_tokens']} new tokens, {g['model']})",
        "columns": ["KV cache tok/s", "recompute tok/s", "speedup", "step at 16", f"step at {late.rsplit('_', 1)[1]}",
                    "late/early"],
        "rows": [[f"{g['kv_tokens_per_s']:.0f}", f"{g['recompute_tokens_per_s']:.0f}", f"{g['speedup']:.1f}x",
                  f"{g['step_ms_at_16']:.2f} ms", f"{g[late]:.2f} ms", f"{g['late_over_early']:.2f}"]]}
    out["footprint"] = {
        "title": "5. Footprint",
        "columns": ["models", "worker RSS idle, right after SERVING", "the soak's RSS under load", "start to SERVING"],
        "rows": [[len(f["models"]), f"{f['rss_mb']:.0f} MB",
                  f"{soak['rss_last_tenth_mb']:.0f} MB mean over its last tenth, {soak['rss_peak_mb']:.0f} MB peak "
                  f"({soak['models']} models, {soak['requests']} requests from {soak['callers']} callers)"
                  if soak else "no soak.json (make soak)", f"{f['start_to_serving_s']:.2f} s"]]}
    if "http" in r:
        out["http"] = http_bench.table(r["http"])
    if "quant" in r:
        out.update(quant_bench.tables(r["quant"]))
    if "profile_memory" in r:
        out["profile_memory"] = profile_memory.table(r["profile_memory"])
    return out


def run_meta(r: dict, command: str) -> dict:
    m = r["machine"]
    return {"date": r["date"], "machine": f"{m['cpus']} CPUs ({m['processor']}), Python {m['python']}, onnxruntime "
            f"{m['onnxruntime']}, torch {m['torch']}", "load": r.get("load"), "command": command}


def main(argv: list[str] | None = None) -> int:
    p = Parser(prog="python -m bench run", description=__doc__.splitlines()[0])
    p.add_argument("--artifacts", default="artifacts")
    p.add_argument("--model", default="rope", help="the model for the single-model benchmarks")
    p.add_argument("--quick", action="store_true", help="a couple of iterations of each (the smoke test)")
    p.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = p.parse_args(argv)
    import onnxruntime
    import torch

    art_dir = Path(args.artifacts)
    art = art_dir / args.model
    q = args.quick
    meta = json.loads((art / "model.json").read_text())
    ctx = meta["trained_context"]
    results = {
        "date": time.strftime("%Y-%m-%dT%H:%MZ", time.gmtime()), "quick": q, "load": list(os.getloadavg()),
        "machine": {"cpus": os.cpu_count(), "processor": platform.processor() or platform.machine(),
                    "python": platform.python_version(), "onnxruntime": onnxruntime.__version__,
                    "torch": torch.__version__},
    }
    results["forward"] = bench_forward(art, [ctx // 4, ctx] if q else [32, 128, 512], 2 if q else 300)
    results["serving"] = bench_serving(art_dir, args.model, ctx, 2 if q else 300)
    results["batching"] = bench_batching(art_dir, args.model, [1, 4] if q else [1, 8, 32], 1 if q else 8,
                                         4 if q else 64, 1 if q else 3)
    results["generation"] = bench_generation(art, 24 if q else 256)
    results["footprint"] = bench_footprint(art_dir, [Path(args.out) / "soak.json",
                                                     ROOT / "bench" / "results" / "soak.json"])
    results["http"] = http_bench.bench_http(art_dir, args.model, ctx, 2 if q else 300)
    results["quant"] = quant_bench.bench_quant(art_dir, args.model, [ctx // 4, ctx] if q else [128, 512],
                                               2 if q else 300)
    results["logprobs"] = logprobs_bench.bench_logprobs(art_dir, [args.model], 24 if q else 256, 2 if q else 10,
                                                        Path(args.out))
    results["profile_memory"] = (  # a fresh process per call
        profile_memory.bench_profile_memory(length=ctx, art=art) if q
        else profile_memory.bench_profile_memory())
    profile_memory.write(results["profile_memory"], Path(args.out), "make bench")  # docs/profiles.md's table
    results["load_at_end"] = list(os.getloadavg())
    results["meta"] = run_meta(results, "make bench" + (" (python -m bench run --quick)" if q else ""))
    results["tables"] = tables(results)
    print(write(Path(args.out), "latest", results, indent=2))
    return 0

