"""GET /openapi.json on a real worker: a valid OpenAPI 3.1 document (openapi-spec-validator) that names every
route the app serves, and whose schemas the worker's real answers and errors satisfy (jsonschema)."""

import json

import numpy as np
import pytest
from jsonschema import Draft202012Validator
from openapi_spec_validator import validate

from docs.tools import reference
from service.http.app import build_app


@pytest.fixture(scope="module")
def doc(web):
    status, body = web.json("GET", "/openapi.json")
    assert status == 200
    return body


def schema_check(doc, path, method, instance, status="200"):
    """The instance against the schema the document gives for this route's answer (or its errors: default)."""
    ref = doc["paths"][path][method]["responses"][status]["content"]["application/json"]["schema"]
    Draft202012Validator({**ref, "components": doc["components"]}).validate(instance)


def test_the_document_is_valid_openapi(doc):
    validate(doc)
    assert doc["openapi"].startswith("3.1")


def test_every_route_the_app_serves_is_in_the_document(doc, server):
    app = build_app(server.http.front, 4)
    served = {(r.path, m.lower()) for r in app.routes for m in r.methods if m != "HEAD"}
    documented = {(p, m) for p, ops in doc["paths"].items() for m in ops}
    assert served == documented, (served - documented, documented - served)


def test_request_bodies_have_their_models(doc):
    posts = {p: ops["post"] for p, ops in doc["paths"].items() if "post" in ops and "chat" not in p}
    assert posts and all("requestBody" in op for op in posts.values()), [p for p, op in posts.items()
                                                                         if "requestBody" not in op]
    infer = doc["paths"]["/v2/models/{name}/infer"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert doc["components"]["schemas"][infer["$ref"].rsplit("/", 1)[1]]["required"] == ["inputs"]


def test_real_answers_satisfy_their_schemas(doc, web):
    for path, route in (("/v2", "/v2"), ("/v2/models/rope", "/v2/models/{name}"),
                        ("/v2/health/ready", "/v2/health/ready"), ("/v1/posenc/models", "/v1/posenc/models"),
                        ("/v1/models", "/v1/models"), ("/v1/models/rope", "/v1/models/{name}")):
        status, body = web.json("GET", path)
        assert status == 200, body
        schema_check(doc, route, "get", body)
    ids = np.array([[5, 6, 7]])
    status, body = web.json("POST", "/v2/models/rope/infer", {
        "id": "a", "inputs": [{"name": "input_ids", "shape": [1, 3], "datatype": "INT64", "data": ids.tolist()}]})
    assert status == 200
    schema_check(doc, "/v2/models/{name}/infer", "post", body)
    status, body = web.json("POST", "/v1/posenc/predict", {"model": "rope", "prompt": {"text": "ab"}, "top_k": 3,
                                                           "attention": "ATTENTION_LAST_ROW"})
    assert status == 200, body
    schema_check(doc, "/v1/posenc/predict", "post", body)
    status, body = web.json("POST", "/v1/completions", {"model": "rope", "prompt": "ab", "max_tokens": 2,
                                                        "logprobs": 2})
    assert status == 200, body
    schema_check(doc, "/v1/completions", "post", body)


@pytest.mark.parametrize("path, body, field", [
    ("/v1/posenc/predict", {"model": "rope", "prompt": {"text": "a"}, "top_k": "five"}, "top_k"),
    ("/v1/posenc/predict", {"model": "rope", "prompt": {"text": "a"}, "colour": 1}, "colour"),
    ("/v1/posenc/score", {"model": "rope", "prompt": {"tokens": {"ids": [1, "x"]}}}, "prompt.tokens.ids[1]"),
    ("/v2/models/rope/infer", {"inputs": [{"name": "input_ids", "shape": [1, -1], "datatype": "INT64"}]},
     "inputs[0].shape[1]"),
    ("/v2/models/rope/infer", {"inputs": [{"name": 7, "shape": [1], "datatype": "INT64", "data": [1]}]},
     "inputs[0].name"),
])
def test_a_bad_field_is_400_naming_it_in_the_documented_error_shape(doc, web, path, body, field):
    status, answer = web.json("POST", path, body)
    assert status == 400 and f"field {field!r}" in answer["error"], answer
    route = "/v2/models/{name}/infer" if path.startswith("/v2/") else path
    schema_check(doc, route, "post", answer, "default")


def test_openai_errors_have_the_documented_shape(doc, web):
    status, answer = web.json("POST", "/v1/completions", {"model": "rope", "prompt": "a", "max_tokens": "many"})
    assert status == 400 and answer["error"]["param"] == "max_tokens", answer
    schema_check(doc, "/v1/completions", "post", answer, "default")


def test_the_site_ships_the_document_the_worker_serves(doc):
    """The site's api/openapi.json and api/http.md (docs/tools/reference.py) are made from this very document."""
    assert json.loads(reference.pages()["api/openapi.json"]) == doc
