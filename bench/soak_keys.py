"""A noisy key beside a quiet one: do per-key limits keep one caller from starving the others?

  python -m bench soak-keys --artifacts DIR [--seconds 20] [--noisy-callers 32] [--quiet-rate 4]
                            [--key-rps 20] [--key-concurrent 2] [--model rope]
  python -m bench soak-keys --random default      # the model of --model at a preset size, random weights, built
                                                  # into a temporary folder (same compute as the trained one)

A real worker process with two API keys.  The quiet key sends one Predict every 1/--quiet-rate seconds from one
caller; the noisy key runs --noisy-callers callers back to back (Generate streams and Predicts), each pausing
50 ms after a refusal.  Three phases of --seconds each: the quiet key alone; both keys with no per-key limits;
both keys on a worker started with --key-requests-per-second and --key-max-concurrent.  For each phase: the quiet
key's latency (p50, p99) and refusals, and the noisy key's answered calls a second and refusals.  Writes
bench/results/soak_keys.json (results convention: meta, tables).  Reports; never asserts.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc

from bench.lib.worker import Worker
from bench.soak import ROOT, percentiles
from client.channel import channel_for
from model.cli import Parser
from protos.posenc.v1 import posenc_pb2 as pb
from protos.posenc.v1 import posenc_pb2_grpc

QUIET, NOISY = "quiet-key-2f6a", "noisy-key-9c1e"


class Caller:
    """Calls of one key: latencies of answered calls, refusals by status."""

    def __init__(self, port: int, key: str, model: str):
        self.channel = channel_for(f"127.0.0.1:{port}", api_key=key, retries=False)
        self.stub = posenc_pb2_grpc.PosencStub(self.channel)
        self.model = model
        self.lock = threading.Lock()
        self.latency_ms: list[float] = []
        self.refused: dict[str, int] = {}

    def call(self, kind: str) -> bool:
        t0 = time.perf_counter()
        try:
            if kind == "Generate":
                for _ in self.stub.Generate(pb.GenerateRequest(model=self.model, prompt=pb.Prompt(text="the function"),
                                                               max_new_tokens=64), timeout=60):
                    pass
            else:
                self.stub.Predict(pb.PredictRequest(model=self.model, prompt=pb.Prompt(text="dog bites man")),
                                  timeout=60)
            ok, code = True, "OK"
        except grpc.RpcError as err:
            ok, code = False, err.code().name
        with self.lock:
            if ok:
                self.latency_ms.append((time.perf_counter() - t0) * 1000)
            else:
                self.refused[code] = self.refused.get(code, 0) + 1
        return ok


def random_artifact(preset_name: str, variant: str, dest: Path) -> None:
    """An artifact of the preset's size with random weights: it costs the worker what the trained model costs."""
    import torch

    from export.build import build_artifact
    from model.config import preset
    from model.transformer import Transformer

    torch.manual_seed(0)
    model = Transformer(preset(preset_name, variant)).eval()
    build_artifact(model, dest / variant, name=variant, opset=23, source={"kind": "random", "preset": preset_name},
                   training={}, force=False)


def phase(artifacts: str, keys: Path, seconds: float, noisy_callers: int, quiet_rate: float, model: str,
          limits: list[str]) -> dict:
    worker = Worker(artifacts, "--api-keys-file", str(keys), *limits)
    port = worker.port
    try:
        quiet, noisy = Caller(port, QUIET, model), Caller(port, NOISY, model)
        stop = threading.Event()

        def quiet_loop():
            step, nxt = 1.0 / quiet_rate, time.monotonic()
            while not stop.is_set():
                quiet.call("Predict")
                nxt += step
                stop.wait(max(0.0, nxt - time.monotonic()))

        def noisy_loop(k: int):
            i = k
            while not stop.is_set():
                if not noisy.call("Generate" if i % 2 else "Predict"):
                    stop.wait(0.05)
                i += 1

        threads = [threading.Thread(target=quiet_loop)]
        threads += [threading.Thread(target=noisy_loop, args=(k,)) for k in range(noisy_callers)]
        for t in threads:
            t.start()
        time.sleep(seconds)
        stop.set()
        for t in threads:
            t.join(timeout=120)
        out = {"quiet": {**percentiles(quiet.latency_ms), "refused": quiet.refused},
               "noisy": {"answered": len(noisy.latency_ms), "answered_per_s": round(len(noisy.latency_ms) / seconds, 1),
                         "refused": noisy.refused}}
        quiet.channel.close()
        noisy.channel.close()
        return out
    finally:
        worker.close()


def main(argv: list[str] | None = None) -> int:
    p = Parser(prog="python -m bench soak-keys", description=__doc__.splitlines()[0])
    p.add_argument("--artifacts", default="artifacts")
    p.add_argument("--model", default="rope")
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--random", metavar="PRESET", help="serve --model at this preset size with random weights "
                                                       "(built into a temporary folder) instead of --artifacts")
    p.add_argument("--noisy-callers", type=int, default=32)
    p.add_argument("--quiet-rate", type=float, default=4.0, help="the quiet key's calls a second")
    p.add_argument("--key-rps", type=float, default=20.0, help="--key-requests-per-second in the limited phase")
    p.add_argument("--key-concurrent", type=int, default=2, help="--key-max-concurrent in the limited phase")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "soak_keys.json"))
    a = p.parse_args(argv)
    load_at_start = [round(x, 2) for x in os.getloadavg()]
    with tempfile.TemporaryDirectory() as tmp:
        keys = Path(tmp) / "keys"
        keys.write_text(f"{QUIET}\n{NOISY}\n")
        if a.random:
            a.artifacts = str(Path(tmp) / "artifacts")
            random_artifact(a.random, a.model, Path(a.artifacts))
        run = {}
        for name, callers, limits in (
                ("quiet alone", 0, []),
                ("noisy beside, no per-key limits", a.noisy_callers, []),
                ("noisy beside, per-key limits", a.noisy_callers,
                 ["--key-requests-per-second", str(a.key_rps), "--key-max-concurrent", str(a.key_concurrent)])):
            run[name] = phase(a.artifacts, keys, a.seconds, callers, a.quiet_rate, a.model, limits)
            print(name, json.dumps(run[name]), flush=True)
    rows = [[name, r["quiet"]["n"], r["quiet"]["p50_ms"], r["quiet"]["p99_ms"], sum(r["quiet"]["refused"].values()),
             r["noisy"]["answered_per_s"], sum(r["noisy"]["refused"].values())] for name, r in run.items()]
    result = {
        "meta": {"date": time.strftime("%Y-%m-%dT%H:%MZ", time.gmtime()), "load": load_at_start,
                 "machine": f"{os.cpu_count()} CPUs, {platform.platform()}",
                 "command": "python -m bench soak-keys " + " ".join(sys.argv[1:] if argv is None else argv)},
        "tables": {"keys": {
            "title": f"A quiet key ({a.quiet_rate:g} Predict/s) beside a noisy key ({a.noisy_callers} callers); "
                     f"limits {a.key_rps:g} requests/s and {a.key_concurrent} calls at once per key",
            "columns": ["phase", "quiet calls", "quiet p50 ms", "quiet p99 ms", "quiet refused",
                        "noisy answered/s", "noisy refused"],
            "rows": rows}},
        "settings": vars(a), "phases": run,
    }
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp_out = out.with_name(f".{out.name}.tmp")
    tmp_out.write_text(json.dumps(result, indent=2) + "\n")
    os.replace(tmp_out, out)
    print(f"written {out}")
    return 0

