"""API keys and per-key limits on the HTTP port (service.auth) against a real worker: every route refuses a request
without a valid key with 401 and a JSON error (the OpenAI shape on /v1/), health and readiness stay open, fuzzed
Authorization headers (raw bytes included) are refused, the openai SDK (api_key=) and tritonclient.http (headers=)
work with the key, HTTPS too, and a key over its rate gets 429 with Retry-After while another key is served; a
request of several prompts (OpenAI) or rows (KServe REST) counts one per prompt against its key's limits."""

from __future__ import annotations

import hashlib
import http.client
import json
import socket
import ssl
import subprocess
import sys
import threading
from pathlib import Path

import openai
import pytest
from starlette.routing import Route

from service.registry import Limits
from tests.client.test_tls import SAN, issue
from tests.http.conftest import Http
from tests.service.test_auth import gate_runs
from tests.serving import start

ROOT = Path(__file__).resolve().parents[2]
KEY, OTHER = "http-key-51b0c3", "second.key~9"
OPEN = {"/v2/health/live", "/v2/health/ready"}
# the viewer's static files (no data: the page asks for a key): its page at /, its scripts and styles under /viewer/
VIEWER = {"/"} | {f"/viewer/{p.name}" for p in (ROOT / "service/http/viewer").iterdir() if p.suffix in (".js", ".css")}
SAMPLE = {"{model_name}": "rope", "{name}": "viewer.js", "{model_version}": "1"}


def key_file(folder):
    path = folder / "keys"
    path.write_text(f"{KEY}\nsha256:{hashlib.sha256(OTHER.encode()).hexdigest()}\n")
    return path


@pytest.fixture(scope="module")
def keyed(artifact_root, tmp_path_factory):
    srv = start(artifact_root, http_port=0, api_keys_file=key_file(tmp_path_factory.mktemp("keys")))
    yield srv
    srv.stop(grace=1)


def routes(srv) -> list[tuple[str, str]]:
    """(method, path) of every route of the HTTP app, path parameters filled in."""
    app = srv.http.config.app
    while not hasattr(app, "routes"):
        app = app.app  # through the middlewares
    out = []
    for r in app.routes:
        if isinstance(r, Route):
            path = r.path
            for k, v in SAMPLE.items():
                path = path.replace(k, v)
            out += [(m, path) for m in sorted(r.methods or ()) if m != "HEAD"]
    return out


def auth(key: str) -> dict:
    return {"authorization": f"Bearer {key}"}


def test_every_route_needs_a_key_but_health_readiness_and_the_viewers_files(keyed):
    web = Http(keyed.http_port)
    found = routes(keyed)
    assert len(found) >= 10 and {p for _, p in found} >= OPEN | VIEWER | {"/v1/completions"}
    for method, path in found:
        body = {} if method == "POST" else None
        status, headers, data = web.call(method, path, body)
        if path in OPEN | VIEWER:
            assert status == 200, (method, path)
            assert path in OPEN or headers["content-type"].startswith(("text/html", "text/javascript", "text/css"))
            continue
        assert status == 401 and headers["www-authenticate"] == "Bearer", (method, path, status)
        error = json.loads(data)["error"]
        if path.startswith("/v1/") and not path.startswith("/v1/posenc/"):
            assert error["type"] == "authentication_error" and error["code"] == 401
        else:
            assert "API key" in error
        for key in (KEY, OTHER):
            assert web.call(method, path, body, auth(key))[0] != 401, (method, path)
    assert web.call("GET", "/no/such/route")[0] == 401  # the door comes before the routes
    assert web.call("GET", "/no/such/route", headers=auth(KEY))[0] == 404


def raw_request(port: int, header: bytes) -> int:
    """The status of GET /v2/models/rope with `header` sent as raw bytes (non-ASCII included)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(b"GET /v2/models/rope HTTP/1.1\r\nHost: x\r\n" + header + b"Connection: close\r\n\r\n")
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    return int(data.split(b" ", 2)[1])


def test_fuzzed_authorization_headers_are_refused(keyed):
    before = keyed.metrics.registry.get_sample_value("posenc_refusals_total",
                                                     {"transport": "http", "reason": "invalid"}) or 0
    values = [b"", b"Bearer", b"Bearer ", b"Bearer \t ", b"bearer", b"Basic " + KEY.encode(), KEY.encode(),
              b"Bearer " + KEY.encode() + b"\xe9", "Bearer ключ".encode(), b"Bearer \xff\xfe", b"Bearer " + b"a" * 9000,
              b"Bearer " + KEY.upper().encode(), b"Bearer " + KEY.encode() + b" x"]
    for value in values:
        assert raw_request(keyed.http_port, b"Authorization: " + value + b"\r\n") == 401, value[:40]
    assert raw_request(keyed.http_port, b"") == 401  # no header at all
    assert raw_request(keyed.http_port, b"Authorization: Bearer " + KEY.encode() + b"\r\n") == 200
    after = keyed.metrics.registry.get_sample_value("posenc_refusals_total",
                                                    {"transport": "http", "reason": "invalid"})
    assert after - before >= len(values) - 2  # empty values count as missing


def test_the_openai_sdk_sends_its_api_key(keyed):
    base = f"http://127.0.0.1:{keyed.http_port}/v1"
    good = openai.OpenAI(base_url=base, api_key=KEY, max_retries=0, timeout=30)
    done = good.completions.create(model="rope", prompt="dog bites", max_tokens=3, temperature=0)
    assert done.choices[0].text is not None and done.usage.completion_tokens == 3
    bad = openai.OpenAI(base_url=base, api_key="not-a-key", max_retries=0, timeout=30)
    with pytest.raises(openai.AuthenticationError) as err:
        bad.completions.create(model="rope", prompt="dog bites", max_tokens=3)
    assert err.value.status_code == 401 and "not-a-key" not in str(err.value)


def test_tritonclient_http_sends_the_key_in_its_headers(keyed):
    script = """
import json, sys
import tritonclient.http as th
from tritonclient.utils import InferenceServerException
c = th.InferenceServerClient(sys.argv[1])
out = {"ready": c.is_server_ready()}
try:
    c.get_model_metadata("rope")
    out["without"] = "OK"
except InferenceServerException as e:
    out["without"] = e.status()
out["with"] = c.get_model_metadata("rope", headers={"authorization": "Bearer " + sys.argv[2]})["name"]
print(json.dumps(out))
"""
    res = subprocess.run([sys.executable, "-c", script, f"127.0.0.1:{keyed.http_port}", KEY], capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    assert json.loads(res.stdout.strip().splitlines()[-1]) == {"ready": True, "without": "401", "with": "rope"}


def test_keys_over_https(artifact_root, tmp_path):
    issue(tmp_path, "server", san=SAN)
    srv = start(artifact_root, http_port=0, api_keys_file=key_file(tmp_path), tls_cert=tmp_path / "server.pem",
                tls_key=tmp_path / "server.key")
    try:
        ctx = ssl.create_default_context(cafile=str(tmp_path / "server.pem"))
        for headers, want in (({}, 401), (auth(KEY), 200)):
            conn = http.client.HTTPSConnection("127.0.0.1", srv.http_port, context=ctx, timeout=10)
            conn.request("GET", "/v2/models/rope", headers=headers)
            assert conn.getresponse().status == want
            conn.close()
    finally:
        srv.stop(grace=1)


def test_a_key_over_its_rate_gets_429_with_retry_after_and_another_key_is_served(artifact_root, tmp_path):
    srv = start(artifact_root, http_port=0, api_keys_file=key_file(tmp_path), key_requests_per_second=2.0)
    try:
        web = Http(srv.http_port)
        got = [web.call("GET", "/v2/models/rope", headers=auth(KEY)) for _ in range(4)]
        assert [g[0] for g in got[:2]] == [200, 200] and 429 in [g[0] for g in got[2:]]
        refused = next(g for g in got if g[0] == 429)
        assert refused[1]["retry-after"] == "1" and "requests per second" in json.loads(refused[2])["error"]
        assert web.call("GET", "/v2/models/rope", headers=auth(OTHER))[0] == 200
        status, body = web.json("POST", "/v1/completions", {"model": "rope", "prompt": "a", "max_tokens": 1},
                                headers=auth(KEY))
        assert status == 429 and body["error"]["type"] == "rate_limit_error"  # what the openai SDK reads
    finally:
        srv.stop(grace=1)


def test_a_request_of_several_prompts_counts_each_prompt_against_its_keys_limits(artifact_root, tmp_path):
    """Per-key limits count what a request occupies: an OpenAI completion of 2 prompts is 2 streams of its key and 2
    requests of its rate, a KServe REST infer of 2 rows the same; more prompts than the key may hold is a 400
    naming `prompt`.  A key limited to 2 cannot hold every stream of the worker (--max-streams 4) with prompt lists."""
    rate_key, rows_key, held_key = "rate.key-1", "rows.key-2", "held.key-3"
    keys = tmp_path / "keys"
    keys.write_text(f"{rate_key} requests_per_second=2\n{rows_key} requests_per_second=2\n"
                    f"{held_key} max_concurrent=2\n{KEY}\n")
    srv = start(artifact_root, http_port=0, api_keys_file=keys, limits=Limits(max_streams=4))
    base, web = f"http://127.0.0.1:{srv.http_port}/v1", Http(srv.http_port)
    sdk = {k: openai.OpenAI(base_url=base, api_key=k, max_retries=0, timeout=60) for k in (rate_key, held_key, KEY)}
    try:
        # the rate: one completion of 2 prompts spends the burst of 2
        done = sdk[rate_key].completions.create(model="rope", prompt=["dog", "cat"], max_tokens=1)
        assert len(done.choices) == 2
        with pytest.raises(openai.RateLimitError) as err:
            sdk[rate_key].completions.create(model="rope", prompt="dog", max_tokens=1)
        assert int(err.value.response.headers["retry-after"]) >= 1
        # KServe REST: 2 rows are 2 requests
        infer = {"inputs": [{"name": "input_ids", "datatype": "INT64", "shape": [2, 2], "data": [5, 6, 7, 8]}]}
        assert web.call("POST", "/v2/models/rope/infer", infer, auth(rows_key))[0] == 200
        status, headers, _ = web.call("GET", "/v2/models/rope", headers=auth(rows_key))
        assert status == 429 and int(headers["retry-after"]) >= 1
        # more prompts than the key may have in flight: refused whole, naming the field
        with pytest.raises(openai.BadRequestError) as err:
            sdk[held_key].completions.create(model="rope", prompt=["a", "b", "c"], max_tokens=1, stream=True)
        assert err.value.body["param"] == "prompt" and "at most 2" in err.value.body["message"]
        # a streamed completion of 2 prompts holds both of the key's slots until its last token
        entered, release = gate_runs(srv.registry.engine("rope"))
        chunks = []
        worker = threading.Thread(target=lambda: chunks.extend(sdk[held_key].completions.create(
            model="rope", prompt=["dog", "cat"], max_tokens=3, temperature=0, stream=True)))
        worker.start()
        try:
            assert entered.wait(30)  # both prompts are inside the model, the stream in flight
            status, headers, data = web.call("GET", "/v2/models/rope", headers=auth(held_key))
            assert status == 429 and "in flight" in json.loads(data)["error"], (status, data)
            with pytest.raises(openai.RateLimitError):
                sdk[held_key].completions.create(model="rope", prompt=["a", "b"], max_tokens=1, stream=True)
            assert web.call("GET", "/v2/models/rope", headers=auth(KEY))[0] == 200  # another key is served
        finally:
            release.set()
            worker.join(60)
        assert sorted(c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason) == [0, 1]
        assert web.call("GET", "/v2/models/rope", headers=auth(held_key))[0] == 200  # its slots came back
    finally:
        for client in sdk.values():
            client.close()
        srv.stop(grace=1)
