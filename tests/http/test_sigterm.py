"""`python -m service --http-port 0` as its own process: SIGTERM turns HTTP readiness off while a stream in flight
runs to its end, then the worker exits 0."""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from tests.http.conftest import Http

ROOT = Path(__file__).resolve().parents[2]
TOKENS = 1000


def test_sigterm_drains_an_http_stream(one_model_dir):
    env = {k: v for k, v in os.environ.items() if not k.startswith("POSENC_")}
    proc = subprocess.Popen([sys.executable, "-m", "service", "--model-dir", str(one_model_dir), "--port", "0",
                             "--http-port", "0", "--metrics-port", "-1", "--max-new-tokens", str(TOKENS),
                             "--threads", "1", "--grace-seconds", "60"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    log, port = [], threading.Event()

    def read_log():
        for line in proc.stderr:
            log.append(line)
            if "HTTP on http://" in line:
                port.value = int(line.rsplit(":", 1)[1])
                port.set()

    threading.Thread(target=read_log, daemon=True).start()
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
