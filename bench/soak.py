"""make soak: a bounded load test of a real worker process.

  python -m bench soak --artifacts artifacts [--requests 20000] [--callers 64] [--max-seconds 900]

Starts `python -m service` on the artifacts, then N callers send a mix of Predict (some with attention maps),
Generate, Score and KServe ModelInfer across every model with prompts of mixed lengths, until --requests are
done or --max-seconds pass.  The worker's resident memory is sampled every second.  Writes
bench/results/soak.json and soak.md: requests, status codes, latency p50/p99 per RPC, throughput, and resident
memory side by side idle and under load: idle at start (models loaded and warmed up), the mean of the first,
middle and last tenth of the run and its peak, and idle again --idle-seconds after the load stops.  Reports;
never asserts.
"""

from __future__ import annotations

import os
import platform
import random
import signal
import threading
import time
from collections import Counter, defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import numpy as np

from bench.lib.results import write
from bench.lib.worker import Worker
from model.cli import Parser
from protos.inference import grpc_service_pb2 as kv
from protos.inference import grpc_service_pb2_grpc
from protos.posenc.v1 import posenc_pb2 as pb
from protos.posenc.v1 import posenc_pb2_grpc

ROOT = Path(__file__).resolve().parents[1]
WORDS = ("the function returns a new list of items in the order given by key and reverse when the object is "
         "called with no arguments it raises an exception").split()


def rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


class Load:
    def __init__(self, target: str, models: list[dict], seed: int):
        self.channel = grpc.insecure_channel(target, options=[("grpc.max_receive_message_length", 64 << 20)])
        self.posenc = posenc_pb2_grpc.PosencStub(self.channel)
        self.kserve = grpc_service_pb2_grpc.GRPCInferenceServiceStub(self.channel)
        self.models = models
        self.seed = seed
        self.lock = threading.Lock()
        self.codes: Counter = Counter()
        self.by_rpc: dict[str, Counter] = defaultdict(Counter)
        self.latency: dict[str, list[float]] = defaultdict(list)

    def prompt(self, rng: random.Random, m: dict) -> str:
        cap = m["max_positions"] or 400
        words = rng.randint(1, 60)
        return " ".join(rng.choice(WORDS) for _ in range(words))[: max(1, cap - 40)]

    def one(self, i: int) -> None:
        rng = random.Random(self.seed * 1_000_003 + i)
        m = self.models[i % len(self.models)]
        text = self.prompt(rng, m)
        kind = rng.choices(["Predict", "PredictMaps", "Generate", "Score", "ModelInfer"], [4, 1, 2, 2, 1])[0]
        start = time.perf_counter()
        try:
            if kind == "Predict":
                self.posenc.Predict(pb.PredictRequest(model=m["name"], prompt=pb.Prompt(text=text)), timeout=120)
            elif kind == "PredictMaps":
                self.posenc.Predict(pb.PredictRequest(model=m["name"], prompt=pb.Prompt(text=text),
                                                      attention=pb.ATTENTION_FULL, layers=[0]), timeout=120)
            elif kind == "Generate":
                for _ in self.posenc.Generate(pb.GenerateRequest(model=m["name"], prompt=pb.Prompt(text=text[:60]),
                                                                 max_new_tokens=rng.randint(1, 16)), timeout=120):
                    pass
            elif kind == "Score":
                self.posenc.Score(pb.ScoreRequest(model=m["name"], prompt=pb.Prompt(text=text + ".")), timeout=120)
            else:
                ids = np.frombuffer(text.encode()[:200], np.uint8).astype(np.int64)[None]
                tensor = kv.ModelInferRequest.InferInputTensor(name="input_ids", datatype="INT64",
                                                               shape=list(ids.shape))
                self.kserve.ModelInfer(kv.ModelInferRequest(
                    model_name=m["name"], inputs=[tensor], raw_input_contents=[ids.tobytes()],
                    outputs=[kv.ModelInferRequest.InferRequestedOutputTensor(name="logits")]), timeout=120)
            code = "OK"
        except grpc.RpcError as err:
            code = err.code().name
        ms = (time.perf_counter() - start) * 1000
        with self.lock:
            self.codes[code] += 1
            self.by_rpc[kind][code] += 1
            self.latency[kind].append(ms)


def percentiles(samples: list[float]) -> dict[str, float]:
    a = np.asarray(samples)
    return {"n": int(a.size), "p50_ms": round(float(np.percentile(a, 50)), 2),
            "p99_ms": round(float(np.percentile(a, 99)), 2), "max_ms": round(float(a.max()), 2)}


def main(argv: list[str] | None = None) -> int:
    p = Parser(prog="python -m bench soak", description=__doc__.splitlines()[0])
    p.add_argument("--artifacts", default="artifacts")
    p.add_argument("--requests", type=int, default=20000)
    p.add_argument("--callers", type=int, default=64)
    p.add_argument("--max-seconds", type=float, default=900)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--out", default=str(ROOT / "bench" / "results"))
    p.add_argument("--worker-arg", action="append", default=[], help="extra flag for the worker (repeatable)")
    p.add_argument("--idle-seconds", type=float, default=5.0, help="quiet time after the load before idle RSS")
    a = p.parse_args(argv)

    load_at_start = list(os.getloadavg())  # the machine's load before the worker and the callers add theirs
    worker = Worker(a.artifacts, *a.worker_arg, port=a.port)
    proc, port = worker.proc, worker.port
    samples: list[tuple[float, float]] = []
    stop = threading.Event()
    t0 = time.monotonic()

    def sample():
        while not stop.is_set():
            mb = rss_mb(proc.pid)
            if mb is not None:
                samples.append((time.monotonic() - t0, mb))
            stop.wait(1.0)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        load = Load(f"127.0.0.1:{port}", [], a.seed)
        listing = load.posenc.ListModels(pb.ListModelsRequest(), timeout=30).models
        load.models = [{"name": m.name, "max_positions": m.max_positions} for m in listing]
        rss_start = rss_mb(proc.pid)
        deadline = time.monotonic() + a.max_seconds
        issued = 0
        start = time.monotonic()
        with ThreadPoolExecutor(a.callers) as pool:
            window = []
            while issued < a.requests and time.monotonic() < deadline:
                window.append(pool.submit(load.one, issued))
                issued += 1
                if len(window) >= 4 * a.callers:  # keep the queue of pending submissions bounded
                    window.pop(0).result()
            for f in window:
                f.result()
        elapsed = time.monotonic() - start
        load_samples = len(samples)
        time.sleep(a.idle_seconds)
        rss_idle = rss_mb(proc.pid)
        proc.send_signal(signal.SIGTERM)
        exit_code = proc.wait(timeout=120)
    finally:
        stop.set()
        if proc.poll() is None:
            proc.kill()
    total = sum(load.codes.values())
    mem = [mb for _, mb in samples[:load_samples]]
    tenth = max(1, len(mem) // 10)
    middle = max(0, len(mem) // 2 - tenth // 2)
    result = {
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version()},
        "settings": {"requests": a.requests, "callers": a.callers, "max_seconds": a.max_seconds, "seed": a.seed,
                     "models": [m["name"] for m in load.models], "worker_args": a.worker_arg},
        "requests": total, "seconds": round(elapsed, 1), "requests_per_s": round(total / elapsed, 1),
        "codes": dict(load.codes), "by_rpc": {k: dict(v) for k, v in load.by_rpc.items()},
        "latency": {k: percentiles(v) for k, v in sorted(load.latency.items())},
        "memory_mb": {"start": round(rss_start or 0, 1), "first_tenth_mean": round(float(np.mean(mem[:tenth])), 1),
                      "middle_tenth_mean": round(float(np.mean(mem[middle:middle + tenth])), 1),
                      "last_tenth_mean": round(float(np.mean(mem[-tenth:])), 1), "peak": round(max(mem), 1),
                      "idle_after": round(rss_idle or 0, 1), "idle_seconds": a.idle_seconds,
                      "samples": len(mem),
                      "series": [[round(t, 1), round(mb, 1)] for t, mb in samples[::max(1, len(samples) // 60)]]},
        "worker_exit_code": exit_code,
    }
    result["meta"] = {"date": time.strftime("%Y-%m-%dT%H:%MZ", time.gmtime()), "load": load_at_start,
                      "machine": f"{os.cpu_count()} CPUs, {platform.platform()}", "command": "make soak"}
    result["tables"] = tables(result)
    print(write(Path(a.out), "soak", result, indent=2))
    return 0


def tables(r: dict) -> dict:
    """The soak's tables in the results convention (docs/tools/fill.py renders them into the docs and soak.md)."""
    mem = r["memory_mb"]
    return {
        "summary": {"title": "Soak", "columns": ["requests", "callers", "seconds", "requests/s", "worker exit code"],
                    "rows": [[r["requests"], r["settings"]["callers"], r["seconds"], r["requests_per_s"],
                              r["worker_exit_code"]]]},
        "codes": {"columns": ["status", "count"], "rows": [[c, n] for c, n in sorted(r["codes"].items())]},
        "latency": {"columns": ["RPC", "requests", "p50 ms", "p99 ms", "max ms"],
                    "rows": [[k, v["n"], v["p50_ms"], v["p99_ms"], v["max_ms"]] for k, v in r["latency"].items()]},
        "memory": {"title": f"Worker resident memory (MB), idle and under load ({mem['samples']} samples, one a "
                            "second)",
                   "columns": ["idle at start", "first tenth", "middle tenth", "last tenth", "peak",
                               f"idle {mem['idle_seconds']:g} s after the load"],
                   "rows": [[mem["start"], mem["first_tenth_mean"], mem["middle_tenth_mean"], mem["last_tenth_mean"],
                             mem["peak"], mem["idle_after"]]]},
    }

