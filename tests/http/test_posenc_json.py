"""posenc.v1 as JSON on the HTTP port: each route's answer is the gRPC answer's JSON form (one schema, two
transports), and bad bodies are 400s that name the field."""

import json

import pytest
from google.protobuf import json_format

from protos.posenc.v1 import posenc_pb2 as pb


def as_message(doc: dict, cls):
    return json_format.ParseDict(doc, cls())


def test_predict_equals_grpc(web, stub):
    req = pb.PredictRequest(model="rope", prompt=pb.Prompt(text="dog bites man"), top_k=4,
                            attention=pb.ATTENTION_FULL, layers=[1], heads=[0, 3])
    status, doc = web.json("POST", "/v1/posenc/predict", json_format.MessageToDict(req))
    assert status == 200
    got, want = as_message(doc, pb.PredictResponse), stub.Predict(req, timeout=30)
    got.ClearField("timing")
    want.ClearField("timing")
    assert got == want  # tokens, candidates (doubles to the last bit), attention bytes
    assert doc["attention"][0]["layer"] == 1 and "timing" in doc  # the proto's field names


def test_snake_case_and_camel_case_bodies_both_parse(web):
    for body in ({"model": "alibi", "prompt": {"tokens": {"ids": [1, 2, 3]}}, "max_new_tokens": 2},
                 {"model": "alibi", "prompt": {"tokens": {"ids": [1, 2, 3]}}, "maxNewTokens": 2}):
        status, _, data = web.call("POST", "/v1/posenc/generate", body)
        assert status == 200 and len(data.decode().splitlines()) == 2


def test_generate_streams_json_lines_or_events_equal_to_grpc(web, stub):
    req = pb.GenerateRequest(model="learned", prompt=pb.Prompt(text="abc"), max_new_tokens=6, temperature=0.7, seed=3)
    want = list(stub.Generate(req, timeout=30))
    status, headers, data = web.call("POST", "/v1/posenc/generate", json_format.MessageToDict(req))
    assert status == 200 and headers["content-type"].startswith("application/x-ndjson")
    assert [as_message(json.loads(line), pb.GenerateResponse) for line in data.decode().splitlines()] == want
    status, headers, data = web.call("POST", "/v1/posenc/generate", json_format.MessageToDict(req),
                                     {"accept": "text/event-stream"})
    events = [e for e in data.decode().split("\n\n") if e]
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    assert [as_message(json.loads(e.removeprefix("data: ")), pb.GenerateResponse) for e in events] == want


@pytest.mark.parametrize("route, req, call", [
    ("score", pb.ScoreRequest(model="sinusoidal", prompt=pb.Prompt(text="a b c")), "Score"),
    ("compare", pb.CompareRequest(prompt=pb.Prompt(text="dog bites man"), models=["rope", "learned"], top_k=3),
     "Compare"),
    ("encoding", pb.EncodingRequest(model="alibi", length=6), "Encoding"),
    ("models", pb.ListModelsRequest(), "ListModels"),
])
def test_other_routes_equal_grpc(web, stub, route, req, call):
    status, doc = web.json("POST", f"/v1/posenc/{route}", json_format.MessageToDict(req))
    assert status == 200
    assert as_message(doc, type(getattr(stub, call)(req, timeout=30))) == getattr(stub, call)(req, timeout=30)
    if route == "models":
        assert web.json("GET", "/v1/posenc/models") == (200, doc)


@pytest.mark.parametrize("route, body, status, words", [
    ("predict", {"model": "rope", "prompt": {"text": "x"}, "top_k": "many"}, 400, "top_k"),
    ("predict", {"model": "rope", "prompt": {"text": "x"}, "bogus": 1}, 400, "bogus"),
    ("predict", {"model": "rope", "prompt": {"text": ""}}, 400, "empty prompt"),
    ("predict", {"model": "nope", "prompt": {"text": "x"}}, 404, "nope"),
    ("predict", [1, 2], 400, "JSON object"),
    ("generate", {"model": "rope", "prompt": {"text": "x"}, "max_new_tokens": 100000}, 400, "max_new_tokens"),
    ("generate", {"model": "nope", "prompt": {"text": "x"}}, 404, "nope"),
    ("encoding", {"model": "rope", "length": 0}, 400, "length"),
])
def test_bad_bodies(web, route, body, status, words):
    got, doc = web.json("POST", f"/v1/posenc/{route}", body)
    assert got == status and words in doc["error"], doc
