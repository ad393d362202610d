"""Where one decode step of the peer model goes (`python -m bench.peers_profile`; not in make test).

On posenc's artifact of the peer model (bench/peers_model.py, imported with python -m export --from-hf), after a
128-token prompt, at batch 1 and 32:

  step paths   ms per step for the ways a loop can call onnxruntime: numpy feeds and fetches (what the worker's
               decode loop does), the same with attention maps fetched (what maps cost per token), and IOBinding
               (inputs bound as OrtValues, outputs left to onnxruntime), timed in alternating blocks
  step ops     onnxruntime's own profile of the plain step (SessionOptions.enable_profiling): time per operator
               type per step, and the share of the step spent outside operators (the run's own overhead:
               feeding, fetching, allocation)

Results: bench/results/peers_profile.{json,md} in the results convention.  Benchmarks report; they never assert.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
from collections import defaultdict
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import onnxruntime as ort

from bench import docs
from bench.timing import interleaved, paired_ratio

ROOT = Path(__file__).resolve().parent.parent
PROMPT = 128


def make_session(path: Path, threads: int, profile_dir: str | None = None) -> ort.InferenceSession:
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.log_severity_level = 3
    if profile_dir:
        opts.enable_profiling = True
        opts.profile_file_prefix = os.path.join(profile_dir, "step")
    return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])


def prefilled(sess, meta: dict, batch: int) -> dict:
    """Feeds of the first decode step after a PROMPT-token prompt per row (the prefill's present cache)."""
    states = meta["state"]
    ids = np.random.default_rng(0).integers(257, meta["config"]["vocab_size"], (batch, PROMPT), dtype=np.int64)
    feeds = {"input_ids": ids, "attention_mask": np.ones((batch, PROMPT), np.int64)}
    for spec in sess.get_inputs()[2:]:
        feeds[spec.name] = np.zeros((batch, spec.shape[1], 0, spec.shape[3]), np.float32)
    res = sess.run(["logits"] + [st["output"] for st in states], feeds)
    return {"input_ids": res[0][:, -1:].argmax(-1).astype(np.int64),
            "attention_mask": np.ones((batch, PROMPT + 1), np.int64),
            **{st["input"]: r for st, r in zip(states, res[1:], strict=True)}}


def paths(sess, meta: dict, feeds: dict, repeat: int) -> dict:
    states = meta["state"]
    plain = ["logits"] + [st["output"] for st in states]
    maps = plain + ["attentions"]
    binding = sess.io_binding()
    for name, value in feeds.items():
        binding.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(value))
    for name in plain:
        binding.bind_output(name, "cpu")
    fns = {"numpy feeds, logits + cache (the decode loop)": lambda: sess.run(plain, feeds),
           "numpy feeds, + attention maps": lambda: sess.run(maps, feeds),
           "IOBinding, logits + cache": lambda: sess.run_with_iobinding(binding)}
    times = interleaved(fns, repeat, block=max(2, repeat // 4), warmup=2, block_warmup=1, pause_s=0.05)
    base = "numpy feeds, logits + cache (the decode loop)"
    return {k: {"median_ms": round(v["median_ms"], 2), "p90_ms": round(v["p90_ms"], 2),
                "vs_loop": round(paired_ratio(times, k, base), 3)} for k, v in times.items()}


def op_profile(art: Path, meta: dict, batch: int, threads: int, steps: int) -> dict:
    """onnxruntime's profile of `steps` plain decode steps: ms per step by operator type, and the run overhead."""
    with tempfile.TemporaryDirectory() as tmp:
        sess = make_session(art / "model.onnx", threads, tmp)
        feeds = prefilled(sess, meta, batch)
        names = ["logits"] + [st["output"] for st in meta["state"]]
        for _ in range(2):
            sess.run(names, feeds)
        path = sess.end_profiling()
        sess = make_session(art / "model.onnx", threads, tmp)
        feeds = prefilled(sess, meta, batch)
        sess.run(names, feeds)
        for _ in range(steps):
            sess.run(names, feeds)
        path = sess.end_profiling()
        events = json.loads(Path(path).read_text())
    runs = [e for e in events if e.get("cat") == "Session" and e.get("name") == "model_run"][-steps:]
    start = runs[0]["ts"] if runs else 0
    ops: dict[str, float] = defaultdict(float)
    for e in events:
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time") and e["ts"] >= start:
            ops[e.get("args", {}).get("op_name", "?")] += e["dur"]
    run_us = sum(r["dur"] for r in runs) / max(1, len(runs))
    per_step = {k: v / max(1, len(runs)) for k, v in ops.items()}
    inside = sum(per_step.values())
    return {"batch": batch, "steps": len(runs), "run_ms": round(run_us / 1000, 3),
            "ops_ms": {k: round(v / 1000, 3) for k, v in sorted(per_step.items(), key=lambda kv: -kv[1])},
            "outside_ops_share": round(1 - inside / run_us, 3) if run_us else None}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.peers_profile", description=__doc__.split("\n\n")[0])
    p.add_argument("--artifact", type=Path, default=Path("/tmp/posenc-peers/posenc/smollm"))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeat", type=int, default=16)
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = p.parse_args(argv)
    if not (args.artifact / "model.json").is_file():
        p.exit(2, f"python -m bench.peers_profile: error: no artifact at {args.artifact} (make bench-peers makes it)\n")
    meta = json.loads((args.artifact / "model.json").read_text())
    res: dict = {"meta": {"date": datetime.now(UTC).isoformat(timespec="seconds"),
                          "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.node()}",
                          "load": [round(x, 2) for x in os.getloadavg()], "command": "python -m bench.peers_profile",
                          "artifact": str(args.artifact), "prompt_tokens": PROMPT, "threads": args.threads},
                 "paths": {}, "ops": {}}
    sess = make_session(args.artifact / "model.onnx", args.threads)
    for batch in (1, 32):
        res["paths"][batch] = paths(sess, meta, prefilled(sess, meta, batch), args.repeat)
        res["ops"][batch] = op_profile(args.artifact, meta, batch, args.threads, max(4, args.repeat // 2))
    res["meta"]["load_end"] = [round(x, 2) for x in os.getloadavg()]
    res["tables"] = {
        "step_paths": {"columns": ["batch", "path", "ms per step", "p90 ms", "vs the decode loop's call"],
                       "rows": [[b, k, v["median_ms"], v["p90_ms"], f"{v['vs_loop']:.2f}x"]
                                for b, d in res["paths"].items() for k, v in d.items()]},
        "step_ops": {"columns": ["batch", "operator", "ms per step", "share of the run"],
                     "rows": [[b, op, ms, f"{ms / d['run_ms']:.1%}"] for b, d in res["ops"].items()
                              for op, ms in list(d["ops_ms"].items())[:8]]
                     + [[b, "(outside operators)", round(d["run_ms"] * d["outside_ops_share"], 3),
                         f"{d['outside_ops_share']:.1%}"] for b, d in res["ops"].items()]}}
    print(docs.write(args.out, "peers_profile", res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
