"""KServe v2 on the worker's port: the standard tritonclient (in its own process) and raw stubs for bad input."""

import json
import subprocess
import sys
from pathlib import Path

import grpc
import numpy as np
import onnxruntime as ort
import pytest

from protos.inference import grpc_service_pb2 as kv
from protos.inference import grpc_service_pb2_grpc

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tritonclient_run(server):
    res = subprocess.run([sys.executable, str(ROOT / "tests" / "tritonclient_checks.py"), "kserve",
                          f"127.0.0.1:{server.port}", "alibi"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def test_tritonclient_readiness_and_metadata(tritonclient_run):
    r = tritonclient_run
    assert r["live"] and r["ready"] and r["model_ready"] and not r["unknown_ready"]
    assert "model_configuration" in r["server"]["extensions"]
    shapes = {t["name"]: t["shape"] for t in r["metadata"]["inputs"] + r["metadata"]["outputs"]}
    assert shapes == {"input_ids": ["-1", "-1"], "attention_mask": ["-1", "-1"], "logits": ["-1", "-1", "256"],
                      "attentions": ["-1", "2", "4", "-1", "-1"]}
    assert r["metadata"]["platform"] == "onnxruntime_onnx"
    cfg = r["config"]["config"]
    assert cfg["name"] == "alibi" and cfg["backend"] == "onnxruntime"
    assert {i["name"] for i in cfg["input"]} == {"input_ids", "attention_mask"}


def test_tritonclient_infer_matches_onnxruntime(tritonclient_run, tiny_artifacts):
    root, _ = tiny_artifacts
    sess = ort.InferenceSession(str(root / "alibi" / "model.onnx"), providers=["CPUExecutionProvider"])
    ids = np.array([[0, 0, 100, 101, 102], [10, 11, 12, 13, 14]], np.int64)
    mask = np.array([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]], np.int64)
    feeds = {"input_ids": ids, "attention_mask": mask}
    feeds.update({i.name: np.zeros((2, 4, 0, 8), np.float32) for i in sess.get_inputs()[2:]})
    logits = sess.run(["logits"], feeds)[0]
    assert np.allclose(tritonclient_run["logits"], logits, atol=1e-6)
    assert tritonclient_run["attentions_shape"] == [2, 2, 4, 5, 5]
    # the requested subset: logits only, and without a mask the padded row reads the pads as tokens
    assert tritonclient_run["subset_attentions_is_none"]
    assert np.allclose(np.array(tritonclient_run["subset_logits"])[1], logits[1], atol=1e-6)
    assert tritonclient_run["async_equal"]
    assert tritonclient_run["unknown_status"] == "StatusCode.NOT_FOUND"
    assert tritonclient_run["bad_status"] == "StatusCode.INVALID_ARGUMENT"


def raw_request(ids, dtype="INT64", model="rope", outputs=(), raw=None):
    t = kv.ModelInferRequest.InferInputTensor(name="input_ids", datatype=dtype, shape=list(ids.shape))
    req = kv.ModelInferRequest(model_name=model, inputs=[t],
                               outputs=[kv.ModelInferRequest.InferRequestedOutputTensor(name=o) for o in outputs])
    req.raw_input_contents.append(ids.astype("<i8").tobytes() if raw is None else raw)
    return req


@pytest.mark.parametrize("make, words", [
    (lambda: raw_request(np.array([[1, 2]]), dtype="FP32"), "must be INT64"),
    (lambda: raw_request(np.array([1, 2])), "[batch, seq]"),
    (lambda: raw_request(np.array([[1, 2]]), raw=b"\x00" * 9), "expected 16"),
    (lambda: raw_request(np.array([[1, 2]]), outputs=["probs"]), "unknown output 'probs'"),
    (lambda: raw_request(np.zeros((1, 17), np.int64), model="learned"), "limit of 16"),
])
def test_bad_infer_requests(channel, make, words):
    stub = grpc_service_pb2_grpc.GRPCInferenceServiceStub(channel)
    with pytest.raises(grpc.RpcError) as err:
        stub.ModelInfer(make())
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and words in err.value.details()
    ok = stub.ModelInfer(raw_request(np.array([[1, 2, 3]]), outputs=["logits"]))
    assert [o.name for o in ok.outputs] == ["logits"] and len(ok.raw_output_contents[0]) == 3 * 256 * 4


def test_typed_inputs_are_accepted(channel):
    stub = grpc_service_pb2_grpc.GRPCInferenceServiceStub(channel)
    t = kv.ModelInferRequest.InferInputTensor(name="input_ids", datatype="INT64", shape=[1, 3])
    t.contents.int64_contents.extend([1, 2, 3])
    typed = stub.ModelInfer(kv.ModelInferRequest(model_name="rope", inputs=[t]))
    raw = stub.ModelInfer(raw_request(np.array([[1, 2, 3]])))
    assert typed.raw_output_contents == raw.raw_output_contents
