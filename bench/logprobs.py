"""What `logprobs` costs a streamed OpenAI completion: the same 256-token stream with `logprobs: 5` and without, from
a worker in its own process (HTTP on loopback), timed in alternating blocks.  The candidates come from the logits
the decode loop already has, so the ratio should stay near 1 (the target is at most 1.2).

  python -m bench logprobs [--artifacts artifacts] [--model rope] [--tokens 256] [--repeat 10]

Writes bench/results/logprobs.json (the results convention: meta + tables) and returns the same dict to
bench.run, which calls it as a section of `make bench`.  Reports; never asserts.
"""

from __future__ import annotations

import http.client
import json
import os
import platform
import sys
import time
from pathlib import Path

from bench.lib.worker import Worker
from bench.timing import interleaved, paired_ratio
from model.cli import Parser

ROOT = Path(__file__).resolve().parent.parent
TARGET = 1.2


def stream(port: int, body: dict) -> int:
    """One streamed completion read to its end; returns the number of server-sent events."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    conn.request("POST", "/v1/completions", json.dumps(body), {"content-type": "application/json"})
    data = conn.getresponse().read()
    conn.close()
    return data.count(b"data: ")


def measure(port: int, model: str, tokens: int, repeat: int) -> dict:
    base = {"model": model, "prompt": "The positional encoding of a token", "max_tokens": tokens, "temperature": 0,
            "stream": True, "ignore_eos": True}
    with_lp = base | {"logprobs": 5}
    events = (stream(port, base), stream(port, with_lp))
    times = interleaved({"stream": lambda: stream(port, base), "stream + logprobs 5": lambda: stream(port, with_lp)},
                        repeat, block=2, warmup=2, block_warmup=1)
    return {"model": model, "tokens": tokens, "repeat": repeat, "events": list(events),
            "ratio": paired_ratio(times, "stream + logprobs 5", "stream"),
            "ms": {k: v["median_ms"] for k, v in times.items()}}


def bench_logprobs(art_dir: Path, models: list[str], tokens: int, repeat: int, out: Path | None = None,
                   command: str = "make bench") -> dict:
    """Each model's streamed completion of `tokens` tokens with and without logprobs: 5, from one worker."""
    with Worker(art_dir, "--threads", "2", http=True) as worker:
        runs = [measure(worker.http_port, m, tokens, repeat) for m in models]
    result = {
        "runs": runs, "target": TARGET,
        "meta": {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                 "machine": f"{os.cpu_count()} CPUs ({platform.processor() or platform.machine()}), Python "
                            f"{platform.python_version()}",
                 "load": list(os.getloadavg()), "command": command},
    }
    result["tables"] = {"cost": {
        "columns": ["model", "tokens", "SSE events without / with", "median ms without", "median ms with logprobs 5",
                    "ratio (paired)", "target"],
        "rows": [[r["model"], r["tokens"], f"{r['events'][0]} / {r['events'][1]}", round(r["ms"]["stream"], 1),
                  round(r["ms"]["stream + logprobs 5"], 1), round(r["ratio"], 3), f"<= {TARGET}"] for r in runs]}}
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        tmp = out / ".logprobs.json.tmp"
        tmp.write_text(json.dumps(result, indent=2) + "\n")
        os.replace(tmp, out / "logprobs.json")
    return result


def main(argv: list[str] | None = None) -> int:
    p = Parser(prog="python -m bench logprobs", description=__doc__.splitlines()[0])
    p.add_argument("--artifacts", default="artifacts")
    p.add_argument("--model", default="rope", help="comma-separated served models")
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--repeat", type=int, default=10)
    p.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = p.parse_args(argv)
    r = bench_logprobs(Path(args.artifacts), args.model.split(","), args.tokens, args.repeat, Path(args.out),
                       "python -m bench logprobs " + " ".join(argv if argv is not None else sys.argv[1:]))
    print(json.dumps(r["tables"], indent=2))
    return 0

