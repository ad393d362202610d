"""KServe v2 REST on the HTTP port: tritonclient.http (its own process) and raw JSON/binary bodies, each equal to
gRPC ModelInfer on the same worker."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from protos.inference import grpc_service_pb2 as kv
from protos.inference import grpc_service_pb2_grpc

ROOT = Path(__file__).resolve().parents[2]


def grpc_infer(channel, model, ids, mask=None, outputs=()):
    """gRPC ModelInfer of the same tensors: {output name: array}."""
    req = kv.ModelInferRequest(model_name=model, outputs=[kv.ModelInferRequest.InferRequestedOutputTensor(name=o)
                                                          for o in outputs])
    for name, value in (("input_ids", ids), ("attention_mask", mask)):
        if value is not None:
            req.inputs.append(kv.ModelInferRequest.InferInputTensor(name=name, datatype="INT64", shape=value.shape))
            req.raw_input_contents.append(value.astype("<i8").tobytes())
    resp = grpc_service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer(req, timeout=30)
    return {o.name: np.frombuffer(raw, "<f4").reshape(o.shape)
            for o, raw in zip(resp.outputs, resp.raw_output_contents, strict=True)}


@pytest.fixture(scope="module")
def triton_http(server, tmp_path_factory):
    out = tmp_path_factory.mktemp("tritonclient") / "arrays.npz"
    res = subprocess.run([sys.executable, str(ROOT / "tests" / "http" / "tritonclient_http.py"),
                          f"127.0.0.1:{server.http_port}", "alibi", str(out)],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout.strip().splitlines()[-1]), dict(np.load(out))


def test_tritonclient_http_ready_and_metadata(triton_http):
    r, _ = triton_http
    assert r["live"] and r["ready"] and r["model_ready"] and not r["unknown_ready"]
    assert {"binary_tensor_data", "model_configuration"} <= set(r["server"]["extensions"])
    shapes = {t["name"]: t["shape"] for t in r["metadata"]["inputs"] + r["metadata"]["outputs"]}
    assert shapes == {"input_ids": [-1, -1], "attention_mask": [-1, -1], "position_ids": [-1, -1],
                      "logits": [-1, -1, 256], "attentions": [-1, 2, 4, -1, -1], "profile": [-1, 2, 4, 23]}
    assert r["config"]["name"] == "alibi" and r["config"]["backend"] == "onnxruntime"


def test_tritonclient_http_infer_equals_grpc_model_infer(triton_http, channel):
    r, arrays = triton_http
    want = grpc_infer(channel, "alibi", arrays["ids"], arrays["mask"])
    assert arrays["logits"].shape == (2, 5, 256) and arrays["attentions"].shape == (2, 2, 4, 5, 5)
    np.testing.assert_allclose(arrays["logits"], want["logits"], atol=1e-6)
    np.testing.assert_allclose(arrays["attentions"], want["attentions"], atol=1e-6)
    assert not arrays["logits"][1, :2].any()  # left padding is zero, as over gRPC
    unmasked = grpc_infer(channel, "alibi", arrays["ids"], outputs=["logits"])
    np.testing.assert_allclose(arrays["json_logits"], unmasked["logits"], atol=1e-6)  # JSON in, JSON out
    assert r["json_attentions_is_none"]
    assert r["unknown_error"][0] == "404"
    assert "no-such-model" in r["unknown_error"][1]
    assert "must be INT64" in r["bad_error"][1]


def test_json_infer_with_nested_data_equals_grpc(web, channel):
    ids = np.array([[3, 44, 55, 6]], np.int64)
    status, doc = web.json("POST", "/v2/models/rope/infer", {
        "id": "req-7", "inputs": [{"name": "input_ids", "shape": [1, 4], "datatype": "INT64", "data": ids.tolist()}]})
    assert status == 200 and doc["id"] == "req-7" and doc["model_name"] == "rope"
    want = grpc_infer(channel, "rope", ids)
    got = {o["name"]: np.asarray(o["data"], np.float32).reshape(o["shape"]) for o in doc["outputs"]}
    assert [o["datatype"] for o in doc["outputs"]] == ["FP32", "FP32"]
    for name in ("logits", "attentions"):
        np.testing.assert_array_equal(got[name], want[name])


def test_binary_request_and_response_by_hand(web, channel):
    ids = np.array([[9, 8, 7]], np.int64)
    head = json.dumps({"inputs": [{"name": "input_ids", "shape": [1, 3], "datatype": "INT64",
                                   "parameters": {"binary_data_size": 24}}],
                       "outputs": [{"name": "attentions", "parameters": {"binary_data": True}},
                                   {"name": "logits"}]}).encode()
    status, headers, body = web.call("POST", "/v2/models/learned/infer", head + ids.astype("<i8").tobytes(),
                                     {"inference-header-content-length": str(len(head)),
                                      "content-type": "application/octet-stream"})
    assert status == 200, body
    split = int(headers["inference-header-content-length"])
    doc = json.loads(body[:split])
    att, logits = doc["outputs"]
    assert att["name"] == "attentions" and att["parameters"]["binary_data_size"] == len(body) - split
    want = grpc_infer(channel, "learned", ids, outputs=["attentions", "logits"])
    np.testing.assert_array_equal(np.frombuffer(body[split:], "<f4").reshape(att["shape"]), want["attentions"])
    np.testing.assert_array_equal(np.asarray(logits["data"], np.float32).reshape(logits["shape"]), want["logits"])


def test_health_and_metadata_routes(web, server):
    assert web.call("GET", "/v2/health/live")[0] == 200
    assert web.json("GET", "/v2/health/ready") == (200, {"ready": True})
    assert web.call("GET", "/v2/models/rope/ready")[0] == 200
    assert web.call("GET", "/v2/models/rope/versions/1/ready")[0] == 200
    status, doc = web.json("GET", "/v2/models/rope/versions/2")
    assert status == 404 and "version" in doc["error"]
    status, doc = web.json("GET", "/v2/models/no-such-model")
    assert status == 404 and "no-such-model" in doc["error"] and "rope" in doc["error"]


@pytest.mark.parametrize("body, status, words", [
    (b"{not json", 400, "not valid JSON"),
    ({"inputs": []}, 400, "inputs"),
    ({"inputs": [{"name": "input_ids", "shape": [1, 2], "datatype": "INT64", "data": [1]}]}, 400, "inputs[0].data"),
    ({"inputs": [{"name": "input_ids", "shape": [1, 2], "datatype": "INT64", "data": [1.5, 2]}]}, 400, "integers"),
    ({"inputs": [{"name": "input_ids", "shape": [1, 2], "datatype": "STRING", "data": [1, 2]}]}, 400, "datatype"),
    ({"inputs": [{"name": "input_ids", "shape": [1, 2], "datatype": "INT64", "data": [1, 999]}]}, 400, "[0, 256)"),
    ({"inputs": [{"name": "x", "shape": [1, 1], "datatype": "INT64", "data": [1]}]}, 400, "input_ids"),
    ({"inputs": [{"name": "input_ids", "shape": [1, 1], "datatype": "INT64", "data": [1]}],
      "outputs": [{"name": "hidden"}]}, 400, "unknown output 'hidden'"),
    ({"inputs": [{"name": "input_ids", "shape": [1, 1], "datatype": "INT64",
                  "parameters": {"binary_data_size": 8}}]}, 400, "binary_data_size"),
    ({"inputs": [{"name": "input_ids", "shape": [4096, 4096], "datatype": "INT64", "data": []}]}, 413, "limit"),
])
def test_bad_infer_bodies_name_what_is_wrong(web, body, status, words):
    got, doc = web.json("POST", "/v2/models/rope/infer", body)
    assert got == status and words in doc["error"], doc


SAME_REFUSALS = [  # (input_ids, attention_mask, outputs, model): refused alike by both transports
    (np.array([[1, 999]]), None, (), "rope"),  # outside the vocabulary
    (np.array([[1, 2]]), np.array([[0, 0]]), (), "rope"),  # a row with no token
    (np.array([[1, 2]]), np.array([[1, 1, 1]]), (), "rope"),  # mask shape differs
    (np.array([[1, 2]]), np.array([[2, 1]]), (), "rope"),  # mask not 0/1
    (np.zeros((1, 17), np.int64), None, (), "learned"),  # past the model's positions
    (np.array([[1, 2]]), None, ("hidden",), "rope"),  # unknown output
    (np.array([[1, 2]]), None, (), "no-such-model"),
]


@pytest.mark.parametrize("ids, mask, outputs, model", SAME_REFUSALS)
def test_both_transports_refuse_alike(web, channel, ids, mask, outputs, model):
    """gRPC ModelInfer and REST infer decode into one neutral request checked in one place: the same refusal,
    word for word, with the HTTP twin of the gRPC status."""
    import grpc

    with pytest.raises(grpc.RpcError) as err:
        grpc_infer(channel, model, ids, mask, outputs)
    inputs = [{"name": n, "shape": list(v.shape), "datatype": "INT64", "data": v.tolist()}
              for n, v in (("input_ids", ids), ("attention_mask", mask)) if v is not None]
    status, doc = web.json("POST", f"/v2/models/{model}/infer", {"inputs": inputs,
                                                                 "outputs": [{"name": o} for o in outputs]})
    want = {grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.NOT_FOUND: 404}[err.value.code()]
    assert status == want and doc["error"] == err.value.details(), (doc, err.value.details())
