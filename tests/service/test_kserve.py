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
    assert shapes == {"input_ids": ["-1", "-1"], "attention_mask": ["-1", "-1"], "position_ids": ["-1", "-1"],
                      "logits": ["-1", "-1", "256"],
                      "attentions": ["-1", "2", "4", "-1", "-1"],
                      "profile": ["-1", "2", "4", "23"]}
    assert r["metadata"]["platform"] == "onnxruntime_onnx"
    cfg = r["config"]["config"]
    assert cfg["name"] == "alibi" and cfg["backend"] == "onnxruntime"
    assert {i["name"] for i in cfg["input"]} == {"input_ids", "attention_mask", "position_ids"}


def test_tritonclient_infer_matches_onnxruntime(tritonclient_run, tiny_artifacts):
    root, _ = tiny_artifacts
    sess = ort.InferenceSession(str(root / "alibi" / "model.onnx"), providers=["CPUExecutionProvider"])
    ids = np.array([[0, 0, 100, 101, 102], [10, 11, 12, 13, 14]], np.int64)
    mask = np.array([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]], np.int64)
    feeds = {"input_ids": ids, "attention_mask": mask}
    feeds.update({i.name: np.zeros((2, 4, 0, 8), np.float32) for i in sess.get_inputs()[2:]})
    logits = sess.run(["logits"], feeds)[0]
    got = np.array(tritonclient_run["logits"])
    real = mask.astype(bool)  # each row answered alone through the engine; padded positions are zeros
    assert np.allclose(got[real], logits[real], atol=1e-5) and not got[~real].any()
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


def infer_arrays(stub, ids, mask=None, timeout=30):
    """ModelInfer with input_ids (and a mask) as raw INT64; returns (logits, attentions) as arrays."""
    req = raw_request(ids, model="t5")
    if mask is not None:
        req.inputs.append(kv.ModelInferRequest.InferInputTensor(name="attention_mask", datatype="INT64",
                                                                shape=list(mask.shape)))
        req.raw_input_contents.append(mask.astype("<i8").tobytes())
    resp = stub.ModelInfer(req, timeout=timeout)
    out = {o.name: np.frombuffer(raw, "<f4").reshape(o.shape)
           for o, raw in zip(resp.outputs, resp.raw_output_contents, strict=True)}
    return out["logits"], out["attentions"]


def test_model_infer_rows_are_batched_by_the_engine_and_equal_their_solo_answers(tiny_artifacts):
    """Rows of different lengths (left and middle padding) from concurrent calls share onnxruntime calls, and every
    real position equals that row sent alone."""
    import threading
    import time

    from service.registry import Limits
    from tests.serving import hook, start

    root, _ = tiny_artifacts
    srv = start(root, max_batch=8, max_wait_ms=20.0, limits=Limits())
    try:
        engine = srv.registry.engine("t5")
        with grpc.insecure_channel(f"127.0.0.1:{srv.port}") as ch:
            stub = grpc_service_pb2_grpc.GRPCInferenceServiceStub(ch)
            rows = [[5, 6, 7, 8, 9, 10], [40, 41], [70, 71, 72, 73]]
            solo = [infer_arrays(stub, np.array([r])) for r in rows]
            ids = np.zeros((3, 6), np.int64)
            mask = np.zeros((3, 6), np.int64)
            ids[0], mask[0] = rows[0], 1
            ids[1, 4:], mask[1, 4:] = rows[1], 1  # left padding
            ids[2, [0, 1, 3, 5]], mask[2, [0, 1, 3, 5]] = rows[2], 1  # padding in the middle
            sizes = []
            hook(engine, lambda work: (sizes.append(len(work)), time.sleep(0.05)))
            got = [None, None]
            threads = [threading.Thread(target=lambda i=i: got.__setitem__(i, infer_arrays(stub, ids, mask)))
                       for i in range(2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=60)
            assert sum(sizes) == 6 and max(sizes) > 1  # six rows, and some shared one onnxruntime call
            for logits, att in got:
                for b, real in enumerate(mask.astype(bool)):
                    solo_logits, solo_att = solo[b]
                    assert np.allclose(logits[b][real], solo_logits[0], atol=1e-5)
                    assert np.allclose(att[b][:, :, real][..., real], solo_att[0], atol=1e-6)
                    assert not logits[b][~real].any() and not att[b][:, :, ~real].any()
    finally:
        srv.stop(grace=1)


def test_model_infer_has_the_queue_limit_and_the_deadline(tiny_artifacts):
    from concurrent.futures import ThreadPoolExecutor

    from service.registry import Limits
    from tests.serving import slow_runs, start

    root, _ = tiny_artifacts
    srv = start(root, max_batch=1, max_wait_ms=0.0, max_queue=1, limits=Limits())
    try:
        slow_runs(srv.registry.engine("t5"), 0.3)
        with grpc.insecure_channel(f"127.0.0.1:{srv.port}") as ch:
            stub = grpc_service_pb2_grpc.GRPCInferenceServiceStub(ch)
            with ThreadPoolExecutor(8) as pool:
                calls = [pool.submit(infer_arrays, stub, np.array([[1, 2, 3]])) for _ in range(8)]
                codes = []
                for c in calls:
                    try:
                        c.result()
                        codes.append("OK")
                    except grpc.RpcError as err:
                        codes.append(err.code().name)
            assert "RESOURCE_EXHAUSTED" in codes and "OK" in codes
            with pytest.raises(grpc.RpcError) as err:
                infer_arrays(stub, np.array([[1, 2, 3]]), timeout=0.1)
            assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    finally:
        srv.stop(grace=1)
