"""The docker compose deployment end to end, against a real Docker engine (make compose-test).

Order matters and is the order of a deployment's life: image, up/healthy, calls, crash and restart, scale out,
stop under load, down.  Traffic goes to 127.0.0.1 (published ports) or stays inside the stack's own network.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import subprocess
import sys
import threading
import time

import grpc
import numpy as np
import pytest

from client.channel import instance_of
from protos.posenc.v1 import posenc_pb2 as pb
from protos.posenc.v1 import posenc_pb2_grpc
from tests.compose.conftest import MODELS, ROOT, docker
from tests.serving import start

S = grpc.StatusCode


def stub_for(stack, container=None):
    container = container or stack.containers()[0]
    channel = grpc.insecure_channel(f"127.0.0.1:{stack.port(container)}")
    grpc.channel_ready_future(channel).result(timeout=30)
    return channel, posenc_pb2_grpc.PosencStub(channel)


@pytest.fixture(scope="module")
def remote(stack):
    channel, stub = stub_for(stack)
    yield stub
    channel.close()


@pytest.fixture(scope="module")
def local(stack):
    """The same artifacts served in this process: what the container must answer, to the last digit we check."""
    srv = start(stack.artifacts)
    channel = grpc.insecure_channel(f"127.0.0.1:{srv.port}")
    yield posenc_pb2_grpc.PosencStub(channel)
    channel.close()
    srv.stop(grace=1)


def test_image_runs_as_non_root_without_torch_and_checks_its_health(stack):
    cfg = json.loads(docker("image", "inspect", stack.image))[0]["Config"]
    assert cfg["User"] == "10001:10001"
    assert "service.healthcheck" in " ".join(cfg["Healthcheck"]["Test"])
    assert cfg["Entrypoint"] == ["python", "-m", "service"]
    probe = subprocess.run(["docker", "run", "--rm", "--network", "none", "--entrypoint", "python", stack.image, "-c",
                            "import os, importlib.util as u; print(os.getuid(), u.find_spec('torch') is None, "
                            "u.find_spec('onnxruntime') is not None)"], capture_output=True, text=True, timeout=120)
    assert probe.stdout.split() == ["10001", "True", "True"], probe.stderr
    assert stack.report["image_size_mb"] < 600


def test_up_reaches_healthy_through_grpc_health(stack):
    (container,) = stack.containers()
    state = stack.inspect(container)["State"]
    assert state["Health"]["Status"] == "healthy"
    assert any("SERVING" in probe["Output"] and probe["ExitCode"] == 0 for probe in state["Health"]["Log"])
    mounts = {m["Destination"]: m for m in stack.inspect(container)["Mounts"]}
    assert mounts["/models"]["RW"] is False  # artifacts are mounted read-only
    assert stack.inspect(container)["HostConfig"]["ReadonlyRootfs"] is True


def test_list_models(stack, remote):
    resp, call = remote.ListModels.with_call(pb.ListModelsRequest(), timeout=10)
    assert sorted(m.name for m in resp.models) == sorted(MODELS)
    manifest = json.loads((stack.artifacts / "rope" / "manifest.json").read_text())
    rope = next(m for m in resp.models if m.name == "rope")
    assert rope.sha256 == manifest["files"]["model.onnx"]["sha256"]
    (container,) = stack.containers()
    assert instance_of(call) == stack.inspect(container)["Config"]["Hostname"]


@pytest.mark.parametrize("model", ["rope", "alibi"])
def test_predict_with_attention_equals_the_same_artifact_in_process(remote, local, model):
    req = pb.PredictRequest(model=model, prompt=pb.Prompt(text="dog bites man"), top_k=5,
                            attention=pb.ATTENTION_FULL)
    got, want = remote.Predict(req, timeout=30), local.Predict(req, timeout=30)
    assert [c.token.id for c in got.top] == [c.token.id for c in want.top]
    np.testing.assert_allclose([c.probability for c in got.top], [c.probability for c in want.top], atol=1e-6)
    assert len(got.attention) == len(want.attention) == 2 * 4  # tiny: 2 layers x 4 heads
    for a, b in zip(got.attention, want.attention, strict=True):
        assert (a.layer, a.head, list(a.shape)) == (b.layer, b.head, [13, 13])
        np.testing.assert_allclose(np.frombuffer(a.data, "<f4"), np.frombuffer(b.data, "<f4"), atol=1e-6)


def test_generate_streams_the_same_text(remote, local):
    req = pb.GenerateRequest(model="alibi", prompt=pb.Prompt(text="The "), max_new_tokens=24)
    got = list(remote.Generate(req, timeout=60))
    want = list(local.Generate(req, timeout=60))
    assert len(got) == 24 and got[-1].finish_reason == "length"
    assert [m.token.id for m in got] == [m.token.id for m in want]


def test_tritonclient_infer(stack):
    (container,) = stack.containers()
    out = subprocess.run([sys.executable, str(ROOT / "tests" / "tritonclient_checks.py"), "kserve",
                          f"127.0.0.1:{stack.port(container)}", "rope"],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["live"] and result["ready"] and result["model_ready"] and not result["unknown_ready"]
    assert np.asarray(result["logits"]).shape == (2, 5, 256)
    assert result["attentions_shape"] == [2, 2, 4, 5, 5]
    assert result["async_equal"] and result["subset_attentions_is_none"]
    assert result["unknown_status"] == "StatusCode.NOT_FOUND"
    assert result["bad_status"] == "StatusCode.INVALID_ARGUMENT"


def http_get(stack, path, body=None):
    """(status, JSON) from the first worker's published HTTP port."""
    import http.client

    (container,) = stack.containers()
    conn = http.client.HTTPConnection("127.0.0.1", stack.port(container, "8000/tcp"), timeout=60)
    try:
        conn.request("POST" if body is not None else "GET", path, body=None if body is None else json.dumps(body),
                     headers={"content-type": "application/json"})
        r = conn.getresponse()
        return r.status, json.loads(r.read())
    finally:
        conn.close()


def test_http_port_is_published_and_ready(stack):
    assert http_get(stack, "/v2/health/ready") == (200, {"ready": True})
    status, doc = http_get(stack, "/v2/models/rope")
    assert status == 200 and doc["platform"] == "onnxruntime_onnx"


def test_a_completion_through_the_container_equals_generate(stack, remote):
    status, doc = http_get(stack, "/v1/completions", {"model": "rope", "prompt": "The ", "max_tokens": 12,
                                                      "temperature": 0})
    want = list(remote.Generate(pb.GenerateRequest(model="rope", prompt=pb.Prompt(text="The "), max_new_tokens=12),
                                timeout=60))
    assert status == 200 and doc["object"] == "text_completion"
    assert doc["choices"][0]["text"] == want[-1].text and doc["usage"]["completion_tokens"] == 12


def test_bad_requests_get_documented_codes_and_lose_nothing(remote):
    with pytest.raises(grpc.RpcError) as err:
        remote.Predict(pb.PredictRequest(model="no-such-model", prompt=pb.Prompt(text="x")), timeout=10)
    assert err.value.code() == S.NOT_FOUND and "no-such-model" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        list(remote.Generate(pb.GenerateRequest(model="rope", prompt=pb.Prompt(text="x"), max_new_tokens=10**6),
                             timeout=10))
    assert err.value.code() == S.INVALID_ARGUMENT and "max_new_tokens" in err.value.details()
    assert remote.Predict(pb.PredictRequest(model="rope", prompt=pb.Prompt(text="x")), timeout=10).top


def test_a_crashed_worker_is_restarted_and_answers(stack):
    (container,) = stack.containers()
    before = stack.inspect(container)["RestartCount"]
    top = docker("top", container, "-eo", "pid,args").splitlines()[1:]
    # the worker itself, not a `python -m service.healthcheck` the engine may be running at this moment
    (pid,) = [int(line.split()[0]) for line in top if line.split()[1:4] == ["python", "-m", "service"]]
    t0 = time.monotonic()
    os.kill(pid, signal.SIGKILL)  # what the OOM killer or a segfault would do: no chance to clean up
    deadline = time.monotonic() + 120
    while stack.inspect(container)["RestartCount"] == before:
        assert time.monotonic() < deadline, "the restart policy did not restart the worker"
        time.sleep(0.25)
    stack.wait_healthy()
    stack.report["crash_to_healthy_s"] = round(time.monotonic() - t0, 2)
    channel, stub = stub_for(stack, container)
    with channel:
        assert stub.Predict(pb.PredictRequest(model="t5", prompt=pb.Prompt(text="back")), timeout=30).top


ROUND_ROBIN = """
import json, os, grpc
from protos.posenc.v1 import posenc_pb2 as pb, posenc_pb2_grpc
from client.channel import channel_for, instance_of
channel = channel_for(os.environ["POSENC_TARGET"], os.environ["POSENC_LB"])
grpc.channel_ready_future(channel).result(timeout=30)
stub = posenc_pb2_grpc.PosencStub(channel)
def who():
    _, call = stub.ListModels.with_call(pb.ListModelsRequest(), timeout=10)
    return instance_of(call)
warm = set()
for _ in range(100):  # until both replicas' connections are up (the channel is READY once one is)
    warm.add(who())
    if len(warm) == 2:
        break
print(json.dumps([who() for _ in range(12)]))
"""


def test_scaled_replicas_share_calls_round_robin_over_the_service_name(stack):
    stack.run("up", "-d", "--no-build", "--no-recreate", "--scale", "worker=2")
    stack.wait_healthy(count=2)
    hostnames = {stack.inspect(c)["Config"]["Hostname"] for c in stack.containers()}
    # The client service of docker-compose.yml, on the stack's network: dns:///worker:50051 with round_robin.
    out = stack.run("run", "--rm", "-T", "--no-deps", "--entrypoint", "python", "client", "-c", ROUND_ROBIN)
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(seen) == hostnames and len(hostnames) == 2
    assert abs(seen.count(seen[0]) - 6) <= 1  # alternating, not sticky
    stack.run("up", "-d", "--no-build", "--no-recreate", "--scale", "worker=1")
    stack.wait_healthy(count=1)


def test_stop_drains_in_flight_work_and_down_leaves_nothing(stack):
    (container,) = stack.containers()
    channel, stub = stub_for(stack, container)
    n = 4000
    stream = stub.Generate(pb.GenerateRequest(model="rope", prompt=pb.Prompt(text="a"), max_new_tokens=n),
                           timeout=300)
    first = next(stream)  # the request is in flight
    stopper = threading.Thread(target=lambda: stack.report.update(stop_s=round(_timed(stack.run, "stop"), 2)))
    stopper.start()
    rest = list(stream)  # SIGTERM must let it finish
    stream_end = time.time()
    stopper.join(timeout=120)
    channel.close()
    assert first.token.id >= 0 and len(rest) == n - 1 and rest[-1].finish_reason == "length"
    state = stack.inspect(container)["State"]
    assert state["Status"] == "exited" and state["ExitCode"] == 0
    out = subprocess.run(["docker", "logs", "--timestamps", container], capture_output=True, text=True, timeout=30)
    (line,) = [x for x in (out.stdout + out.stderr).splitlines() if "draining" in x]
    signalled = datetime.datetime.fromisoformat(line.split()[0].replace("Z", "")[:26]).replace(
        tzinfo=datetime.UTC).timestamp()
    assert signalled < stream_end, "SIGTERM arrived after the stream had ended: nothing was in flight"
    stack.report["stream_outlived_sigterm_s"] = round(stream_end - signalled, 2)
    assert stack.down() == {"containers": [], "networks": [], "volumes": []}
    assert stack.leftovers() == {"containers": [], "networks": [], "volumes": []}  # and it stays so


def _timed(fn, *args) -> float:
    t0 = time.monotonic()
    fn(*args)
    return time.monotonic() - t0
