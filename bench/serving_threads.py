"""Where the worker process's CPU goes per token, thread by thread, and how often its threads wait.

  python -m bench serving-threads [--work /tmp/posenc-peers] [--streams 1,32] [--tokens 64] [--rounds 3]

The model is the peer benchmark's (bench/peers_model.py: SmolLM-135M's shape, random weights, fp32, 128-token
prompts), imported and exported as `make bench-peers` does (cached under --work).  A real worker (service.server, its
default settings but the ports) runs in this process; greedy streams of --tokens tokens come over gRPC (posenc.v1
Generate, one channel per stream) from bench.serving_cost's load generator in a process of its own, so only the
worker's threads are counted.  Around each run every thread's CPU time and context switches are read from
/proc/self/task and grouped:

  engine thread        the decode loop: its Python, and the onnxruntime calls it makes (the calling thread works as
                       one of the intra-op threads)
  gRPC handlers        the server's Python threads, one per open call, handing tokens to the wire
  other Python         the HTTP front's and the rest
  gRPC core            gRPC's own C threads (its event engine's pool and lifeguard: polling, timers)
  native               the remaining native threads: onnxruntime's intra-op pool

A voluntary switch is a thread that waited (for the GIL, a lock or condition, the pool, the network); an
involuntary one a thread the kernel preempted.  Python threads' switches per token bound how often the GIL changed
hands. Beside them, the decode loop's own clocks (service.stats.EngineStats.seconds) per decode step: inside
onnxruntime, running prompts between steps, choosing and handing out tokens, rebuilding the batch, and the rest of
the wall time (the loop's other Python, waiting for the GIL). Rounds alternate the stream counts; each figure is the
median over rounds. Writes bench/results/serving_threads.{json,md}. Reports; never asserts.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import threading
from datetime import UTC, datetime
from pathlib import Path

from bench import peers_prepare as prep
from bench.lib.results import write
from bench.peers_model import make_folder
from model.cli import Parser

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
GROUPS = ("engine thread (Python + onnxruntime calls)", "gRPC handlers (Python)", "other Python threads",
          "gRPC core (C threads)", "native threads (onnxruntime's intra-op pool)")


def group_of(python_name: str | None, comm: str) -> str:
    """A thread's group from its Python name (None: a native thread) and its kernel name."""
    if python_name is not None:
        if python_name.startswith("engine-"):
            return GROUPS[0]
        return GROUPS[1] if python_name.startswith("ThreadPoolExecutor") else GROUPS[2]
    # gRPC's C threads: its event engine's pool and lifeguard (grpc 1.6x-1.8x), older releases' named executors
    grpc_core = ("event_engine", "lifeguard", "grpc", "default-execut", "resolver-execu")
    return GROUPS[3] if comm.startswith(grpc_core) else GROUPS[4]


def clocks() -> dict[int, tuple[str, float, int, int]]:
    """Every thread of this process: its id -> (its group, CPU seconds, voluntary and involuntary switches)."""
    tick, named = os.sysconf("SC_CLK_TCK"), {t.native_id: t.name for t in threading.enumerate()}
    out = {}
    for task in Path("/proc/self/task").iterdir():
        try:
            stat, comm = (task / "stat").read_text(), (task / "comm").read_text().strip()
            status = dict(line.split(":", 1) for line in (task / "status").read_text().splitlines() if ":" in line)
        except OSError:  # the thread ended while being read
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # from the state on: utime and stime are the 12th and 13th
        tid = int(task.name)
        out[tid] = (group_of(named.get(tid), comm), (int(fields[11]) + int(fields[12])) / tick,
                    int(status["voluntary_ctxt_switches"]), int(status["nonvoluntary_ctxt_switches"]))
    return out


def per_token(before: dict, after: dict, tokens: int, wall_s: float) -> dict[str, list[float]]:
    """Per group: threads, CPU ms per token, CPU over wall time (1.0: one core), voluntary and involuntary switches
    per token.  A thread that started between the clocks counts from zero; one that ended is not counted."""
    out = {}
    for group in GROUPS:
        ids = [t for t, v in after.items() if v[0] == group]
        d = [sum(after[t][i] - (before[t][i] if t in before else 0) for t in ids) for i in (1, 2, 3)]
        out[group] = [len(ids), 1000 * d[0] / tokens, d[0] / wall_s, d[1] / tokens, d[2] / tokens]
    return out


def main(argv: list[str] | None = None) -> int:
    p = Parser(prog="python -m bench serving-threads", description=__doc__.split("\n\n")[0])
    p.add_argument("--work", type=Path, default=Path("/tmp/posenc-peers"))
    p.add_argument("--artifact", type=Path, help="serve this artifact folder instead of the peer model's")
    p.add_argument("--streams", default="1,32", help="comma-separated stream counts")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", type=Path, default=RESULTS)
    a = p.parse_args(argv)
    try:
        counts = [int(s) for s in a.streams.split(",")]
    except ValueError:
        p.exit(2, f"python -m bench serving-threads: error: --streams takes counts like 1,32, not {a.streams!r}\n")
    if a.rounds < 1 or a.tokens < 2 or not counts or min(counts) < 1:
        p.exit(2, "python -m bench serving-threads: error: --rounds, --tokens (>= 2) and --streams must be positive\n")

    from service.server import Server
    from service.settings import Settings

    art = a.artifact
    if art is None:
        make_folder(a.work / "hf")
        art = prep.posenc_artifact(a.work / "hf", a.work)
    server = Server(Settings(model_dir=art.parent, port=0, http_port=-1, metrics_port=-1, log_level="WARNING")).start()
    name = art.name
    stats = server.registry.engine(name).stats
    runs: dict[int, list[dict]] = {n: [] for n in counts}

    def drive(streams: int, tokens: int) -> dict:
        res = subprocess.run([sys.executable, "-m", "bench", "serving-cost", "--streams", str(streams), "--drive",
                              str(server.port), name, str(tokens), "--grpc"], cwd=ROOT, check=True,
                             capture_output=True, text=True)
        return json.loads(res.stdout)

    load = [round(x, 2) for x in os.getloadavg()]
    try:
        drive(2, 4)  # warm up the loop and the front
        for r in range(a.rounds):
            for n in (counts if r % 2 == 0 else counts[::-1]):
                seconds, steps, before = dict(stats.seconds), stats.steps, clocks()
                out = drive(n, a.tokens)
                after = clocks()
                spent = {k: stats.seconds[k] - seconds[k] for k in seconds}
                stepped = max(stats.steps - steps, 1)
                loop = {k: 1000 * spent[k] / stepped for k in ("run", "wait", "tokens", "regroup")}
                loop["rest"] = 1000 * out["wall_s"] / stepped - sum(loop.values())
                runs[n].append({"ms_per_token": 1000 * out["wall_s"] * n / out["tokens"], "tokens": out["tokens"],
                                "steps": stepped, "loop_ms_per_step": loop,
                                "groups": per_token(before, after, out["tokens"], out["wall_s"])})
    finally:
        server.stop(grace=1)

    def med(xs: list[float], digits: int) -> float:
        return round(statistics.median(xs), digits)

    rows = []
    for n, rs in runs.items():
        for g in GROUPS:
            v = [r["groups"][g] for r in rs]
            rows.append([n, g, int(med([x[0] for x in v], 0)), med([x[1] for x in v], 2),
                         f"{statistics.median(x[2] for x in v):.0%}", med([x[3] for x in v], 2),
                         med([x[4] for x in v], 2)])
    stream_ms = {n: med([r["ms_per_token"] for r in rs], 1) for n, rs in runs.items()}
    cpu_ms = {n: round(sum(r[3] for r in rows if r[0] == n), 2) for n in runs}
    data = {
        "meta": {"date": datetime.now(UTC).isoformat(timespec="seconds"),
                 "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.node()}", "load": load,
                 "load_end": [round(x, 2) for x in os.getloadavg()],
                 "command": "python -m bench serving-threads " + " ".join(argv if argv is not None else sys.argv[1:]),
                 "tokens": a.tokens, "rounds": a.rounds, "clock_tick_ms": 1000 / os.sysconf("SC_CLK_TCK")},
        "runs": {str(n): rs for n, rs in runs.items()},
        "stream_ms_per_token": {str(n): v for n, v in stream_ms.items()},
        "cpu_ms_per_token": {str(n): v for n, v in cpu_ms.items()},
        "tables": {"loop": {
            "title": "the decode loop's clocks per decode step (ms; median of rounds)",
            "columns": ["streams", "steps", "wall ms per step", "inside onnxruntime", "running prompts between steps",
                        "choosing and handing out", "rebuilding the batch", "the rest (loop Python, the GIL)"],
            "rows": [[n, int(med([r["steps"] for r in rs], 0)),
                      med([sum(r["loop_ms_per_step"].values()) for r in rs], 2),
                      *(med([r["loop_ms_per_step"][k] for r in rs], 2)
                        for k in ("run", "wait", "tokens", "regroup", "rest"))]
                     for n, rs in runs.items()]},
            "threads": {
            "title": f"the worker process's threads per token: greedy streams of {a.tokens} tokens over gRPC from "
                     f"another process (median of {a.rounds} rounds)",
            "columns": ["streams", "threads", "how many", "CPU ms per token", "CPU / wall time",
                        "voluntary switches per token", "involuntary switches per token"],
            "rows": rows,
            "note": "Each stream's wall time per token: " + "; ".join(
                f"{n} stream{'s' if n > 1 else ''} {v} ms (CPU {cpu_ms[n]} ms per token in all)"
                for n, v in stream_ms.items())
            + f". CPU time is read in ticks of {1000 // os.sysconf('SC_CLK_TCK')} ms."}},
    }
    print(write(a.out, "serving_threads", data))
    return 0
