"""Serving benchmarks against real workers: Predict over gRPC against the in-process call (serving overhead), and
dynamic batching (requests/s and Generate tokens/s by concurrency, batching on and off)."""

from __future__ import annotations

import statistics
import threading
import time
from pathlib import Path

import grpc
import numpy as np

from bench.engines import feeds, session
from bench.lib.worker import Worker
from bench.timing import interleaved, paired_ratio
from protos.posenc.v1 import posenc_pb2 as pb
from protos.posenc.v1 import posenc_pb2_grpc

ROOT = Path(__file__).resolve().parent.parent


# --- 2. serving overhead ------------------------------------------------------------------------------------

def bench_serving(art_dir: Path, model: str, n: int, repeat: int) -> list[dict]:
    """Predict to a worker in its own process (its own interpreter and GIL, as deployed) against the same
    onnxruntime call in this process, fetching exactly what the worker's engine fetches for a lone Predict:
    logits, plus attentions when maps are asked for (no present.* state: Predict does not keep it)."""
    from service.artifacts import load_artifact

    worker = Worker(art_dir, "--threads", "2", "--max-wait-ms", "0")
    port = worker.port
    try:
        sess = load_artifact(art_dir / model, threads=2).session  # the worker's own session settings
        ids = np.random.default_rng(0).integers(0, 256, (1, n)).astype(np.int64)
        f = feeds(sess, ids)
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = posenc_pb2_grpc.PosencStub(ch)
            prompt = pb.Prompt(tokens=pb.TokenIds(ids=ids[0].tolist()))
            plain = pb.PredictRequest(model=model, prompt=prompt)
            maps = pb.PredictRequest(model=model, prompt=prompt, attention=pb.ATTENTION_FULL)
            times = interleaved({
                "in-process ort (logits)": lambda: sess.run(["logits"], f),
                "gRPC Predict (no maps)": lambda: stub.Predict(plain),
                "in-process ort (logits + attentions)": lambda: sess.run(["logits", "attentions"], f),
                "gRPC Predict (full maps)": lambda: stub.Predict(maps),
            }, repeat)
    finally:
        worker.close()
    rows = []
    for name, t in times.items():
        base = "in-process ort (logits + attentions)" if "maps" in name or "attentions" in name else \
            "in-process ort (logits)"
        rows.append({"model": model, "seq": n, "path": name, **t,
                     "ratio_vs_in_process": paired_ratio(times, name, base)})
    return rows


# --- 3. dynamic batching ------------------------------------------------------------------------------------

def run_clients(level: int, work: list, call) -> float:
    """`level` threads share `work` round-robin, all released at once; returns the wall seconds."""
    barrier = threading.Barrier(level)

    def client(k):
        barrier.wait()
        for item in work[k::level]:
            call(item)

    threads = [threading.Thread(target=client, args=(k,)) for k in range(level)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - start


def bench_batching(art_dir: Path, model: str, levels: list[int], per_client: int, new_tokens: int,
                   rounds: int = 3) -> dict:
    """Predict requests per second and Generate tokens per second at each concurrency, batching on and off; and
    onnxruntime's own cost per row by batch size, which bounds what batching can gain for prompts.

    Every concurrency level sends the same prompts (and the same Generate streams), in both modes; an untimed
    warm-up round comes first.  Both workers run side by side and every (mode, concurrency) is measured once per
    round, so a slow minute on a shared machine lands in one round of each; rates and speedups are medians over
    the rounds (speedups: of per-round ratios)."""
    samples: dict[tuple, list[tuple[int, float]]] = {}  # (kind, batching, level) -> [(work done, seconds)]
    ttft: dict[tuple, list[float]] = {}  # (batching, streams) -> seconds to each stream's first token
    rng = np.random.default_rng(0)
    prompts = [rng.integers(32, 256, int(rng.integers(16, 129))).tolist() for _ in range(max(levels) * per_client)]
    streams = [rng.integers(97, 123, 8).tolist() for _ in range(max(levels))]
    workers = {batching: Worker(art_dir, "--max-batch", "32" if batching else "1", "--max-wait-ms", "2",
                                      "--max-queue", "1024", "--workers", "64", "--max-streams", "128")
               for batching in (True, False)}
    try:
        for r in range(rounds + 1):  # round 0 warms up: sessions, arenas, threads, connections
            for batching, worker in workers.items():
                with grpc.insecure_channel(f"127.0.0.1:{worker.port}") as ch:
                    stub = posenc_pb2_grpc.PosencStub(ch)
                    for level in levels:
                        seconds = run_clients(level, prompts, lambda p, stub=stub: stub.Predict(
                            pb.PredictRequest(model=model, prompt=pb.Prompt(tokens=pb.TokenIds(ids=p)))))
                        if r:
                            samples.setdefault(("predict", batching, level), []).append((len(prompts), seconds))
                        firsts: list[float] = []

                        def stream(p, stub=stub, firsts=firsts):
                            start = time.perf_counter()
                            call = stub.Generate(pb.GenerateRequest(model=model, prompt=pb.Prompt(
                                tokens=pb.TokenIds(ids=p)), max_new_tokens=new_tokens))
                            next(call)
                            firsts.append(time.perf_counter() - start)  # time to the first token
                            list(call)

                        seconds = run_clients(level, streams, stream)
                        if r:
                            samples.setdefault(("generate", batching, level), []).append(
                                (len(streams) * new_tokens, seconds))
                            ttft.setdefault((batching, level), []).extend(firsts)
    finally:
        for worker in workers.values():
            worker.close()

    def table(kind: str, level_key: str, work_key: str, rate_key: str) -> list[dict]:
        out = []
        for batching in (True, False):
            for level in levels:
                runs, first = samples[(kind, batching, level)], samples[(kind, batching, levels[0])]
                out.append({"model": model, "batching": batching, level_key: level, "rounds": len(runs),
                            work_key: runs[0][0], rate_key: statistics.median(w / s for w, s in runs),
                            "speedup_vs_concurrency_1": statistics.median(
                                (w / s) / (w1 / s1) for (w, s), (w1, s1) in zip(runs, first, strict=True))})
        return out

    predict = table("predict", "concurrency", "requests", "rps")
    generate = table("generate", "streams", "tokens", "tokens_per_s")
    for row in generate:  # time to first token over every stream of every round
        firsts = sorted(ttft[(row["batching"], row["streams"])])
        row["ttft_p50_ms"] = 1000 * firsts[len(firsts) // 2]
        row["ttft_p99_ms"] = 1000 * firsts[min(len(firsts) - 1, int(0.99 * len(firsts)))]
    sess = session(art_dir / model / "model.onnx")
    engines = {}
    for b in sorted({1, *levels}):
        ids = np.random.default_rng(b).integers(32, 128, (b, 72)).astype(np.int64)
        f = feeds(sess, ids)
        engines[b] = (lambda f=f: sess.run(["logits"], f))
    times = interleaved(engines, 4 if per_client == 1 else 40, block=2 if per_client == 1 else 5)
    per_row = [{"batch": b, "tokens": 72, "median_ms": t["median_ms"], "ms_per_row": t["median_ms"] / b,
                "row_cost_vs_batch_1": paired_ratio(times, b, 1) / b} for b, t in times.items()]
    return {"predict": predict, "generate": generate, "onnxruntime_per_row": per_row}
