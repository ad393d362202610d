"""The memory of an attention profile (make bench): a GPT-2-small-sized model (transformers' GPT2Config with 2,048
positions, random weights, seed 0) imported with posenc-export, then one call per fresh process, through the
worker's own operations: Predict without maps, and Profile, of the same 2,048-token prompt.  Each process reports
its peak RSS (ru_maxrss); the ratio profile / plain is the figure (issue 34: under 1.5).

  python -m bench profile-memory [--work /tmp/posenc-profile-bench] [--length 2048] [--out bench/results]

Results: bench/results/profile_memory.json and .md (docs/profiles.md's table); make bench (bench/run.py) measures the
same in its run and writes this file too.

Benchmarks report; they never assert."""

from __future__ import annotations

import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

from bench.lib import results
from model.cli import Parser

ROOT = Path(__file__).resolve().parent.parent
LENGTH = 2048
WORK = Path("/tmp/posenc-profile-bench")


def artifact(work: Path) -> Path:
    """work/gpt2 (the artifact), imported from work/hf (a random GPT-2 small of 2,048 positions) unless present."""
    art = work / "gpt2"
    if (art / "manifest.json").is_file():
        return art
    import torch
    import transformers as tf

    from bench.real_models import tokenizer_json

    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(tf.GPT2Config(n_positions=LENGTH))
    model.save_pretrained(work / "hf", safe_serialization=True)
    (work / "hf" / "tokenizer.json").write_text(tokenizer_json())
    subprocess.run([sys.executable, "-m", "export", "--from-hf", str(work / "hf"), "--out", str(art), "--force"],
                   cwd=ROOT, check=True, capture_output=True)
    return art


def child(art: Path, mode: str, length: int) -> dict:
    """One call in this process (a fresh one): the worker's artifact loading, registry and operations."""
    import numpy as np

    from service import profile
    from service.artifacts import load_artifact
    from service.operations import Operations
    from service.registry import Registry
    from service.settings import Limits

    model = load_artifact(art, 2)
    ops = Operations(Registry({model.name: model}, Limits()))
    loaded = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    ids = [int(i) for i in np.random.default_rng(0).integers(0, model.tokenizer.vocab_size, length)]
    start = time.perf_counter()
    if mode == "plain":
        ops.predict(model.name, None, ids)
    else:
        profile.profile(ops, model.name, None, ids)
    return {"mode": mode, "loaded_mb": loaded, "peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "seconds": time.perf_counter() - start}


def bench_profile_memory(work: Path = WORK, length: int = LENGTH, art: Path | None = None) -> dict:
    """Predict without maps and Profile, each in its own fresh process; peak RSS and their ratio.  art: measure that
    artifact instead of the GPT-2 small sized import (the smoke test's, on a tiny model it already has)."""
    if art is None:
        work.mkdir(parents=True, exist_ok=True)
        art = artifact(work)
    runs = {}
    for mode in ("plain", "profile"):
        out = subprocess.run([sys.executable, "-m", "bench", "profile-memory", "--child", str(art), mode, str(length)],
                             cwd=ROOT, check=True, capture_output=True, text=True)
        runs[mode] = json.loads(out.stdout.strip().splitlines()[-1])
    meta = json.loads((art / "model.json").read_text())
    size = "gpt2-small sized" if art.parent == work else art.name
    return {"model": f"{size} ({meta['sizes']['parameters'] / 1e6:.3g}M, random, {length} positions)",
            "length": length, "plain": runs["plain"], "profile": runs["profile"],
            "ratio": runs["profile"]["peak_mb"] / runs["plain"]["peak_mb"]}


def table(r: dict) -> dict:
    p, q = r["plain"], r["profile"]
    return {"title": f"6. Attention profile memory ({r['model']}, a {r['length']}-token prompt, one call per fresh "
                     "process, peak RSS)",
            "columns": ["call", "RSS after loading", "peak RSS", "seconds", "vs without maps"],
            "rows": [["Predict, no maps", f"{p['loaded_mb']:.0f} MB", f"{p['peak_mb']:.0f} MB", f"{p['seconds']:.1f}",
                      "1.00x"],
                     ["Profile (every query row)", f"{q['loaded_mb']:.0f} MB", f"{q['peak_mb']:.0f} MB",
                      f"{q['seconds']:.1f}", f"{r['ratio']:.2f}x"]]}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        print(json.dumps(child(Path(argv[1]), argv[2], int(argv[3]))))
        return 0
    p = Parser(prog="python -m bench profile-memory", description=__doc__.splitlines()[0])
    p.add_argument("--work", default=str(WORK))
    p.add_argument("--length", type=int, default=LENGTH)
    p.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = p.parse_args(argv)
    print(write(bench_profile_memory(Path(args.work), args.length), Path(args.out), "python -m bench profile-memory"))
    return 0


def write(r: dict, out: Path, command: str) -> str:
    """out/profile_memory.json and .md in the results convention (bench/lib/results.py), for docs/profiles.md."""
    import onnxruntime

    load = list(os.getloadavg())
    meta = {"date": time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime()), "load": load, "command": command,
            "machine": f"{os.cpu_count()} CPUs ({platform.machine()}), Python {platform.python_version()}, "
                       f"onnxruntime {onnxruntime.__version__}"}
    return results.write(out, "profile_memory", {**r, "meta": meta, "tables": {"profile_memory": table(r)}})

