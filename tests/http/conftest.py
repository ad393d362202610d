"""A real worker with its HTTP front on loopback (port 0 for gRPC and HTTP), over the tiny artifacts."""

from __future__ import annotations

import http.client
import json
import shutil

import openai
import pytest

from service.registry import Limits
from tests.serving import start


class Http:
    """A minimal HTTP/1.1 client on the worker's HTTP port: (status, headers, body) per call."""

    def __init__(self, port: int, host: str = "127.0.0.1"):
        self.host, self.port = host, port
        self.base = f"http://{host}:{port}"

    def call(self, method: str, path: str, body=None, headers: dict | None = None, timeout: float = 60):
        conn = http.client.HTTPConnection(self.host, self.port, timeout=timeout)
        try:
            data = body if isinstance(body, bytes | None) else json.dumps(body).encode()
            hdrs = {"content-type": "application/json"} if data is not None else {}
            conn.request(method, path, body=data, headers=hdrs | (headers or {}))
            r = conn.getresponse()
            return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
        finally:
            conn.close()

    def json(self, method: str, path: str, body=None, headers: dict | None = None, timeout: float = 60):
        status, _, data = self.call(method, path, body, headers, timeout)
        return status, json.loads(data)


@pytest.fixture(scope="session")
def artifact_root(tiny_artifacts):
    return tiny_artifacts[0]


@pytest.fixture(scope="module")
def server(artifact_root):
    root = artifact_root
    srv = start(root, max_batch=8, max_wait_ms=5.0, http_port=0,
                limits=Limits(max_prompt_tokens=200, max_new_tokens=64))
    yield srv
    srv.stop(grace=1)


@pytest.fixture(scope="module")
def one_model_dir(artifact_root, tmp_path_factory):
    """A model folder with rope alone (a worker of its own starts fast)."""
    models = tmp_path_factory.mktemp("one-model")
    shutil.copytree(artifact_root / "rope", models / "rope")
    return models


@pytest.fixture(scope="module")
def web(server):
    return Http(server.http_port)


@pytest.fixture(scope="module")
def sdk(server):
    """The openai SDK's client of the module's worker."""
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.http_port}/v1", api_key="unused", max_retries=0,
                           timeout=60)
    yield client
    client.close()


# channel and stub come from tests/conftest.py: they ask for `server`, which resolves to the HTTP-enabled one above.
