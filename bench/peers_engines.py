"""The engines bench/peers.py compares, each behind one call: run(prompts, new_tokens) generates greedily for every
prompt at once (one prompt = one stream) and answers {"tokens" or "texts", "first_ms": [per stream],
"wall_ms": whole call}.  HTTP servers are driven by one load generator (a thread per stream, OpenAI
/v1/completions with server-sent events, the prompt as token ids); in-process peers run in their own virtualenv
(bench/peers_side.py); posenc in process is the artifact's onnxruntime session in a greedy loop.

peak_rss_gb() is the largest resident set of the serving process and its children seen since the engine started
(sampled every 50 ms while it works, and VmHWM of each process)."""

from __future__ import annotations

import http.client
import json
import os
import subprocess
import threading
import time
from pathlib import Path

import numpy as np

from bench.lib.worker import Worker, http_ok, stop, wait_ready

ROOT = Path(__file__).resolve().parent.parent


def tree_rss_gb(pid: int) -> tuple[float, float]:
    """(current RSS, sum of each process's VmHWM) of pid and its descendants, in GB."""
    pids, seen = [pid], []
    while pids:
        p = pids.pop()
        seen.append(p)
        try:
            for tid in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{tid}/children") as f:
                    pids += [int(c) for c in f.read().split()]
        except OSError:
            continue
    now = hwm = 0
    for p in seen:
        try:
            with open(f"/proc/{p}/status") as f:
                status = dict(line.split(":", 1) for line in f if ":" in line)
            now += int(status["VmRSS"].split()[0])
            hwm += int(status["VmHWM"].split()[0])
        except (OSError, KeyError):
            continue
    return now / 1e6, hwm / 1e6


class Engine:
    name = ""
    proc: subprocess.Popen | None = None
    version = ""

    def __init__(self):
        self.peak = 0.0
        self._sampling = False

    def sample_rss(self) -> None:
        if self.proc is not None:
            now, hwm = tree_rss_gb(self.proc.pid)
            self.peak = max(self.peak, now, hwm)

    def measured(self, prompts: list[list[int]], new_tokens: int) -> dict:
        """run() while a thread samples the serving process's memory."""
        stop = threading.Event()

        def sampler():
            while not stop.wait(0.05):
                self.sample_rss()

        t = threading.Thread(target=sampler, daemon=True)
        t.start()
        try:
            return self.run(prompts, new_tokens)
        finally:
            stop.set()
            t.join()
            self.sample_rss()

    def run(self, prompts: list[list[int]], new_tokens: int) -> dict:
        raise NotImplementedError

    def close(self) -> None:
        stop(self.proc)


class HttpEngine(Engine):
    """An OpenAI-compatible completions server in its own process."""

    def __init__(self, name: str, cmd: list[str], port: int, model: str, extra: dict | None = None,
                 env: dict | None = None, ready_path: str = "/v1/models", start_timeout: float = 600.0,
                 log: Path | None = None):
        super().__init__()
        self.name, self.port, self.model, self.extra = name, port, model, extra or {}
        self.log = log
        out = open(log, "w") if log else subprocess.DEVNULL  # noqa: SIM115 — lives as long as the server
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                     env={**os.environ, **(env or {})})
        wait_ready(self.proc, http_ok(port, ready_path), start_timeout, name, log, every=0.5)

    @classmethod
    def posenc(cls, name: str, models: Path, model: str, *args: str, log: Path, extra: dict | None = None
               ) -> HttpEngine:
        """The posenc worker over HTTP, started by the one launcher (bench.lib.worker)."""
        eng = cls.__new__(cls)
        Engine.__init__(eng)
        worker = Worker(models, *args, http=True, log=log)
        eng.name, eng.port, eng.model, eng.extra, eng.log = name, worker.http_port, model, extra or {}, log
        eng.proc = worker.proc
        return eng

    def tail(self, lines: int = 3) -> str:
        if not self.log or not self.log.is_file():
            return "(no log)"
        text = [t for t in self.log.read_text(errors="replace").splitlines() if t.strip()]
        return " | ".join(text[-lines:])[-600:]

    def one(self, prompt: list[int], new_tokens: int, start: float) -> tuple[str, float | None, int]:
        body = {"model": self.model, "prompt": prompt, "max_tokens": new_tokens, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}, **self.extra}
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=600)
        c.request("POST", "/v1/completions", body=json.dumps(body), headers={"content-type": "application/json"})
        r = c.getresponse()
        if r.status != 200:
            raise RuntimeError(f"{self.name}: HTTP {r.status}: {r.read()[:300]!r}")
        text, first, used = [], None, None
        for raw in r:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            chunk = json.loads(data)
            if chunk.get("usage"):
                used = chunk["usage"].get("completion_tokens")
            for ch in chunk.get("choices") or []:
                if ch.get("text"):
                    if first is None:
                        first = (time.perf_counter() - start) * 1000
                    text.append(ch["text"])
        c.close()
        return "".join(text), first, used if used is not None else new_tokens

    def run(self, prompts: list[list[int]], new_tokens: int) -> dict:
        results: list = [None] * len(prompts)
        start = time.perf_counter()

        def go(i):
            try:
                results[i] = self.one(prompts[i], new_tokens, start)
            except Exception as exc:  # noqa: BLE001 — recorded
                results[i] = exc

        threads = [threading.Thread(target=go, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = (time.perf_counter() - start) * 1000
        errors = [r for r in results if isinstance(r, Exception)]
        if errors:
            raise RuntimeError(str(errors[0]))
        return {"texts": [r[0] for r in results], "first_ms": [r[1] for r in results],
                "counts": [r[2] for r in results], "wall_ms": wall}


class SideEngine(Engine):
    """bench/peers_side.py in a peer's virtualenv."""

    def __init__(self, name: str, python: str, engine: str, model: Path, threads: int, log: Path,
                 batch_tokens: int = 0):
        super().__init__()
        self.name = name
        self.log = open(log, "w")  # noqa: SIM115 — lives as long as the side
        self.proc = subprocess.Popen([python, "-P", str(ROOT / "bench" / "peers_side.py"), "--engine", engine,
                                      "--model", str(model), "--threads", str(threads),
                                      *(["--batch-tokens", str(batch_tokens)] if batch_tokens else [])], cwd=ROOT,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True)
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait()
            text = [t for t in log.read_text(errors="replace").splitlines() if t.strip()]
            raise RuntimeError(f"{name} failed to load: {' | '.join(text[-3:])[-600:]}")
        self.version = json.loads(line).get("version", "")

    def run(self, prompts: list[list[int]], new_tokens: int) -> dict:
        self.proc.stdin.write(json.dumps({"prompts": prompts, "new_tokens": new_tokens}) + "\n")
        self.proc.stdin.flush()
        ans = json.loads(self.proc.stdout.readline())
        if "error" in ans:
            raise RuntimeError(ans["error"])
        return ans

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write("quit\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
        self.log.close()


class PosencInProcess(Engine):
    """The artifact's graph in onnxruntime in this process, with the worker's own session settings: prefill, then one
    call per token feeding the present cache back, logits and cache only.  Streams are rows of one batch."""

    def __init__(self, artifact: Path, threads: int):
        super().__init__()
        from service.artifacts import load_artifact

        self.name = "posenc in process"
        self.art = load_artifact(artifact, threads=threads)
        self.sess = self.art.session
        self.meta = json.loads((artifact / "model.json").read_text())

    def run(self, prompts: list[list[int]], new_tokens: int) -> dict:
        states = self.meta["state"]
        names = ["logits"] + [st["output"] for st in states]
        ids = np.asarray(prompts, np.int64)
        B, T = ids.shape
        feeds = {"input_ids": ids, "attention_mask": np.ones((B, T), np.int64)}
        for spec in self.sess.get_inputs()[2:]:
            feeds[spec.name] = np.zeros((B, spec.shape[1], 0, spec.shape[3]), np.float32)
        start = time.perf_counter()
        first, out = None, np.zeros((B, new_tokens), np.int64)
        for step in range(new_tokens):
            res = self.sess.run(names, feeds)
            nxt = res[0][:, -1].argmax(-1)
            out[:, step] = nxt
            if first is None:
                first = (time.perf_counter() - start) * 1000
            feeds = {"input_ids": nxt[:, None].astype(np.int64),
                     "attention_mask": np.ones((B, feeds["attention_mask"].shape[1] + 1), np.int64),
                     **{st["input"]: r for st, r in zip(states, res[1:], strict=True)}}
        wall = (time.perf_counter() - start) * 1000
        return {"tokens": out.tolist(), "first_ms": [first] * B, "wall_ms": wall}

    def sample_rss(self) -> None:  # shares this process with torch and the rest of the bench: not reported
        pass

    def close(self) -> None:  # the session's memory goes back before the next engine's turn
        self.sess = self.art = None
