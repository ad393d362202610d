"""Running streams while prompts arrive (issue 35 item 4): 8 streams decode; once they run, 16 prompts arrive at once;
the gaps between each running stream's tokens before and while the prompts are prefilled.

A decode step and a prompt piece run in separate onnxruntime calls, one after the other in each engine turn (the
compact layout's GroupQueryAttention refuses several new tokens on a past beside other rows: service/compact.py), so
a running stream's gap while prompts are prefilled is a step plus a piece of up to the token budget.

  python -m bench mixed-steps [--work DIR] [--prompt T] [--out bench/results]
"""

from __future__ import annotations

import json
import os
import platform
import sys
import tempfile
import threading
import time
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import requests

from bench.lib.results import write
from bench.prefix_cache import IDS, Worker, build
from model.cli import Parser


def stream(worker: Worker, ids: list[int], n: int, times: list[float]) -> None:
    # logprobs: every token is an event of its own (a plain stream may join tokens a slow reader has not taken)
    body = {"model": "llama", "prompt": ids, "max_tokens": n, "stream": True, "temperature": 0, "ignore_eos": True,
            "logprobs": 1}
    with requests.Session() as client, client.post(f"{worker.url}/v1/completions", json=body, stream=True,
                                                   timeout=600) as r:
        for line in r.iter_lines():
            if line.startswith(b"data: {"):
                times.append(time.perf_counter())


def main(argv: list[str] | None = None) -> int:
    p = Parser(prog="python -m bench mixed-steps", description=__doc__.split("\n\n")[0])
    p.add_argument("--work", type=Path, default=None, help="folder for the model (kept between runs)")
    p.add_argument("--prompt", type=int, default=512, help="tokens of each arriving prompt")
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    a = p.parse_args(argv)
    if a.prompt < 1:
        p.error("--prompt must be >= 1")
    models = build(a.work or Path(tempfile.mkdtemp(prefix="mixed-steps-")))
    rng = np.random.default_rng(1)
    worker = Worker(models, 0)
    try:
        worker.post({"model": "llama", "prompt": [5, 6, 7], "max_tokens": 2})
        times: list[list[float]] = [[] for _ in range(8)]
        runners = [threading.Thread(target=stream, args=(worker, rng.integers(3, IDS, 32).tolist(), 400, times[i]))
                   for i in range(8)]
        for t in runners:
            t.start()
        while min(len(t) for t in times) < 40 and all(t.is_alive() for t in runners):
            time.sleep(0.01)
        arrive = time.perf_counter()
        prompts = [threading.Thread(target=worker.post, args=({"model": "llama", "max_tokens": 1,
                                                                "prompt": rng.integers(3, IDS, a.prompt).tolist()},))
                   for _ in range(16)]
        for t in prompts:
            t.start()
        for t in prompts:
            t.join()
        done = time.perf_counter()
        for t in runners:
            t.join()
    finally:
        worker.close()
    before, during = [], []
    for ts in times:
        for x, y in zip(ts, ts[1:], strict=False):
            (during if arrive <= y <= done else before if y < arrive else []).append((y - x) * 1000)
    pct = {k: {q: float(np.percentile(v, q)) for q in (50, 99)} for k, v in (("before", before), ("during", during))}
    args = sys.argv[1:] if argv is None else argv
    doc = {"meta": {"date": datetime.now(UTC).isoformat(timespec="seconds"),
                    "machine": f"{platform.machine()} {os.cpu_count()} CPUs, Python {platform.python_version()}",
                    "load": list(os.getloadavg()), "command": " ".join(["python -m bench mixed-steps", *args])},
           "gaps_ms": pct, "prefill_s": done - arrive,
           "tables": {"gaps": {"columns": ["running streams' gaps between tokens", "p50 (ms)", "p99 (ms)", "gaps"],
                               "rows": [["8 streams alone", round(pct["before"][50], 1), round(pct["before"][99], 1),
                                         len(before)],
                                        [f"while 16 prompts of {a.prompt} tokens arrive", round(pct["during"][50], 1),
                                         round(pct["during"][99], 1), len(during)]],
                               "note": f"the 16 prompts took {done - arrive:.1f} s to answer"}}}
    print(write(a.out, "mixed_steps", doc))
    print(json.dumps(pct))
    return 0

