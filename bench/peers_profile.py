"""Where one decode step of the peer model goes (`python -m bench.peers_profile`; not in make test).

On posenc's artifact of the peer model (bench/peers_model.py, imported with python -m export --from-hf), after a
128-token prompt, at batch 1 and 32:

  step paths   ms per step for the ways a loop can call onnxruntime: numpy feeds and fetches (what the worker's
               decode loop does), the same with attention maps fetched (what maps cost per token), and IOBinding
               (inputs bound as OrtValues, outputs left to onnxruntime), timed in alternating blocks
  step ops     onnxruntime's own profile of the plain step (SessionOptions.enable_profiling): time per operator
               type per step, and the share of the step spent outside operators (the run's own overhead:
               feeding, fetching, allocation)
  step graphs  ms per step of the graphs the worker can run, each in a session with the worker's own options
               (service.ortenv): the exact graph (attention maps), the fast graph (export.fuse), the fast graph with
               spinning intra-op threads, and onnxruntime-genai's graph of the same weights (when make bench-peers
               built it), timed in alternating blocks, each against the exact graph round by round, with the
               CPU time each step took (on a shared machine the steadier figure)
  step memory  peak resident memory of a process that loads the artifact as the worker does (service.artifacts),
               prefills 32 prompts of 128 tokens (2 per call) and decodes the 32 rows together, with the exact graph
               and with the fast graph (each in a process of its own)

Results: bench/results/peers_profile.{json,md} in the results convention.  Benchmarks report; they never assert.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import onnxruntime as ort

from bench import docs
from bench.timing import interleaved, paired_ratio

ROOT = Path(__file__).resolve().parent.parent
PROMPT = 128
MEMORY_CASES = ("exact", "fast", "fast, weights not prepacked")


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


def worker_session(path: Path, threads: int, spin: bool = False, prepack: bool = True):
    from service import ortenv

    opts = ortenv.session_options(threads, spin=spin)
    if not prepack:
        opts.add_session_config_entry("session.disable_prepacking", "1")
    return ortenv.Session(str(path), opts, providers=["CPUExecutionProvider"])


def step_feeds(sess, batch: int) -> dict:
    """A decode step after PROMPT tokens per row, any graph of the model (its carried inputs from its own signature)."""
    rng = np.random.default_rng(0)
    feeds = {"input_ids": np.full((batch, 1), 300, np.int64), "attention_mask": np.ones((batch, PROMPT + 1), np.int64)}
    for spec in sess.get_inputs()[2:]:
        feeds[spec.name] = rng.standard_normal((batch, spec.shape[1], PROMPT, 64)).astype(np.float32)
    return feeds


def graphs(art: Path, meta: dict, batch: int, threads: int, repeat: int, genai: Path | None) -> dict:
    paths = {"exact graph (maps), worker options": (art / "model.onnx", False, True)}
    if meta.get("fast"):
        paths["fast graph, worker options"] = (art / meta["fast"]["file"], False, True)
        paths["fast graph, spinning threads"] = (art / meta["fast"]["file"], True, True)
        paths["fast graph, weights not prepacked"] = (art / meta["fast"]["file"], False, False)
    if genai is not None and genai.is_file():
        paths["onnxruntime-genai's graph, worker options"] = (genai, False, True)
    fns, cpu = {}, {name: [] for name in paths}

    def timed(name, sess, feeds, outs):
        start = time.process_time()  # both intra-op threads' CPU time: robust to other processes' load
        sess.run(outs, feeds)
        cpu[name].append(time.process_time() - start)

    for name, (path, spin, prepack) in paths.items():
        sess = worker_session(path, threads, spin, prepack)
        feeds = step_feeds(sess, batch)
        outs = [o.name for o in sess.get_outputs() if o.name != "attentions"]
        fns[name] = lambda name=name, sess=sess, feeds=feeds, outs=outs: timed(name, sess, feeds, outs)
    times = interleaved(fns, repeat, block=max(2, repeat // 4), warmup=2, block_warmup=1, pause_s=0.05)
    base = next(iter(paths))
    return {k: {"median_ms": round(v["median_ms"], 2), "p90_ms": round(v["p90_ms"], 2),
                "cpu_ms": round(1000 * float(np.median(cpu[k])), 2),
                "vs_exact": round(paired_ratio(times, k, base), 3)} for k, v in times.items()}


def _resident_mb(field: str = "VmRSS") -> float:
    """VmRSS now, or VmHWM: the peak since this program started (getrusage's maxrss would also count the
    process this one was forked from)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":")) / 1024


def _no_prepack(opts):
    opts.add_session_config_entry("session.disable_prepacking", "1")
    return opts


def memory_child(art: Path, which: str, threads: int, steps: int) -> dict:
    """(in its own process) load as the worker does, prefill 32 x PROMPT in calls of 2 rows, decode 32 rows."""
    from service import malloc
    from service.artifacts import load_artifact

    malloc.tune()  # as the worker does at start
    if which == "fast, weights not prepacked":
        from service import ortenv

        plain = ortenv.session_options
        ortenv.session_options = lambda *a, **k: _no_prepack(plain(*a, **k))
    m = load_artifact(art, threads)
    sess = m.session if which == "exact" else m.session_for(maps=False)
    loaded = _resident_mb()
    names = ["logits"] + [st["output"] for st in m.state]
    rng = np.random.default_rng(0)
    parts = []
    for _ in range(16):
        feeds = {"input_ids": rng.integers(257, m.vocab_size, (2, PROMPT)),
                 "attention_mask": np.ones((2, PROMPT), np.int64),
                 **{st["input"]: t for st, t in zip(m.state, m.empty_state(2), strict=True)}}
        parts.append(sess.run(names, feeds)[1:])
    past = [np.concatenate([p[k] for p in parts]) for k in range(len(m.state))]
    del parts
    ids, mask = np.full((32, 1), 300, np.int64), np.ones((32, PROMPT), np.int64)
    for _ in range(steps):
        mask = np.concatenate([mask, np.ones((32, 1), np.int64)], axis=1)
        out = sess.run(names, {"input_ids": ids, "attention_mask": mask,
                               **{st["input"]: t for st, t in zip(m.state, past, strict=True)}})
        ids, past = out[0][:, -1:].argmax(-1).astype(np.int64), out[1:]
        del out
    return {"graph": which, "loaded_mb": round(loaded), "end_mb": round(_resident_mb()),
            "peak_mb": round(_resident_mb("VmHWM")),
            "exact_loaded": m.exact_loaded}


def memory(art: Path, meta: dict, threads: int, steps: int) -> list[dict]:
    rows = []
    for which in MEMORY_CASES if meta.get("fast") else MEMORY_CASES[:1]:
        res = subprocess.run([sys.executable, "-m", "bench.peers_profile", "--artifact", str(art), "--threads",
                              str(threads), "--memory-child", which, "--steps", str(steps)],
                             cwd=ROOT, capture_output=True, text=True, check=True)
        rows.append(json.loads(res.stdout.strip().splitlines()[-1]))
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.peers_profile", description=__doc__.split("\n\n")[0])
    p.add_argument("--artifact", type=Path, default=Path("/tmp/posenc-peers/posenc/smollm"))
    p.add_argument("--genai", type=Path, default=Path("/tmp/posenc-peers/ortgenai/model.onnx"),
                   help="onnxruntime-genai's model.onnx of the same weights (step graphs; skipped when absent)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeat", type=int, default=16)
    p.add_argument("--steps", type=int, default=16, help="decode steps at batch 32 in the memory runs")
    p.add_argument("--memory-child", choices=MEMORY_CASES, help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = p.parse_args(argv)
    if args.memory_child:
        print(json.dumps(memory_child(args.artifact, args.memory_child, args.threads, args.steps)))
        return 0
    if not (args.artifact / "model.json").is_file():
        p.exit(2, f"python -m bench.peers_profile: error: no artifact at {args.artifact} (make bench-peers makes it)\n")
    meta = json.loads((args.artifact / "model.json").read_text())
    command = " ".join(["python -m bench.peers_profile", *(argv if argv is not None else sys.argv[1:])])
    res: dict = {"meta": {"date": datetime.now(UTC).isoformat(timespec="seconds"),
                          "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.node()}",
                          "load": [round(x, 2) for x in os.getloadavg()], "command": command,
                          "artifact": str(args.artifact), "prompt_tokens": PROMPT, "threads": args.threads},
                 "paths": {}, "ops": {}, "graphs": {}}
    res["memory"] = memory(args.artifact, meta, args.threads, args.steps)  # first: children forked from a small process
    sess = make_session(args.artifact / "model.onnx", args.threads)
    for batch in (1, 32):
        res["paths"][batch] = paths(sess, meta, prefilled(sess, meta, batch), args.repeat)
        res["ops"][batch] = op_profile(args.artifact, meta, batch, args.threads, max(4, args.repeat // 2))
    del sess
    for batch in (1, 32):
        res["graphs"][batch] = graphs(args.artifact, meta, batch, args.threads, args.repeat, args.genai)
    res["meta"]["load_end"] = [round(x, 2) for x in os.getloadavg()]
    res["tables"] = {
        "step_paths": {"columns": ["batch", "path", "ms per step", "p90 ms", "vs the decode loop's call"],
                       "rows": [[b, k, v["median_ms"], v["p90_ms"], f"{v['vs_loop']:.2f}x"]
                                for b, d in res["paths"].items() for k, v in d.items()]},
        "step_ops": {"columns": ["batch", "operator", "ms per step", "share of the run"],
                     "rows": [[b, op, ms, f"{ms / d['run_ms']:.1%}"] for b, d in res["ops"].items()
                              for op, ms in list(d["ops_ms"].items())[:8]]
                     + [[b, "(outside operators)", round(d["run_ms"] * d["outside_ops_share"], 3),
                         f"{d['outside_ops_share']:.1%}"] for b, d in res["ops"].items()]},
        "step_graphs": {"columns": ["batch", "graph and session options", "ms per step", "p90 ms",
                                    "vs the exact graph", "CPU ms per step"],
                        "rows": [[b, k, v["median_ms"], v["p90_ms"], f"{v['vs_exact']:.2f}x", v["cpu_ms"]]
                                 for b, d in res["graphs"].items() for k, v in d.items()],
                        "note": "CPU ms: the process's CPU time per step (both intra-op threads), which other "
                                "processes' load does not inflate; spinning threads' CPU time includes their spinning"},
        "step_memory": {"columns": ["graph", "MB after loading", f"MB after 32 x {PROMPT} prefill + {args.steps} steps",
                                    "peak MB", "exact graph loaded"],
                        "rows": [[r["graph"], r["loaded_mb"], r["end_mb"], r["peak_mb"], r["exact_loaded"]]
                                 for r in res["memory"]]}}
    print(docs.write(args.out, "peers_profile", res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
