"""The same worker measurements from two revisions of this repository, on one artifact, in one run: what a change
did to the served figures, free of the drift between two runs on a shared machine.

  python -m bench trees --before 8e1c03a --after HEAD --artifacts /tmp/posenc-peers/posenc \
      [--after-args "--prefix-cache-mb 0"] [--repeat 48] [--name trees]

Each revision is checked out into a temporary git worktree (`.` is this working tree as it is) and served by its
own `python -m service` process (HTTP on loopback, 2 intra-op threads), both processes up at once. The requests
are those of `make bench-peers` (bench/peers_model.py: 128-id prompts, greedy): the first token (max_tokens 1, the
prompt's prefill and one token), one stream of 64 new tokens and 32 such streams at once (streamed, tokens/s), and
each worker's peak resident set over the run (VmHWM: the 32 streams' share). The two workers are timed in
alternating blocks whose order rotates (bench/timing.py), and each ratio is the median of the block-by-block
ratios, so a minute in which the machine is slower moves both sides alike.

Writes bench/results/NAME.{json,md} (the results convention: meta + tables). Reports; never asserts.
"""

from __future__ import annotations

import http.client
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench.lib import worker as launch
from bench.lib.results import write
from bench.peers_model import prompts
from bench.timing import interleaved, paired_ratio
from model.cli import Parser

ROOT = Path(__file__).resolve().parent.parent
NEW_TOKENS = 64


def checkout(rev: str, into: Path) -> tuple[Path, str]:
    """(the tree to run, its commit): `.` is this working tree, any other revision a detached worktree."""
    if rev == ".":
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, check=True, capture_output=True,
                              text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, check=True,
                               capture_output=True, text=True).stdout.strip()
        return ROOT, f"{head} + uncommitted changes" if dirty else head
    commit = subprocess.run(["git", "rev-parse", "--short", rev], cwd=ROOT, check=True, capture_output=True,
                            text=True).stdout.strip()
    subprocess.run(["git", "worktree", "add", "--detach", str(into), commit], cwd=ROOT, check=True,
                   capture_output=True)
    return into, commit


class Worker:
    """One revision's worker process, serving the artifact folder over HTTP."""

    def __init__(self, tree: Path, artifacts: Path, args: list[str], log: Path):
        try:
            self.worker = launch.Worker(artifacts, "--threads", "2", *args, http=True, tree=tree, log=log)
        except RuntimeError as err:
            raise SystemExit(str(err)) from None
        self.proc, self.port = self.worker.proc, self.worker.http_port
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        conn.request("GET", "/v1/models")
        self.model = str(json.loads(conn.getresponse().read())["data"][0]["id"])
        conn.close()

    def complete(self, prompt: list[int], max_tokens: int, stream: bool) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=600)
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": stream}
        conn.request("POST", "/v1/completions", json.dumps(body), {"content-type": "application/json"})
        resp = conn.getresponse()
        data = resp.read()
        conn.close()
        if resp.status != 200:
            raise SystemExit(f"HTTP {resp.status}: {data[:300]!r}")

    def streams(self, prompts: list[list[int]], max_tokens: int) -> None:
        """Every prompt a stream of its own, all at once (a thread each); the first failure is raised."""
        errors: list[BaseException] = []

        def one(p: list[int]) -> None:
            try:
                self.complete(p, max_tokens, True)
            except BaseException as err:  # SystemExit included: a refused stream ends the run
                errors.append(err)

        threads = [threading.Thread(target=one, args=(p,)) for p in prompts]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]

    def peak_rss_gb(self) -> float:
        with open(f"/proc/{self.proc.pid}/status") as f:
            status = dict(line.split(":", 1) for line in f if ":" in line)
        return int(status["VmHWM"].split()[0]) / 1e6

    def close(self) -> None:
        self.worker.close()


def measure(workers: dict[str, Worker], repeat: int) -> dict[str, dict]:
    """Per measurement, each worker's interleaved timings; prompts cycle through the benchmark's 32."""
    ps = [[int(t) for t in p] for p in prompts()]
    out = {}
    for what, tokens, stream in (("first token", 1, False), ("one stream", NEW_TOKENS, True)):
        fns = {}
        for name, w in workers.items():
            turn = iter(range(10 ** 9))
            fns[name] = lambda w=w, turn=turn, n=tokens, s=stream: w.complete(ps[next(turn) % len(ps)], n, s)
        reps = repeat if tokens == 1 else max(6, repeat // 8)
        out[what] = interleaved(fns, reps, block=max(2, reps // 6), warmup=2, block_warmup=1)
    fns = {name: lambda w=w: w.streams(ps, NEW_TOKENS) for name, w in workers.items()}
    out["32 streams"] = interleaved(fns, max(3, repeat // 32), block=1, warmup=1, block_warmup=0)
    return out


def main(argv: list[str] | None = None) -> int:
    p = Parser(prog="python -m bench trees", description=__doc__.splitlines()[0])
    p.add_argument("--before", required=True, help="a git revision, or . for this working tree")
    p.add_argument("--after", default=".", help="a git revision, or . for this working tree")
    p.add_argument("--artifacts", required=True, help="a model folder both revisions can serve")
    p.add_argument("--before-args", default="", help="extra worker options for the before revision")
    p.add_argument("--after-args", default="", help="extra worker options for the after revision")
    p.add_argument("--repeat", type=int, default=48, help="timed first-token requests per revision")
    p.add_argument("--name", default="trees")
    p.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="posenc-trees-") as tmp:
        trees, workers = {}, {}
        try:
            for side, rev, extra in (("before", args.before, args.before_args),
                                     ("after", args.after, args.after_args)):
                tree, commit = checkout(rev, Path(tmp) / side)
                trees[side] = (tree, commit, extra)
                workers[side] = Worker(tree, Path(args.artifacts), shlex.split(extra), Path(tmp) / f"{side}.log")
            load0 = list(os.getloadavg())
            times = measure(workers, args.repeat)
            peaks = {side: w.peak_rss_gb() for side, w in workers.items()}
        finally:
            for w in workers.values():
                w.close()
            for tree, _, _ in trees.values():
                if tree != ROOT:
                    subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT, check=False,
                                   capture_output=True)
    rows = []
    for what, t in times.items():
        tokens = NEW_TOKENS * (32 if what == "32 streams" else 1)
        unit = (lambda ms: round(ms, 1)) if what == "first token" else (lambda ms, n=tokens: round(n * 1000 / ms, 1))
        ratio = paired_ratio(t, "after", "before")
        rows.append([what, "ms p50" if what == "first token" else "tokens/s",
                     unit(t["before"]["median_ms"]), unit(t["after"]["median_ms"]),
                     round(ratio if what == "first token" else 1 / ratio, 3), t["after"]["n"]])
    rows.append(["peak RSS over the run", "GB", round(peaks["before"], 3), round(peaks["after"], 3),
                 round(peaks["after"] / peaks["before"], 3), None])
    result = {
        "before": {"revision": args.before, "commit": trees["before"][1], "args": trees["before"][2]},
        "after": {"revision": args.after, "commit": trees["after"][1], "args": trees["after"][2]},
        "artifacts": args.artifacts, "times": times, "peak_rss_gb": peaks,
        "meta": {"date": time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime()),
                 "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
                 "load": f"load {load0[0]:.2f} -> {os.getloadavg()[0]:.2f}",
                 "command": "python -m bench trees " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))},
        "tables": {"trees": {
            "columns": ["measurement", "unit", f"before ({' '.join(trees['before'][1:]).strip()})",
                        f"after ({' '.join(trees['after'][1:]).strip()})", "after / before (paired)",
                        "timed requests each"],
            "rows": rows}},
    }
    print(write(Path(args.out), args.name, result))
    return 0

