"""Real-size Hugging Face imports (not part of make test; `make bench-real`): random-weight models of real sizes
built from configs (GPT2Config() = GPT-2 small, 124M; BLOOM-560m's sizes, over 2 GB in fp32 so external data is
exercised), saved with save_pretrained, then imported with `python -m export --from-hf` in a fresh process:
import + export + validation wall time and peak RSS (and per billion parameters), the import alone's, and the
speed of every engine on the same weights in one run (bench.real_speed): posenc's artifact in onnxruntime with
and without attention maps, its worker over gRPC (RSS with the model loaded, Predict, Generate), transformers
eager, and optimum-onnx's ORTModelForCausalLM in its own virtualenv (requirements/optimum.txt).

  python -m bench real-models [--models gpt2,bloom-560m] [--optimum-python .venv-optimum/bin/python]
                              [--optimum-models gpt2] [--work /tmp/posenc-real] [--out bench/results]

Results: bench/results/real_models.json and .md.  Needs transformers (build requirements) and, for BLOOM-560m,
about 8 GB of free memory.  Benchmarks report; they never assert.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

from bench.lib.results import write
from model.cli import Parser

ROOT = Path(__file__).resolve().parent.parent
SIZES = {
    "gpt2": ("GPT2Config", {}),  # GPT-2 small defaults: 12 layers, 768 wide, 12 heads, 1024 positions
    "bloom-560m": ("BloomConfig", {"hidden_size": 1024, "n_layer": 24, "n_head": 16, "vocab_size": 250880}),
}
LENGTH = 128


def tokenizer_json(vocab: int = 1000) -> str:
    """A byte-level BPE trained here on CPython's documentation (the real tokenizers need a download)."""
    from pydoc_data.topics import topics

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(list(topics.values()), trainer)
    return tok.to_str()


def make_folder(name: str, folder: Path) -> tuple[int, bool]:
    """folder <- config.json, model.safetensors, tokenizer.json of a random model of `name`'s size (seed 0);
    (parameters, whether it was built now).  A folder this bench built before for the same size is reused."""
    stamp = folder / "posenc-bench.json"
    want = {"size": SIZES[name][0], "config": SIZES[name][1], "seed": 0}
    if stamp.is_file() and (folder / "model.safetensors").is_file():
        done = json.loads(stamp.read_text())
        if {k: done.get(k) for k in want} == want:
            return done["parameters"], False
    import torch
    import transformers as tf

    torch.manual_seed(0)
    cls, kwargs = SIZES[name]
    model = tf.AutoModelForCausalLM.from_config(getattr(tf, cls)(**kwargs))
    model.save_pretrained(folder, safe_serialization=True)
    (folder / "tokenizer.json").write_text(tokenizer_json())
    params = sum(p.numel() for p in model.parameters())
    stamp.write_text(json.dumps({**want, "parameters": params}))
    return params, True


def measured(cmd: list[str]) -> dict:
    """Run cmd under /usr/bin/time -v: wall seconds, peak RSS (GB), exit code and the last output lines."""
    start = time.perf_counter()
    res = subprocess.run(["/usr/bin/time", "-v", *cmd], capture_output=True, text=True, cwd=ROOT)
    wall = time.perf_counter() - start
    rss_kb = next((int(line.split(":")[1]) for line in res.stderr.splitlines()
                   if "Maximum resident set size" in line), 0)
    own_err = res.stderr.split("\tCommand being timed")[0]  # what the command printed, before time's report
    tail = [line for line in (res.stdout + own_err).splitlines() if line.strip()][-3:]
    return {"wall_s": round(wall, 1), "peak_rss_gb": round(rss_kb / 1e6, 2), "exit": res.returncode, "tail": tail}


def run_one(name: str, work: Path, runs: int, optimum: str | None) -> dict:
    from bench.real_speed import measure_speed, summary

    folder, artifact = work / "hf" / name, work / "artifacts" / name / name  # the worker serves artifacts/NAME
    folder.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    params, built = make_folder(name, folder)
    optimum_dir = work / "optimum" / name
    if built and optimum_dir.exists():  # new weights: Optimum exports them again
        shutil.rmtree(optimum_dir)
    row = {"model": name, "measured": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "load_average_at_start": os.getloadavg()[0], "parameters": params,
           "save_s": round(time.perf_counter() - start, 1) if built else None}
    base = measured([sys.executable, "-c", "import model.hf"])  # python + torch + safetensors before any weight
    imp = measured([sys.executable, "-c", IMPORT_ONLY.format(folder=str(folder))])
    row["import_only"] = {**imp, "baseline_rss_gb": base["peak_rss_gb"],
                          "peak_rss_gb_per_billion_params": per_billion(imp, base, params)}
    full = measured([sys.executable, "-m", "export", "--from-hf", str(folder), "--out", str(artifact), "--force",
                     "--validate-max-length", str(LENGTH)])
    row["import_export_validate"] = {**full, "peak_rss_gb_per_billion_params": per_billion(full, base, params)}
    if full["exit"] == 0:
        row["files_mb"] = {p.name: round(p.stat().st_size / 1e6, 1) for p in sorted(artifact.iterdir())}
        manifest = json.loads((artifact / "manifest.json").read_text())
        row["validation"] = {"passed": manifest["validation"]["passed"],
                             "checks": len(manifest["validation"]["checks"])}
        row["speed"] = measure_speed(folder, artifact, (optimum, optimum_dir) if optimum else None, runs)
        row["summary"] = summary(row["speed"])
    row["load_average_at_end"] = os.getloadavg()[0]  # other work on the machine: timings above 2 are not quiet
    return row


def per_billion(run: dict, base: dict, params: int) -> float:
    """Peak RSS above the interpreter's own (python + torch), per 1e9 parameters."""
    return round((run["peak_rss_gb"] - base["peak_rss_gb"]) / (params / 1e9), 2)


# The import alone, in a fresh process: /proc's resident anonymous memory (the model's own copy of the weights) vs
# file-backed pages (the memory-mapped safetensors the kernel may drop) after the import.
IMPORT_ONLY = """
from model.hf import import_folder
m, _ = import_folder({folder!r})
status = dict(l.split(':', 1) for l in open('/proc/self/status'))
print('RssAnon', status['RssAnon'].strip(), 'RssFile', status['RssFile'].strip())
"""
def tables(report: dict) -> dict:
    """The run's tables in the results convention (docs/tools/fill.py renders them into the docs and real_models.md).
    Rows of different models may come from different runs: each says when it was measured and under what load."""
    out = {"imports": {"title": f"Real-size imports ({report['threads']} threads)",
                       "columns": ["model", "measured (load at start)", "parameters",
                                   "import only: wall s / peak RSS GB",
                                   "import + export + validate: wall s / peak RSS GB", "peak GB per 1e9 parameters",
                                   "validation", "worker RSS GB with the model loaded"], "rows": []}}
    targets = []
    for r in report["rows"]:
        imp, full = r["import_only"], r["import_export_validate"]
        status = "" if full["exit"] == 0 else f" (exit {full['exit']}: {' '.join(full['tail'])[:200]})"
        out["imports"]["rows"].append([
            r["model"], f"{r.get('measured', '?')} ({r.get('load_average_at_start', 0):.2f})",
            f"{r['parameters'] / 1e6:.0f}M",
            f"{imp['wall_s']} / {imp['peak_rss_gb']}", f"{full['wall_s']} / {full['peak_rss_gb']}{status}",
            full["peak_rss_gb_per_billion_params"], "passed" if r.get("validation", {}).get("passed") else "failed",
            r.get("summary", {}).get("worker_rss_gb")])
        speed = r.get("speed")
        if not speed:
            continue
        out[f"forward-{r['model']}"] = {
            "title": f"{r['model']}: one {speed['length']}-token forward, batch 1 (median ms; speedup = transformers "
                     "eager logits / engine; vs Optimum = engine / ORTModelForCausalLM, lower is faster)",
            "columns": ["engine", "median ms", "p10-p90", "speedup vs eager", "vs Optimum"],
            "rows": [[k, v["median_ms"], f"{v['p10_ms']}-{v['p90_ms']}", f"{speed['speedup_vs_eager'][k]}x",
                      speed.get("ratio_vs_optimum", {}).get(k)] for k, v in speed["forward_ms"].items()]}
        out[f"generate-{r['model']}"] = {
            "title": f"{r['model']}: {speed['new_tokens']} greedy tokens after the {speed['length']}-token prompt, KV "
                     "cache (prefill included)",
            "columns": ["engine", "median ms", "tokens/s", "vs baseline (>1 faster)", "same tokens as transformers"],
            "rows": [[k, v["median_ms"], v["tokens_per_s"], next((x for key, x in v.items()
                                                                  if key.startswith("speed_vs_")), None),
                      v["same_tokens_as_transformers"]] for k, v in speed["generate"].items()]}
        targets += [[r["model"], f"{t['engine']} at most {t['at_most']}x Optimum's", t["ratio"], t["met"]]
                    for t in (speed.get("targets") or {}).values()]
    if targets:
        out["targets"] = {"title": "Targets against Optimum's ORTModelForCausalLM",
                          "columns": ["model", "target", "ratio", "met"], "rows": targets}
    return out


def meta(report: dict) -> dict:
    """The newest row's date; each row records its own load average (rows of models not run stay from their run)."""
    return {"date": max(r.get("measured", "") for r in report["rows"]), "load": "load: each row's, at its start",
            "command": "make bench-real",
            "machine": f"{report['cpus']} CPUs, {report['machine']}, Python {report['python']}"}


def main(argv: list[str] | None = None) -> int:
    p = Parser(prog="python -m bench real-models", description=__doc__.splitlines()[0])
    p.add_argument("--models", default=",".join(SIZES))
    p.add_argument("--work", default="/tmp/posenc-real")
    p.add_argument("--out", default=str(ROOT / "bench" / "results"))
    p.add_argument("--runs", type=int, default=12, help="timed forwards per engine")
    p.add_argument("--optimum-python", default=str(ROOT / ".venv-optimum" / "bin" / "python"),
                   help="the optimum virtualenv's python (requirements/optimum.txt); absent: Optimum is not timed")
    p.add_argument("--optimum-models", default="gpt2", help="models Optimum exports and is timed on")
    args = p.parse_args(argv)
    try:
        import transformers  # noqa: F401
    except ImportError:
        print("bench.real_models: transformers is not installed (requirements/build.txt); skipped", file=sys.stderr)
        return 0
    unknown = sorted(set(args.models.split(",")) - set(SIZES))
    if unknown:
        print(f"bench.real_models: unknown model {unknown[0]!r} (known: {', '.join(SIZES)})", file=sys.stderr)
        return 2
    optimum = args.optimum_python if Path(args.optimum_python).is_file() else None
    if optimum is None:
        print(f"bench.real_models: {args.optimum_python} is missing: Optimum is not timed (make bench-real makes "
              "its virtualenv)", file=sys.stderr)
    rows = []
    for name in args.models.split(","):
        use = optimum if name in args.optimum_models.split(",") else None
        rows.append(run_one(name, Path(args.work), args.runs, use))
        print(json.dumps(rows[-1].get("summary") or rows[-1]), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    try:  # rows of models not run this time stay from the run that measured them (each row carries its date)
        old = json.loads((out / "real_models.json").read_text())["rows"]
    except (OSError, ValueError, KeyError):
        old = []
    ran = {r["model"] for r in rows}
    rows = [r for r in old if r.get("model") not in ran] + rows
    rows.sort(key=lambda r: list(SIZES).index(r["model"]) if r["model"] in SIZES else len(SIZES))
    report = {"machine": platform.platform(), "python": platform.python_version(), "threads": 2,
              "cpus": os.cpu_count(), "rows": rows}
    report["meta"] = meta(report)
    report["tables"] = tables(report)
    print(write(out, "real_models", report, indent=2))
    return 0

