"""ARCHITECTURE.md section 11 is true: the toy API written there, added to the app's APIs and nothing else, is
served over real HTTP on loopback (its handler answers, a bad field is the documented 400) and is in GET
/openapi.json with its request and response models, a document openapi-spec-validator accepts and whose schema the
real answer satisfies (jsonschema); the APIS line there, without the toy, is the one in service/http/app.py.  A
handler also runs alone: a method of its API class, given a front and a request, with no app or server."""

import json
import re
from pathlib import Path

import anyio
import pytest
from jsonschema import Draft202012Validator
from openapi_spec_validator import validate
from starlette.requests import Request

from service.http import app
from service.http.app import APIS, HttpServer
from service.http.front import Front
from service.kserve import KServeServicer
from service.operations import Operations
from service.registry import Limits, Registry
from tests.http.conftest import Http

ROOT = Path(__file__).resolve().parents[2]
SECTION = "## 11. Adding an HTTP route"


def blocks() -> list[str]:
    doc = (ROOT / "ARCHITECTURE.md").read_text()
    section = doc[doc.index(SECTION):]
    section = section[:section.find("\n## ", 1)] if "\n## " in section[1:] else section
    return re.findall(r"```python\n(.*?)```", section, re.S)


@pytest.fixture(scope="module")
def toy():
    namespace = {"__name__": "service.http.toy"}  # where the section says the module goes
    exec(compile(blocks()[0], "ARCHITECTURE.md section 11", "exec"), namespace)
    return namespace["Toy"]


@pytest.fixture(scope="module")
def front():
    """A front over a worker with no model: the toy's route needs none (each server started here drains it)."""
    ops = Operations(Registry({}, Limits()))
    return lambda: Front(ops, KServeServicer(ops, lambda: True), lambda: True)


def serve(front, apis) -> HttpServer:
    return HttpServer(front(), "127.0.0.1", 0, workers=2, apis=apis).start()


def test_the_apis_line_is_the_apps(toy):
    line = blocks()[1].strip()
    assert line.endswith(", Toy)")
    assert line.replace(", Toy)", ")") in (ROOT / "service/http/app.py").read_text()
    assert toy not in APIS


def test_the_toy_route_is_served_and_documented_once_added(toy, front):
    before = serve(front, APIS)
    try:
        status, answer = Http(before.port).json("POST", "/v1/toy/shout", {"text": "hi"})
        assert status == 404, answer  # not served until the API is added
        status, doc = Http(before.port).json("GET", "/openapi.json")
        assert status == 200 and "/v1/toy/shout" not in doc["paths"]
    finally:
        before.stop(grace=1)

    server = serve(front, (*APIS, toy))
    try:
        web = Http(server.port)
        status, answer = web.json("POST", "/v1/toy/shout", {"text": "positions"})
        assert (status, answer) == (200, {"text": "POSITIONS"})
        status, error = web.json("POST", "/v1/toy/shout", {"text": 7})
        assert status == 400 and error["error"].startswith("field 'text'"), error

        status, doc = web.json("GET", "/openapi.json")
        assert status == 200
        validate(doc)
        op = doc["paths"]["/v1/toy/shout"]["post"]
        assert op["summary"] == "the text in capitals"
        body = op["requestBody"]["content"]["application/json"]["schema"]
        assert doc["components"]["schemas"][body["$ref"].rsplit("/", 1)[1]]["properties"]["text"]["type"] == "string"
        for status_key, instance in (("200", answer), ("default", error)):
            schema = op["responses"][status_key]["content"]["application/json"]["schema"]
            Draft202012Validator({**schema, "components": doc["components"]}).validate(instance)
        # the other routes are all still there, as the app's own document lists them
        assert set(doc["paths"]) == {r.path for r in app.own_spec((*APIS, toy))}
    finally:
        server.stop(grace=1)


def test_a_handler_runs_alone_given_a_front(toy, front):
    body = json.dumps({"text": "alone"}).encode()

    async def receive():
        return {"type": "http.request", "body": body, "more_body": False}

    request = Request({"type": "http", "method": "POST", "path": "/v1/toy/shout", "query_string": b"",
                       "headers": [(b"content-length", str(len(body)).encode())]}, receive)
    response = anyio.run(toy(front()).shout, request)
    assert response.status_code == 200 and json.loads(response.body) == {"text": "ALONE"}
