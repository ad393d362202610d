"""The one worker launcher and the one readiness check: every benchmark that starts a posenc worker (and the viewer's
picture, docs/tools/viewer_picture.py) starts it here, and every server a benchmark starts (the worker, the peers'
OpenAI servers, llama-server) is waited for by `wait_ready`.

A worker is `python -m service` in its own process: gRPC on the port it prints ("posenc serving ... on HOST:PORT"),
metrics off, HTTP on a free loopback port when asked for, logs at WARNING.  It is ready when gRPC health says
SERVING, which the worker reports only after every model has run once; its HTTP /v2/health/ready answers 200 from
the same moment (service/server.py).  `tree` runs another checkout's worker (bench trees: the code of a revision)."""

from __future__ import annotations

import http.client
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    """A loopback port free now (a worker's HTTP front or metrics, a peer's server; the worker prints only gRPC's)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tail(log: Path | None, chars: int = 400) -> str:
    if log is None or not log.is_file():
        return "(no log)"
    return log.read_text(errors="replace")[-chars:]


def wait_ready(proc: subprocess.Popen, ready: Callable[[], bool], timeout: float, what: str,
               log: Path | None = None, every: float = 0.05) -> float:
    """Poll `ready()` until it is true: the seconds it took.  The process exiting first, or `timeout` seconds
    passing, is a RuntimeError naming `what` with the end of its log (the process is killed on a timeout)."""
    start = time.monotonic()
    while not ready():
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with status {proc.returncode} while starting: {tail(log)}")
        if time.monotonic() - start > timeout:
            proc.kill()
            proc.wait()
            raise RuntimeError(f"{what} was not ready after {timeout:.0f} s: {tail(log)}")
        time.sleep(every)
    return time.monotonic() - start


def http_ok(port: int, path: str) -> Callable[[], bool]:
    """A readiness probe: GET path on the loopback port answers 200."""
    def probe() -> bool:
        try:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            c.request("GET", path)
            return c.getresponse().status == 200
        except OSError:
            return False
    return probe


def grpc_serving(port: int) -> Callable[[], bool]:
    """A readiness probe: the worker's gRPC health check says SERVING."""
    def probe() -> bool:
        try:
            with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
                status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5).status
            return status == health_pb2.HealthCheckResponse.SERVING
        except grpc.RpcError:
            return False
    return probe


def stop(proc: subprocess.Popen | None) -> None:
    """End a server process a benchmark started: SIGTERM (a worker drains), then SIGKILL after 30 s."""
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


class Worker:
    """A worker serving `artifacts`, started and ready: `proc`, gRPC `port`, `http_port` (None without HTTP),
    `started_s` (spawn to SERVING).  `args` are more worker flags; a later flag wins over the defaults here."""

    def __init__(self, artifacts: Path | str, *args: str, http: bool = False, port: int = 0,
                 tree: Path = ROOT, log: Path | None = None, timeout: float = 600.0, log_level: str = "WARNING"):
        start = time.perf_counter()
        self.http_port = free_port() if http else None
        cmd = [sys.executable, "-m", "service", "--model-dir", str(artifacts), "--port", str(port),
               "--http-port", str(self.http_port or -1), "--metrics-port", "-1", "--log-level", log_level, *args]
        # POSENC_SPECULATE=0: a benchmark measures plain decoding unless it asks (--speculate wins); its models'
        # random weights make every draft right, so speculation would measure the weights, not the worker.  A
        # variable, not a flag: a revision older than the setting ignores it (bench trees)
        env = {**os.environ, "POSENC_SPECULATE": os.environ.get("POSENC_SPECULATE", "0"),
               **({"PYTHONPATH": str(tree)} if tree != ROOT else {})}
        self.log = log
        err = log.open("w") if log else subprocess.DEVNULL  # noqa: SIM115 - lives as long as the worker
        self.proc = subprocess.Popen(cmd, cwd=tree, env=env, stdout=subprocess.PIPE, stderr=err, text=True)
        line = self.proc.stdout.readline()
        if "posenc serving" not in line:
            self.proc.kill()
            self.proc.wait()
            raise RuntimeError(f"the worker did not start: {line!r} {tail(log)}")
        self.port = int(line.rsplit(":", 1)[1])
        wait_ready(self.proc, grpc_serving(self.port), timeout, "the worker", log, every=0.005)
        self.started_s = time.perf_counter() - start

    def close(self) -> None:
        stop(self.proc)

    def __enter__(self) -> Worker:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
