"""The HTTP front keeps gRPC's contract: statuses from one table (429, 413, 503, 504, 500 with a request id),
per-route metrics, a drain that turns readiness off while a stream finishes, a client that goes away stops its
generation, and TLS on the HTTP port when the worker has TLS."""

import json
import logging
import shutil
import socket
import ssl
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from cryptography.x509.oid import ExtendedKeyUsageOID

from service.registry import Limits
from tests.client.test_tls import SAN, issue
from tests.http.conftest import Http
from tests.serving import slow_runs, start

PREDICT = {"model": "rope", "prompt": {"text": "dog bites man"}}
GENERATE = {"model": "rope", "prompt": {"text": "ab"}, "max_new_tokens": 40}


@pytest.fixture(scope="module")
def one_model(artifact_root, tmp_path_factory):
    root = artifact_root
    models = tmp_path_factory.mktemp("http-models")
    shutil.copytree(root / "rope", models / "rope")
    return models


def test_internal_error_is_500_with_a_request_id_in_the_log(web, server, monkeypatch, caplog):
    def boom(*a, **k):
        raise RuntimeError("simulated fault")

    monkeypatch.setattr(server.ops, "score", boom)
    with caplog.at_level(logging.ERROR, logger="service.http.errors"):
        status, doc = web.json("POST", "/v1/posenc/score", {"model": "rope", "prompt": {"text": "ab"}})
    request_id = doc["error"].split("request id ")[1].split(")")[0]
    assert status == 500 and len(request_id) == 12
    assert any(request_id in r.getMessage() and r.exc_info for r in caplog.records)
    monkeypatch.undo()
    assert web.json("POST", "/v1/posenc/score", {"model": "rope", "prompt": {"text": "ab"}})[0] == 200


def test_metrics_count_requests_per_route_and_status(web, server):
    def count(route, method, status):
        return server.metrics.registry.get_sample_value(
            "posenc_http_requests_total", {"route": route, "method": method, "status": status}) or 0

    before = (count("/v1/posenc/predict", "POST", "200"), count("/v2/models/{name}", "GET", "404"))
    web.call("POST", "/v1/posenc/predict", PREDICT)
    web.call("GET", "/v2/models/nope")
    assert count("/v1/posenc/predict", "POST", "200") == before[0] + 1
    assert count("/v2/models/{name}", "GET", "404") == before[1] + 1


def test_limits_busy_is_429_too_large_is_413_deadline_is_504(one_model):
    srv = start(one_model, http_port=0, max_queue=1, max_batch=1,
                limits=Limits(max_streams=1, max_message_bytes=4096, max_new_tokens=64))
    try:
        web = Http(srv.http_port)
        slow_runs(srv.registry.engine("rope"), 0.05)
        conn = socket.create_connection(("127.0.0.1", srv.http_port))  # one stream open: the server's limit
        body = json.dumps(GENERATE).encode()
        conn.sendall(b"POST /v1/posenc/generate HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                     b"content-length: %d\r\n\r\n" % len(body) + body)
        assert conn.recv(4096).startswith(b"HTTP/1.1 200")
        status, doc = web.json("POST", "/v1/posenc/generate", GENERATE)
        assert status == 429 and "streams" in doc["error"]
        conn.close()
        with ThreadPoolExecutor(8) as pool:  # queue of 1, one run at a time, each slowed: some are refused
            codes = list(pool.map(lambda _: web.call("POST", "/v1/posenc/predict", PREDICT)[0], range(8)))
        assert 429 in codes and 200 in codes and set(codes) <= {200, 429}, codes
        status, doc = web.json("POST", "/v1/posenc/predict", {**PREDICT, "prompt": {"text": "x" * 5000}})
        assert status == 413 and "4096-byte message limit" in doc["error"]
        status, doc = web.json("POST", "/v1/posenc/predict", {**PREDICT, "attention": "ATTENTION_FULL",
                                                               "prompt": {"text": "x" * 60}})
        assert status == 413 and "LAST_ROW" in doc["error"]  # the answer would be too large: ask for less
        slow_runs(srv.registry.engine("rope"), 0.5)
        blocker = threading.Thread(target=web.call, args=("POST", "/v1/posenc/score", PREDICT))
        blocker.start()  # holds the model for 0.5 s: the next request waits in the queue past its deadline
        time.sleep(0.1)
        status, doc = web.json("POST", "/v1/posenc/score", PREDICT, {"x-request-timeout": "0.05"})
        blocker.join(timeout=30)
        assert status == 504 and "deadline" in doc["error"], doc
        assert web.json("POST", "/v1/posenc/score", PREDICT, {"x-request-timeout": "soon"})[0] == 400
    finally:
        srv.stop(grace=1)


def test_a_client_that_goes_away_stops_its_generation(one_model):
    srv = start(one_model, http_port=0, limits=Limits(max_new_tokens=64))
    try:
        slow_runs(srv.registry.engine("rope"), 0.02)
        conn = socket.create_connection(("127.0.0.1", srv.http_port))
        body = json.dumps({**GENERATE, "max_new_tokens": 64}).encode()
        conn.sendall(b"POST /v1/posenc/generate HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                     b"content-length: %d\r\n\r\n" % len(body) + body)
        seen = b""
        while b"token" not in seen:  # the headers, then the first line
            seen += conn.recv(4096)
        assert srv.registry.streams == 1
        conn.close()
        for _ in range(200):  # the slot frees once the step in flight ends (20 ms each), not after 64 steps
            if srv.registry.streams == 0:
                break
            time.sleep(0.01)
        assert srv.registry.streams == 0
    finally:
        srv.stop(grace=1)


def test_stop_turns_readiness_off_while_a_stream_finishes_then_refuses(one_model):
    srv = start(one_model, http_port=0, limits=Limits(max_new_tokens=64))
    web = Http(srv.http_port)
    slow_runs(srv.registry.engine("rope"), 0.03)
    result = {}
    streaming = threading.Thread(target=lambda: result.update(
        stream=web.call("POST", "/v1/posenc/generate", GENERATE)))
    streaming.start()
    while srv.registry.streams == 0:
        time.sleep(0.005)
    stopper = threading.Thread(target=srv.stop, kwargs={"grace": 30})
    stopper.start()
    for _ in range(1000):
        if srv.http.front.draining:
            break
        time.sleep(0.005)
    ready = web.json("GET", "/v2/health/ready")
    refused = web.json("POST", "/v1/posenc/predict", PREDICT)
    streaming.join(timeout=60)
    stopper.join(timeout=60)
    status, _, data = result["stream"]
    lines = [json.loads(x) for x in data.decode().splitlines()]
    assert ready == (503, {"ready": False}) and refused[0] == 503
    assert status == 200 and len(lines) == 40 and lines[-1]["finish_reason"] == "length"
    with pytest.raises(OSError):
        web.call("GET", "/v2/health/live", timeout=5)


def test_tls_on_the_http_port(one_model, tmp_path):
    ca = issue(tmp_path, "ca", ca=True)
    issue(tmp_path, "server", ca, san=SAN, usage=ExtendedKeyUsageOID.SERVER_AUTH)
    srv = start(one_model, http_port=0, tls_cert=tmp_path / "server.pem", tls_key=tmp_path / "server.key")
    try:
        import http.client

        context = ssl.create_default_context(cafile=str(tmp_path / "ca.pem"))
        conn = http.client.HTTPSConnection("127.0.0.1", srv.http_port, context=context, timeout=10)
        conn.request("GET", "/v2/health/ready")
        assert conn.getresponse().status == 200
        conn.close()
        with pytest.raises((OSError, http.client.HTTPException)):
            Http(srv.http_port).call("GET", "/v2/health/ready", timeout=5)  # plain HTTP is not served
    finally:
        srv.stop(grace=1)


def test_connections_have_nagle_off(web, server):
    """Small answers are written as headers then body: with Nagle on, each would wait for the client's delayed
    ACK.  asyncio turns it off only on sockets created with proto IPPROTO_TCP, which the front's listener is."""
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=10)
    conn.request("GET", "/v2/health/live")
    assert conn.getresponse().read()
    ours = conn.sock.getsockname()  # the server side of this connection has it as its peer
    sockets = [s for c in list(server.http.server.server_state.connections)
               if (s := c.transport.get_extra_info("socket")) is not None and s.fileno() >= 0
               and c.transport.get_extra_info("peername") == ours]
    assert len(sockets) == 1 and sockets[0].getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
    conn.close()
