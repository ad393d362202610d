"""Where the worker's time goes at 32 streams, and what a burst of new prompts does to running streams.

  python -m bench serving-cost [--work /tmp/posenc-peers] [--streams 32] [--tokens 64] [--rounds 2]

The model is the peer benchmark's (bench/peers_model.py: SmolLM-135M's shape, random weights, fp32, 128-token
prompts), imported and exported as `make bench-peers` does (cached under --work).  A real worker (service.server,
its default settings but the ports) runs in this process, so its decode loop's own clocks can be read
(EngineStats.seconds: waiting for the session while the engine runs prompts, inside onnxruntime, choosing and
handing out tokens, rebuilding the batch); what is left of the loop's wall time is the loop's other Python and
the time it waits for the GIL while the fronts' threads run.

  cost      --streams greedy streams at once, --tokens each, driven three ways: through Operations.generate in
            threads of this process (no front), over HTTP (OpenAI /v1/completions with server-sent events) and
            over gRPC (posenc.v1 Generate) from a load generator in its own process; the share of the loop's
            time inside onnxruntime; and in process again with the prompts run whole (the token budget lifted)
  gap       half the streams running, then the other half's prompts arriving at once: the gaps between tokens
            of the running streams while those prompts are prefilled, with prompts run whole (one call for
            every waiting prompt) and in the engine's token budget (pieces between decode steps); prompts run
            whole by a second engine on the same model (its sessions shared) whose budget no prompt reaches
  sampling  choosing 32 greedy tokens from (32, vocabulary) logits: the log-softmax of every row, the argmax path
            with each token's log-probability, and the argmax alone (rows whose reader reads none)

Rounds alternate the variants; the load is recorded.  Writes bench/results/serving_cost.{json,md}.  Reports;
never asserts.
"""

from __future__ import annotations

import argparse
import dataclasses
import http.client
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from datetime import UTC, datetime
from pathlib import Path

import numpy as np

from bench import peers_prepare as prep
from bench.lib.results import write
from bench.lib.worker import free_port
from bench.peers_model import make_folder, prompts
from model.cli import Parser

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"


def each(fn, n: int) -> None:
    """fn(0) ... fn(n - 1), each in a thread of its own, all at once; returns when all have."""
    threads = [threading.Thread(target=fn, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def drive(port: int, model: str, ids: list[list[int]], tokens: int) -> dict:
    """One streamed completion per prompt, all at once (a thread each): tokens received and the wall time."""
    counts, start = [0] * len(ids), time.perf_counter()

    def one(i):
        body = {"model": model, "prompt": ids[i], "max_tokens": tokens, "temperature": 0, "stream": True,
                "ignore_eos": True}
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
        c.request("POST", "/v1/completions", body=json.dumps(body), headers={"content-type": "application/json"})
        r = c.getresponse()
        for raw in r:
            line = raw.strip()
            if line.startswith(b"data:") and line[5:].strip() != b"[DONE]":
                counts[i] += len(json.loads(line[5:])["choices"])
        c.close()

    each(one, len(ids))
    return {"wall_s": time.perf_counter() - start, "tokens": sum(counts)}


def drive_grpc(port: int, model: str, ids: list[list[int]], tokens: int) -> dict:
    """The same over posenc.v1 Generate (a server stream of one message per token), one channel per stream."""
    import grpc

    from protos.posenc.v1 import posenc_pb2 as pb
    from protos.posenc.v1 import posenc_pb2_grpc

    counts, start = [0] * len(ids), time.perf_counter()

    def one(i):
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = posenc_pb2_grpc.PosencStub(channel)
            request = pb.GenerateRequest(model=model, prompt=pb.Prompt(tokens=pb.TokenIds(ids=ids[i])),
                                         max_new_tokens=tokens, ignore_eos=True)
            counts[i] = sum(1 for _ in stub.Generate(request, timeout=600))

    each(one, len(ids))
    return {"wall_s": time.perf_counter() - start, "tokens": sum(counts)}


def generate(ops, model: str, ids: list[list[int]], tokens: int, stamps: list[list[float]] | None = None) -> dict:
    """Operations.generate per prompt in a thread each (what a front does, without the wire)."""
    from service.sampling import SamplingParams

    params = SamplingParams(max_new_tokens=tokens, ignore_eos=True)
    got, start = [0] * len(ids), time.perf_counter()

    def one(i):
        for _, item in ops.generate(model, [(None, ids[i])], params):
            if hasattr(item, "reason"):  # an Emitted token (the first item is the Generation)
                got[i] += 1
                if stamps is not None:
                    stamps[i].append(time.perf_counter())

    each(one, len(ids))
    return {"wall_s": time.perf_counter() - start, "tokens": sum(got)}


def cost_row(how: str, stats, before: dict, steps: int, rows: int, out: dict) -> list:
    spent = {k: stats.seconds[k] - before[k] for k in before}
    n = stats.steps - steps
    wall = out["wall_s"]
    other = max(wall - sum(spent.values()), 0.0)
    pct = [round(100 * spent[k] / wall, 1) for k in ("run", "wait", "tokens", "regroup")]
    return [how, round(out["tokens"] / wall, 1), n, round((stats.rows_run - rows) / max(n, 1), 1),
            round(1000 * spent["run"] / max(n, 1), 1), *pct, round(100 * other / wall, 1)]


def gap_stats(stamps: list[list[float]], window: tuple[float, float]) -> tuple[float, float, float]:
    gaps = [b - a for s in stamps for a, b in zip(s, s[1:], strict=False) if b >= window[0] and a <= window[1]]
    gaps.sort()
    if not gaps:
        return float("nan"), float("nan"), float("nan")
    return (1000 * statistics.median(gaps), 1000 * gaps[min(len(gaps) - 1, round(0.99 * (len(gaps) - 1)))],
            1000 * gaps[-1])


def main(argv: list[str] | None = None) -> int:
    p = Parser(prog="python -m bench serving-cost", description=__doc__.split("\n\n")[0])
    p.add_argument("--work", type=Path, default=Path("/tmp/posenc-peers"))
    p.add_argument("--artifact", type=Path, help="serve this artifact folder instead of the peer model's")
    p.add_argument("--streams", type=int, default=32)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--drive", nargs=3, metavar=("PORT", "MODEL", "TOKENS"), help=argparse.SUPPRESS)
    p.add_argument("--grpc", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    ids = prompts()[:a.streams].tolist()
    if a.drive:  # the load generator's own process
        port, model, tokens = int(a.drive[0]), a.drive[1], int(a.drive[2])
        print(json.dumps((drive_grpc if a.grpc else drive)(port, model, ids, tokens)))
        return 0

    from service.generation import greedy_rows
    from service.operations import Operations
    from service.registry import Registry
    from service.sampling import log_softmax
    from service.server import Server
    from service.settings import Settings

    art = a.artifact
    if art is None:
        make_folder(a.work / "hf")
        art = prep.posenc_artifact(a.work / "hf", a.work)
    http_port = free_port()
    server = Server(Settings(model_dir=art.parent, port=0, http_port=http_port, metrics_port=-1,
                             log_level="WARNING")).start()
    name = art.name
    model, settings = server.registry.models[name], server.settings
    budget = settings.batching.batch_tokens
    # the same model (its sessions shared) on an engine of its own whose token budget no prompt reaches
    whole_ops = Operations(Registry({name: model}, settings.limits,
                                    dataclasses.replace(settings.batching, batch_tokens=10**9), settings.tuning))
    whole_prompts = f"in process, prompts whole (one call for all {a.streams})"
    via_grpc = "gRPC (posenc.v1 Generate, load generator process)"
    cost = {"in process (Operations.generate)": [], "HTTP (OpenAI SSE, load generator process)": [],
            via_grpc: [], whole_prompts: []}
    gaps: dict[str, list] = {}
    try:
        generate(server.ops, name, ids[:2], 4)  # warm up the loop
        for r in range(a.rounds):
            for how in (list(cost) if r % 2 == 0 else list(cost)[::-1]):
                ops = whole_ops if how == whole_prompts else server.ops
                stats = ops.registry.engine(name).stats
                before, steps, rows = dict(stats.seconds), stats.steps, stats.rows_run
                if how.startswith(("HTTP", "gRPC")):
                    port, flag = (server.port, ["--grpc"]) if how == via_grpc else (http_port, [])
                    res = subprocess.run([sys.executable, "-m", "bench", "serving-cost", "--streams", str(a.streams),
                                          "--drive", str(port), name, str(a.tokens), *flag], cwd=ROOT, check=True,
                                         capture_output=True, text=True)
                    out = json.loads(res.stdout)
                else:
                    out = generate(ops, name, ids, a.tokens)
                cost[how].append(cost_row(how, stats, before, steps, rows, out))
            for whole in ((True, False) if r % 2 == 0 else (False, True)):
                ops = whole_ops if whole else server.ops
                half = a.streams // 2
                stamps: list[list[float]] = [[] for _ in range(half)]
                runner = threading.Thread(target=generate, args=(ops, name, ids[:half], a.tokens * 2, stamps))
                runner.start()
                while min(len(s) for s in stamps) < 2:  # every running stream is in the decode loop
                    time.sleep(0.005)
                t0 = time.perf_counter()
                late: list[list[float]] = [[] for _ in range(a.streams - half)]
                generate(ops, name, ids[half:], 1, late)
                t1 = time.perf_counter()
                runner.join()
                first = statistics.median(1000 * (s[0] - t0) for s in late if s)
                key = "whole prompts (one call)" if whole else f"pieces of {budget} tokens"
                gaps.setdefault(key, []).append([*gap_stats(stamps, (t0, t1)), first])
    finally:
        whole_ops.registry.close()
        server.stop(grace=1)
    logits = np.random.default_rng(0).standard_normal((32, model.vocab_size)).astype(np.float32)
    sampling = {"log_softmax of every row, argmax": lambda: log_softmax(logits).argmax(axis=1),
                "argmax and its log-probability (greedy_rows)": lambda: greedy_rows(logits),
                "argmax alone (greedy_rows, no reader wants the log-probability)":
                    lambda: greedy_rows(logits, np.zeros(len(logits), bool))}
    times = {k: sorted(_ms(f) for _ in range(15)) for k, f in sampling.items()}

    def med(rows: list[list]) -> list:
        return [rows[0][0]] + [round(statistics.median(r[i] for r in rows), 1) for i in range(1, len(rows[0]))]

    data = {
        "meta": {"date": datetime.now(UTC).isoformat(timespec="seconds"),
                 "machine": f"{platform.machine()}, {os.cpu_count()} CPUs", "load": list(os.getloadavg()),
                 "command": "python -m bench serving-cost " + " ".join(argv if argv is not None else sys.argv[1:])},
        "tables": {
            "cost": {"title": f"{a.streams} greedy streams of {a.tokens} tokens after 128-token prompts, the decode "
                              "loop's time (% of the wall time; median of rounds)",
                     "columns": ["driven", "tok/s", "steps", "rows/step", "ms in onnxruntime/step",
                                 "% inside onnxruntime", "% waiting for prompts' calls", "% choosing/handing out",
                                 "% rebuilding the batch", "% other (loop Python, GIL)"],
                     "rows": [med(v) for v in cost.values()]},
            "gap": {"title": f"{a.streams // 2} streams running, {a.streams - a.streams // 2} 128-token prompts "
                             "arriving at once: gaps between the running streams' tokens while they are prefilled",
                    "columns": ["prompts run as", "gap p50 ms", "gap p99 ms", "gap max ms",
                                "new prompts' first token p50 ms"],
                    "rows": [[k, *(round(statistics.median(r[i] for r in v), 1) for i in range(4))]
                             for k, v in gaps.items()]},
            "sampling": {"title": f"choosing 32 greedy tokens from (32, {model.vocab_size}) logits",
                         "columns": ["how", "ms (median of 15)"],
                         "rows": [[k, round(statistics.median(v), 2)] for k, v in times.items()]},
        },
    }
    print(write(a.out, "serving_cost", data))
    return 0


def _ms(fn) -> float:
    start = time.perf_counter()
    fn()
    return 1000 * (time.perf_counter() - start)

