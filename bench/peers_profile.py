"""Where one decode step of the peer model goes (`python -m bench peers-profile`; not in make test).

On posenc's artifact of the peer model (bench/peers_model.py, imported with python -m export --from-hf), after a
128-token prompt, at batch 1 and 32, every session with the worker's own options (service.ortenv) unless a row says
otherwise:

  step paths   ms per step for the ways of calling the graphs: the fast graph as the worker's decode loop calls it
               (compact layout: service.executor's step, each cache tensor one buffer bound through IOBinding as
               past and present, only the logits fetched), the same graph with numpy feeds and the cache fetched,
               and the exact graph with numpy feeds, without and with attention maps fetched
  step ops     onnxruntime's own profile of the decode loop's step (SessionOptions.enable_profiling): time per
               operator type per step, and the share of the step spent outside operators (the run's own overhead:
               binding, fetching, allocation)
  step graphs  ms per step of the graphs: the exact graph (numpy feeds), the fast graph called as the decode loop
               calls it with the worker's options, with spinning intra-op threads and with weights not prepacked,
               and onnxruntime-genai's graph of the same weights (numpy feeds; when make bench-peers built it), with
               the CPU time each step took (on a shared machine the steadier figure)
  step memory  peak resident memory of a process that loads the artifact as the worker does (service.artifacts),
               prefills 32 prompts of 128 tokens through the worker's Scheduler (2 per call, last-position logits
               as Generate asks) and decodes the 32 rows together as the decode loop does (the compact graph's
               shared buffers), against the exact graph fed numpy arrays (each case in a process of its own)

Every row of step paths and step graphs is timed in one alternating run per batch (bench.timing.interleaved), so
each ratio compares blocks run back to back.  Results: bench/results/peers_profile.{json,md} in the results
convention.  Benchmarks report; they never assert.
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
from types import SimpleNamespace

import numpy as np

from bench.lib.results import write
from bench.timing import interleaved, paired_ratio
from model.cli import Parser
from service import compact, ortenv
from service.artifacts import Graph
from service.executor import Executor
from service.jobs import Job
from service.kvcache import KVSpec
from service.model_json import Carried, typed
from service.settings import Tuning

ROOT = Path(__file__).resolve().parent.parent
PROMPT = 128
ROOM = PROMPT + Tuning().grow  # positions each decode row may reach: the shared buffers' capacity follows from it
MEMORY_CASES = ("exact", "fast", "fast, weights not prepacked")
LOOP = "fast graph, the decode loop's call (shared cache bound through IOBinding)"
EXACT = "exact graph, numpy feeds, logits + cache"
PATHS = (LOOP, "fast graph, numpy feeds, logits + cache fetched", EXACT, "exact graph, numpy feeds, + attention maps")
GRAPHS = (EXACT, LOOP, "fast graph, the decode loop's call, spinning threads",
          "fast graph, the decode loop's call, weights not prepacked", "onnxruntime-genai's graph, numpy feeds")


def worker_session(path: Path, threads: int, spin: bool = False, prepack: bool = True,
                   profile_dir: str | None = None) -> ortenv.Session:
    opts = ortenv.session_options(threads, spin=spin)
    if not prepack:
        opts.add_session_config_entry("session.disable_prepacking", "1")
    if profile_dir:
        opts.enable_profiling = True
        opts.profile_file_prefix = os.path.join(profile_dir, "step")
    return ortenv.Session(str(path), opts, providers=["CPUExecutionProvider"])


def past(meta: dict, batch: int) -> list[np.ndarray]:
    """A PROMPT-token cache per row, per state tensor (B, KV heads, PROMPT, head dim): values do not change timings."""
    rng, sizes = np.random.default_rng(0), meta["sizes"]
    shape = (batch, sizes.get("n_kv_heads") or sizes["n_heads"], PROMPT, sizes["head_dim"])
    return [rng.standard_normal(shape, np.float32) for _ in meta["state"]]


def numpy_call(sess, meta: dict, batch: int, maps: bool = False):
    """The exact graph's decode step as a loop over numpy feeds makes it: the new token, the mask over PROMPT + 1
    positions and the cache; the logits and the present cache fetched (and the attention maps with `maps`)."""
    feeds = {"input_ids": np.full((batch, 1), 300, np.int64), "attention_mask": np.ones((batch, PROMPT + 1), np.int64),
             **{st["input"]: t for st, t in zip(meta["state"], past(meta, batch), strict=True)}}
    names = ["logits"] + [st["output"] for st in meta["state"]] + (["attentions"] if maps else [])
    return lambda: sess.run(names, feeds)


def genai_call(sess, meta: dict, batch: int):
    """onnxruntime-genai's graph (its inputs from its own signature: input_ids, attention_mask, then the cache; its
    head size is a symbolic dimension there, the model's own)."""
    rng = np.random.default_rng(0)
    feeds = {"input_ids": np.full((batch, 1), 300, np.int64), "attention_mask": np.ones((batch, PROMPT + 1), np.int64)}
    for spec in sess.get_inputs()[2:]:
        shape = (batch, spec.shape[1], PROMPT, meta["sizes"]["head_dim"])
        feeds[spec.name] = rng.standard_normal(shape).astype(np.float32)
    names = [o.name for o in sess.get_outputs()]
    return lambda: sess.run(names, feeds)


def fast_model(sess, meta: dict) -> SimpleNamespace:
    """What the worker's executor and compact cache need of a LoadedModel: its graph for a call (this compact fast
    session, with its logits_positions input) and its cache geometry."""
    sizes = meta["sizes"]
    kv = KVSpec(sizes.get("n_kv_heads") or sizes["n_heads"], sizes["head_dim"],
                tuple(typed(Carried, st) for st in meta["state"]))
    graph = Graph(sess, compact.CompactCodec, meta["fast"].get("logits_positions"))
    return SimpleNamespace(kv=kv, graph=lambda maps, profile=False: graph)


def loop_call(sess, meta: dict, batch: int):
    """The decode loop's step on a compact fast graph: the rows' caches in a CompactCache made as the decode loop
    makes it (sized for rows that may reach ROOM), every row PROMPT cached tokens; service.executor's step writes
    each row's new key and value at slot PROMPT in place (the lengths set back after it, so every call is the same
    step)."""
    m = fast_model(sess, meta)
    executor = Executor(m)
    cache = compact.CompactCache(m.kv, Tuning())
    tensors = past(meta, batch)
    cache.regroup([], [[t[b] for t in tensors] for b in range(batch)],
                  [SimpleNamespace(cached=PROMPT, room=ROOM)] * batch)
    del tensors
    ids = np.full((batch, 1), 300, np.int64)

    def call():
        executor.step(ids, cache)
        cache.lengths[:] = PROMPT

    return call


def compact_numpy_call(sess, meta: dict, batch: int):
    """The same compact step with numpy feeds: the PROMPT-slot cache fed, the PROMPT + 1-slot present fetched."""
    feeds = compact.step_feeds(np.full((batch, 1), 300, np.int64), np.full(batch, PROMPT))
    if meta["fast"].get("logits_positions"):
        feeds[meta["fast"]["logits_positions"]] = np.zeros((batch, 1), np.int64)
    feeds.update({st["input"]: t for st, t in zip(meta["state"], past(meta, batch), strict=True)})
    names = ["logits"] + [st["output"] for st in meta["state"]]
    return lambda: sess.run(names, feeds)


def sessions(art: Path, meta: dict, threads: int, genai: Path | None) -> dict:
    out = {"exact": worker_session(art / "model.onnx", threads)}
    if (meta.get("fast") or {}).get("layout") == "compact":
        fast = art / meta["fast"]["file"]
        out.update(fast=worker_session(fast, threads), spin=worker_session(fast, threads, spin=True),
                   unpacked=worker_session(fast, threads, prepack=False))
    if genai is not None and genai.is_file():
        out["genai"] = worker_session(genai, threads)
    return out


def steps(sess: dict, meta: dict, batch: int, repeat: int) -> dict:
    """Every row of both tables for one batch, timed in one interleaved run, with its CPU time per step."""
    calls = {EXACT: numpy_call(sess["exact"], meta, batch), PATHS[3]: numpy_call(sess["exact"], meta, batch, True)}
    if "fast" in sess:
        calls.update({LOOP: loop_call(sess["fast"], meta, batch),
                      PATHS[1]: compact_numpy_call(sess["fast"], meta, batch),
                      GRAPHS[2]: loop_call(sess["spin"], meta, batch),
                      GRAPHS[3]: loop_call(sess["unpacked"], meta, batch)})
    if "genai" in sess:
        calls[GRAPHS[4]] = genai_call(sess["genai"], meta, batch)
    cpu: dict[str, list[float]] = {name: [] for name in calls}

    def timed(name, call):
        start = time.process_time()  # both intra-op threads' CPU time: robust to other processes' load
        call()
        cpu[name].append(time.process_time() - start)

    fns = {name: (lambda name=name, call=call: timed(name, call)) for name, call in calls.items()}
    times = interleaved(fns, repeat, block=max(2, repeat // 4), warmup=2, block_warmup=1, pause_s=0.05)
    return {k: {"median_ms": round(v["median_ms"], 2), "p90_ms": round(v["p90_ms"], 2),
                "cpu_ms": round(1000 * float(np.median(cpu[k])), 2),
                "vs_exact": round(paired_ratio(times, k, EXACT), 3),
                "vs_loop": round(paired_ratio(times, k, LOOP), 3) if LOOP in times else None}
            for k, v in times.items()}


def op_profile(art: Path, meta: dict, batch: int, threads: int, count: int) -> dict:
    """onnxruntime's profile of `count` decode steps as the decode loop runs them (the exact graph's numpy step when
    the artifact has no compact fast graph): ms per step by operator type, and the run's overhead."""
    compact_graph = (meta.get("fast") or {}).get("layout") == "compact"
    with tempfile.TemporaryDirectory() as tmp:
        sess = worker_session(art / (meta["fast"]["file"] if compact_graph else "model.onnx"), threads, profile_dir=tmp)
        call = loop_call(sess, meta, batch) if compact_graph else numpy_call(sess, meta, batch)
        for _ in range(3 + count):
            call()
        events = json.loads(Path(sess.end_profiling()).read_text())
    runs = [e for e in events if e.get("cat") == "Session" and e.get("name") == "model_run"][-count:]
    start = runs[0]["ts"] if runs else 0
    ops: dict[str, float] = defaultdict(float)
    for e in events:
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time") and e["ts"] >= start:
            ops[e.get("args", {}).get("op_name", "?")] += e["dur"]
    run_us = sum(r["dur"] for r in runs) / max(1, len(runs))
    per_step = {k: v / max(1, len(runs)) for k, v in ops.items()}
    inside = sum(per_step.values())
    return {"batch": batch, "graph": "fast (compact)" if compact_graph else "exact", "steps": len(runs),
            "run_ms": round(run_us / 1000, 3),
            "ops_ms": {k: round(v / 1000, 3) for k, v in sorted(per_step.items(), key=lambda kv: -kv[1])},
            "attention_share": round(per_step.get("GroupQueryAttention", 0.0) / run_us, 3) if run_us else None,
            "outside_ops_share": round(1 - inside / run_us, 3) if run_us else None}


def _resident_mb(field: str = "VmRSS") -> float:
    """VmRSS now, or VmHWM: the peak since this program started (getrusage's maxrss would also count the
    process this one was forked from)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":")) / 1024


def _no_prepack(opts):
    opts.add_session_config_entry("session.disable_prepacking", "1")
    return opts


def _exact_rows(m, rng, steps: int) -> None:
    """The exact graph fed numpy arrays: 16 prefill calls of 2 rows, the caches concatenated, 32 rows decoded with
    the cache fed and fetched each step."""
    sess, names = m.session, ["logits"] + m.kv.outputs
    parts = []
    for _ in range(16):
        feeds = {"input_ids": rng.integers(257, m.vocab_size, (2, PROMPT)),
                 "attention_mask": np.ones((2, PROMPT), np.int64),
                 **{st.input: t for st, t in zip(m.kv.state, m.kv.empty(2), strict=True)}}
        parts.append(sess.run(names, feeds)[1:])
    cache = [np.concatenate([p[k] for p in parts]) for k in range(len(m.kv.state))]
    del parts
    ids, mask = np.full((32, 1), 300, np.int64), np.ones((32, PROMPT), np.int64)
    for _ in range(steps):
        mask = np.concatenate([mask, np.ones((32, 1), np.int64)], axis=1)
        out = sess.run(names, {"input_ids": ids, "attention_mask": mask,
                               **{st.input: t for st, t in zip(m.kv.state, cache, strict=True)}})
        ids, cache = out[0][:, -1:].argmax(-1).astype(np.int64), out[1:]
        del out


def _worker_rows(m, rng, steps: int) -> None:
    """The worker's way: 16 prompt calls of 2 jobs through the engine's executor (Job(last_only=True), as Generate
    asks), the 32 rows' caches moved into the model's KVCache as the decode batch's join does, then decode steps
    through the executor, the cache grown where the longest row reaches its end."""
    executor = Executor(m)
    results = []
    for _ in range(16):
        results += executor.run([Job(rng.integers(257, m.vocab_size, PROMPT), None, last_only=True) for _ in range(2)])
    cache = m.layout.cache(m.kv, Tuning())
    rows = [SimpleNamespace(cached=PROMPT, room=PROMPT + steps) for _ in range(32)]
    cache.regroup([], [r.state for r in results], rows)
    del results
    ids = np.full((32, 1), 300, np.int64)
    for _ in range(steps):
        cache.grow(rows)
        logits = executor.step(ids, cache)
        ids = logits.argmax(-1)[:, None].astype(np.int64)
        for r in rows:
            r.cached += 1


def memory_child(art: Path, which: str, threads: int, steps: int) -> dict:
    """(in its own process) load as the worker does, prefill 32 x PROMPT in calls of 2 rows, decode 32 rows."""
    from service import malloc
    from service.artifacts import load_artifact

    malloc.tune()  # as the worker does at start
    if which == "fast, weights not prepacked":
        plain = ortenv.session_options
        ortenv.session_options = lambda *a, **k: _no_prepack(plain(*a, **k))
    m = load_artifact(art, threads)
    if which == "exact":
        m.session  # noqa: B018  (loads the exact graph, as the worker does when a call first wants maps)
    loaded = _resident_mb()
    rng = np.random.default_rng(0)
    if which == "exact" or m.layout.name != "compact":
        _exact_rows(m, rng, steps)
    else:
        _worker_rows(m, rng, steps)
    return {"graph": which, "loaded_mb": round(loaded), "end_mb": round(_resident_mb()),
            "peak_mb": round(_resident_mb("VmHWM")), "exact_loaded": m.exact_loaded}


def memory(art: Path, meta: dict, threads: int, steps: int) -> list[dict]:
    rows = []
    for which in MEMORY_CASES if (meta.get("fast") or {}).get("layout") == "compact" else MEMORY_CASES[:1]:
        res = subprocess.run([sys.executable, "-m", "bench.peers_profile", "--artifact", str(art), "--threads",
                              str(threads), "--memory-child", which, "--steps", str(steps)],
                             cwd=ROOT, capture_output=True, text=True, check=True)
        rows.append(json.loads(res.stdout.strip().splitlines()[-1]))
    return rows


def tables(res: dict, steps_: int) -> dict:
    ratio = "{:.2f}x".format
    return {
        "step_paths": {"columns": ["batch", "path", "ms per step", "p90 ms", "vs the decode loop's call"],
                       "rows": [[b, k, d[k]["median_ms"], d[k]["p90_ms"], ratio(d[k]["vs_loop"])]
                                for b, d in res["steps"].items() for k in PATHS if k in d and d[k]["vs_loop"]]},
        "step_ops": {"columns": ["batch", "operator", "ms per step", "share of the run"],
                     "rows": [[b, op, ms, f"{ms / d['run_ms']:.1%}"] for b, d in res["ops"].items()
                              for op, ms in list(d["ops_ms"].items())[:8]]
                     + [[b, "(outside operators)", round(d["run_ms"] * d["outside_ops_share"], 3),
                         f"{d['outside_ops_share']:.1%}"] for b, d in res["ops"].items()]},
        "step_graphs": {"columns": ["batch", "graph, call and session options", "ms per step", "p90 ms",
                                    "vs the exact graph", "CPU ms per step"],
                        "rows": [[b, k, d[k]["median_ms"], d[k]["p90_ms"], ratio(d[k]["vs_exact"]), d[k]["cpu_ms"]]
                                 for b, d in res["steps"].items() for k in GRAPHS if k in d],
                        "note": "CPU ms: the process's CPU time per step (both intra-op threads), which other "
                                "processes' load does not inflate; spinning threads' CPU time includes their spinning"},
        "step_memory": {"columns": ["graph", "MB after loading", f"MB after 32 x {PROMPT} prefill + {steps_} steps",
                                    "peak MB", "exact graph loaded"],
                        "rows": [[r["graph"], r["loaded_mb"], r["end_mb"], r["peak_mb"], r["exact_loaded"]]
                                 for r in res["memory"]]}}


def main(argv: list[str] | None = None) -> int:
    p = Parser(prog="python -m bench peers-profile", description=__doc__.split("\n\n")[0])
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
        p.exit(2, f"python -m bench peers-profile: error: no artifact at {args.artifact} (make bench-peers makes it)\n")
    meta = json.loads((args.artifact / "model.json").read_text())
    command = " ".join(["python -m bench peers-profile", *(argv if argv is not None else sys.argv[1:])])
    res: dict = {"meta": {"date": datetime.now(UTC).isoformat(timespec="seconds"),
                          "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.node()}",
                          "load": [round(x, 2) for x in os.getloadavg()], "command": command,
                          "artifact": str(args.artifact), "prompt_tokens": PROMPT, "threads": args.threads,
                          "fast_layout": (meta.get("fast") or {}).get("layout")},
                 "steps": {}, "ops": {}}
    res["memory"] = memory(args.artifact, meta, args.threads, args.steps)  # first: children forked from a small process
    for batch in (1, 32):
        res["ops"][batch] = op_profile(args.artifact, meta, batch, args.threads, max(4, args.repeat // 2))
    sess = sessions(args.artifact, meta, args.threads, args.genai)
    for batch in (1, 32):
        res["steps"][batch] = steps(sess, meta, batch, args.repeat)
    del sess
    res["meta"]["load_end"] = [round(x, 2) for x in os.getloadavg()]
    res["tables"] = tables(res, args.steps)
    print(write(args.out, "peers_profile", res))
    return 0

