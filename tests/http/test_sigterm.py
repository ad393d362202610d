"""`python -m service --http-port 0` as its own process: SIGTERM turns HTTP readiness off while a stream in flight
runs to its end, then the worker exits 0; streams that outlast the grace period are cut off cleanly (their
generators stopped in their own threads, in-flight counts and metrics settled)."""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from service.registry import Limits
from tests.http.conftest import Http
from tests.serving import start

ROOT = Path(__file__).resolve().parents[2]
TOKENS = 1000


def worker(model_dir, tokens: int, grace: int):
    """A worker process on model_dir (HTTP on a free port), the lines of its log as they come, an event set with
    the HTTP port (port.value) once logged, and the thread reading the log."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("POSENC_")}
    proc = subprocess.Popen([sys.executable, "-m", "service", "--model-dir", str(model_dir), "--port", "0",
                             "--http-port", "0", "--metrics-port", "-1", "--max-new-tokens", str(tokens),
                             "--threads", "1", "--grace-seconds", str(grace)], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    log, port = [], threading.Event()

    def read_log():
        for line in proc.stderr:
            log.append(line)
            if "HTTP on http://" in line:
                port.value = int(line.rsplit(":", 1)[1])
                port.set()

    reader = threading.Thread(target=read_log, daemon=True)
    reader.start()
    return proc, log, port, reader


def test_sigterm_drains_an_http_stream(one_model_dir):
    proc, log, port, _ = worker(one_model_dir, TOKENS, 60)
    try:
        assert proc.stdout.readline().startswith("posenc serving")  # signal handlers are in place
        assert port.wait(30), "".join(log)
        web = Http(port.value)
        conn = socket.create_connection(("127.0.0.1", port.value), timeout=60)
        body = json.dumps({"model": "rope", "prompt": {"text": "a"}, "max_new_tokens": TOKENS}).encode()
        conn.sendall(b"POST /v1/posenc/generate HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                     b"connection: close\r\ncontent-length: %d\r\n\r\n" % len(body) + body)
        data = b""
        while b'"token"' not in data:  # the stream is in flight
            data += conn.recv(65536)
        proc.send_signal(signal.SIGTERM)
        for _ in range(250):  # the handler runs in the worker's main thread, a moment later
            ready = web.json("GET", "/v2/health/ready")
            if ready[0] != 200:
                break
            time.sleep(0.02)
        while chunk := conn.recv(65536):
            data += chunk
        conn.close()
        assert proc.wait(timeout=60) == 0, "".join(log)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert ready == (503, {"ready": False})
    assert data.count(b'"token"') == TOKENS and b'"finish_reason":"length"' in data


LONG = 50000  # tokens: a stream still running when the grace period and uvicorn's own second have passed


def open_stream(port: int, path: str, doc: dict) -> tuple[socket.socket, list[bytes], threading.Thread]:
    """A streamed request read on a thread of its own, without pause (so the worker is always pulling its next
    token in a thread when the stream is cut off), until the worker closes it: (socket, chunks, reader)."""
    conn = socket.create_connection(("127.0.0.1", port), timeout=120)
    body = json.dumps(doc).encode()
    conn.sendall(f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                 f"connection: close\r\ncontent-length: {len(body)}\r\n\r\n".encode() + body)
    chunks: list[bytes] = []

    def read():
        try:
            while chunk := conn.recv(65536):
                chunks.append(chunk)
        except OSError:
            pass

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    return conn, chunks, reader


STREAMS = [("/v1/posenc/generate", {"model": "rope", "prompt": {"text": "a"}, "max_new_tokens": LONG}),
           ("/v1/posenc/generate", {"model": "rope", "prompt": {"text": "b"}, "max_new_tokens": LONG}),
           ("/v1/completions", {"model": "rope", "prompt": ["a", "b"], "max_tokens": LONG, "stream": True})]


def until_tokens(streams) -> None:
    for _ in range(3000):  # every stream has sent tokens (bounded: 60 s)
        if all(b"token" in b"".join(chunks) or b"text" in b"".join(chunks) for _, chunks, _ in streams):
            return
        time.sleep(0.02)
    raise AssertionError("the streams sent no tokens")


def test_sigterm_cuts_off_streams_past_the_grace_period_cleanly(one_model_dir):
    proc, log, port, reader = worker(one_model_dir, LONG, 1)
    streams = []
    try:
        assert proc.stdout.readline().startswith("posenc serving")
        assert port.wait(30), "".join(log)
        streams = [open_stream(port.value, path, doc) for path, doc in STREAMS]
        until_tokens(streams)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=90) == 0, "".join(log)
        reader.join(30)
        for _, _, r in streams:
            r.join(30)  # the worker closed every connection
    finally:
        for conn, _, _ in streams:
            conn.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = "".join(log)
    assert "generator already executing" not in text and "Traceback" not in text, text[-3000:]
    assert "HTTP closed, 0 requests in flight" in text, text[-3000:]
    for _, chunks, _ in streams:  # cut off mid-stream, each told why in its body's last error item
        data = b"".join(chunks)
        assert b'"finish_reason":"length"' not in data and b"server is shutting down" in data[-600:], data[-600:]


def test_streams_cut_off_at_stop_settle_in_flight_counts_and_metrics(one_model_dir, caplog):
    srv = start(one_model_dir, http_port=0, limits=Limits(max_new_tokens=LONG))
    front = srv.http.front
    count = srv.metrics.registry.get_sample_value
    labels = [{"route": path, "method": "POST", "status": "200"} for path, _ in STREAMS]
    before = [count("posenc_http_requests_total", x) or 0 for x in labels]
    streams = [open_stream(srv.http_port, path, doc) for path, doc in STREAMS]
    try:
        until_tokens(streams)
        assert front.inflight == len(STREAMS)
        srv.stop(grace=0.5)
        for _, _, r in streams:
            r.join(30)
    finally:
        for conn, _, _ in streams:
            conn.close()
    assert front.inflight == 0
    after = [count("posenc_http_requests_total", x) or 0 for x in labels]
    assert after[0] - before[0] == 2 and after[2] - before[2] == 1  # each cut-off stream answered, with its 200
    assert all(b"server is shutting down" in b"".join(chunks)[-600:] for _, chunks, _ in streams)
    logged = "\n".join(r.getMessage() + str(r.exc_info or "") for r in caplog.records)
    assert "generator already executing" not in logged
