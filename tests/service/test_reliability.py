"""Faults, reloads, shutdown under load and limits, against real servers on loopback."""

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from export import artifact
from protos.inference import grpc_service_pb2 as kv
from protos.inference import grpc_service_pb2_grpc
from protos.posenc.v1 import posenc_pb2 as pb
from protos.posenc.v1 import posenc_pb2_grpc
from service.registry import Limits
from tests.serving import slow_runs, start

ROOT = Path(__file__).resolve().parents[2]
S = grpc.StatusCode


def stub_of(srv):
    channel = grpc.insecure_channel(f"127.0.0.1:{srv.port}")
    return channel, posenc_pb2_grpc.PosencStub(channel)


def copy(root, name, dest, as_name=None):
    shutil.copytree(root / name, dest / (as_name or name))
    return dest / (as_name or name)


def rewrite(folder: Path, edit) -> None:
    """Edit model.json and re-sign the manifest, as a careless or malicious exporter would."""
    meta = json.loads((folder / "model.json").read_text())
    edit(meta)
    (folder / "model.json").write_text(json.dumps(meta))
    artifact.write_manifest(folder, None)


def test_broken_artifacts_are_refused_with_a_reason_and_the_others_serve(tiny_artifacts, tmp_path):
    root, _ = tiny_artifacts
    copy(root, "rope", tmp_path)
    flipped = copy(root, "alibi", tmp_path, "flipped")
    data = bytearray((flipped / "model.onnx").read_bytes())
    data[len(data) // 2] ^= 0x01
    (flipped / "model.onnx").write_bytes(bytes(data))
    truncated = copy(root, "alibi", tmp_path, "truncated")
    (truncated / "model.onnx").write_bytes((truncated / "model.onnx").read_bytes()[:1000])
    no_json = copy(root, "alibi", tmp_path, "no_json")
    (no_json / "model.json").unlink()
    lies = copy(root, "alibi", tmp_path, "lying_shapes")  # says the KV cache has 8 heads; the graph has 4

    def eight_heads(meta):
        for spec in meta["inputs"]:
            if spec["name"].startswith("past_key_values"):
                spec["shape"][1] = 8
    rewrite(lies, eight_heads)
    sizes = copy(root, "alibi", tmp_path, "lying_sizes")  # shapes agree, sizes do not: caught by the warm-up

    def wrong_head_dim(meta):
        meta["sizes"]["head_dim"] = 5
    rewrite(sizes, wrong_head_dim)
    srv = start(tmp_path)
    try:
        assert sorted(srv.registry.models) == ["rope"]
        r = srv.rejected
        assert "sha256" in r["flipped"] and "sha256" in r["truncated"]
        assert r["no_json"] == "missing model.json"
        assert "past_key_values.0.key" in r["lying_shapes"] and "8" in r["lying_shapes"]
        assert r["lying_sizes"].startswith("warm-up failed")
        channel, stub = stub_of(srv)
        with channel:
            assert stub.Predict(pb.PredictRequest(model="rope", prompt=pb.Prompt(text="ok")), timeout=10).top
            assert [m.name for m in stub.ListModels(pb.ListModelsRequest()).models] == ["rope"]
    finally:
        srv.stop(grace=1)


def replace_folder(new: Path, target: Path) -> None:
    """Swap a folder in the way an exporter does: the new one beside it, then renames."""
    old = target.with_name(f".{target.name}.old")
    os.rename(target, old)
    os.rename(new, target)
    shutil.rmtree(old)


def test_reload_adds_replaces_and_removes_without_dropping_in_flight_requests(tiny_artifacts, tmp_path):
    root, _ = tiny_artifacts
    models = tmp_path / "models"
    models.mkdir()
    copy(root, "rope", models)
    srv = start(models, limits=Limits(max_new_tokens=400))
    channel, stub = stub_of(srv)
    try:
        req = pb.GenerateRequest(model="rope", prompt=pb.Prompt(text="a"), max_new_tokens=200)
        want = [m.token.id for m in stub.Generate(req, timeout=120)]
        old = srv.registry.models["rope"]
        old_engine = srv.registry.engine("rope")
        slow_runs(old_engine, 0.005)  # 200 steps take over a second: the stream outlives the swap
        stream = stub.Generate(req, timeout=120)
        first = next(stream)  # in flight on the old rope
        copy(root, "alibi", models)  # added
        copy(root, "t5", tmp_path, "staged")  # rope's folder now holds a different model (a t5)
        replace_folder(tmp_path / "staged", models / "rope")
        report = srv.reload()
        assert report["loaded"] == ["alibi"] and report["replaced"] == ["rope"] and not report["failed"]
        assert srv.registry.models["rope"] is not old and srv.registry.models["rope"].meta.variant == "t5"
        steps_at_swap = old_engine.stats.steps
        got = [first.token.id] + [m.token.id for m in stream]  # finished on the model it started on
        assert got == want
        assert old_engine.stats.steps > steps_at_swap  # the old model made tokens after the new one came in
        variants = {m.name: m.variant for m in stub.ListModels(pb.ListModelsRequest()).models}
        assert variants == {"alibi": "alibi", "rope": "t5"}
        assert srv.reload()["unchanged"] == ["alibi", "rope"]  # nothing changed: nothing reloaded
        shutil.rmtree(models / "alibi")
        assert srv.reload()["removed"] == ["alibi"]
        with pytest.raises(grpc.RpcError) as err:
            stub.Predict(pb.PredictRequest(model="alibi", prompt=pb.Prompt(text="x")), timeout=10)
        assert err.value.code() == S.NOT_FOUND
    finally:
        channel.close()
        srv.stop(grace=1)


def test_a_failed_reload_keeps_the_old_model_serving(tiny_artifacts, tmp_path):
    root, _ = tiny_artifacts
    models = tmp_path / "models"
    models.mkdir()
    copy(root, "rope", models)
    srv = start(models)
    channel, stub = stub_of(srv)
    try:
        before = stub.Predict(pb.PredictRequest(model="rope", prompt=pb.Prompt(text="dog")), timeout=10)
        staged = copy(root, "alibi", tmp_path, "staged")
        data = bytearray((staged / "model.onnx").read_bytes())
        data[-10] ^= 0xFF  # a damaged replacement
        (staged / "model.onnx").write_bytes(bytes(data))
        replace_folder(staged, models / "rope")
        report = srv.reload()
        assert "sha256" in report["failed"]["rope"] and not report["replaced"]
        after = stub.Predict(pb.PredictRequest(model="rope", prompt=pb.Prompt(text="dog")), timeout=10)
        assert [c.token.id for c in after.top] == [c.token.id for c in before.top]
        assert {m.name: m.variant for m in stub.ListModels(pb.ListModelsRequest()).models} == {"rope": "rope"}
    finally:
        channel.close()
        srv.stop(grace=1)


def test_sighup_reloads_the_running_worker(tiny_artifacts, tmp_path):
    root, _ = tiny_artifacts
    models = tmp_path / "models"
    models.mkdir()
    copy(root, "rope", models)
    proc = subprocess.Popen([sys.executable, "-m", "service", "--model-dir", str(models), "--port", "0",
                             "--metrics-port", "-1", "--http-port", "-1", "--threads", "1"], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        line = proc.stdout.readline()
        port = int(line.rsplit(":", 1)[1])
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = posenc_pb2_grpc.PosencStub(channel)
            assert [m.name for m in stub.ListModels(pb.ListModelsRequest(), timeout=10).models] == ["rope"]
            copy(root, "fire", models)
            proc.send_signal(signal.SIGHUP)
            for _ in range(200):
                names = [m.name for m in stub.ListModels(pb.ListModelsRequest(), timeout=10).models]
                if names == ["fire", "rope"]:
                    break
                time.sleep(0.05)
            assert names == ["fire", "rope"]
            assert stub.Predict(pb.PredictRequest(model="fire", prompt=pb.Prompt(text="x")), timeout=10).top
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0


def worker_process(models, log, *flags):
    """A real `python -m service` on a free port; returns (process, port) once it announces itself."""
    proc = subprocess.Popen([sys.executable, "-m", "service", "--model-dir", str(models), "--port", "0",
                             "--metrics-port", "-1", "--http-port", "-1", "--threads", "1", *flags], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=log, text=True)
    line = proc.stdout.readline()
    assert "posenc serving" in line, (line, Path(log.name).read_text())
    return proc, int(line.rsplit(":", 1)[1])


def wait_for_unavailable(stub) -> grpc.StatusCode:
    """Predict until the worker refuses new work (it does once it has handled the signal).

    A probe that reached the server in the instant gRPC began to shut down, before a handler took it, is CANCELLED by
    gRPC core itself (grpc/grpc#41785); that probe tells nothing, so the next one is sent."""
    for _ in range(400):
        try:
            stub.Predict(pb.PredictRequest(model="rope", prompt=pb.Prompt(text="x")), timeout=10)
        except grpc.RpcError as err:
            if err.code() != S.CANCELLED:
                return err.code()
        time.sleep(0.025)
    return S.OK


# Without BDP probing the HTTP/2 windows stay at 64 KiB, so a stream whose client does not read cannot run ahead:
# each message carries the text so far, and 600 tokens are over 180 KB.  The streams below are still generating
# when the signal arrives whatever the machine's speed, and the worker's log line counts them.
NO_RUNAHEAD = [("grpc.http2.bdp_probe", 0)]


def test_sigterm_to_the_worker_process_with_16_streams_in_flight(tiny_artifacts, tmp_path):
    root, _ = tiny_artifacts
    tokens = 600
    with open(tmp_path / "worker.log", "w+") as log:
        proc, port = worker_process(root, log, "--max-new-tokens", str(tokens), "--grace-seconds", "300",
                                    "--workers", "24")  # 16 threads hold the streams; more answer the probe
        try:
            channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=NO_RUNAHEAD)
            stub = posenc_pb2_grpc.PosencStub(channel)
            started, signalled = threading.Barrier(17), threading.Event()

            def generate(i):
                stream = stub.Generate(pb.GenerateRequest(model=["rope", "alibi", "t5", "fire"][i % 4],
                                                          prompt=pb.Prompt(text="ab"), max_new_tokens=tokens),
                                       timeout=300)
                next(stream)
                started.wait(timeout=60)
                signalled.wait(timeout=60)  # read nothing more until the worker has the signal
                rest = list(stream)
                return 1 + len(rest), rest[-1].finish_reason

            with ThreadPoolExecutor(16) as pool:
                streams = [pool.submit(generate, i) for i in range(16)]
                started.wait(timeout=60)  # 16 streams in flight
                proc.send_signal(signal.SIGTERM)
                with grpc.insecure_channel(f"127.0.0.1:{port}") as probe:  # its own connection and windows
                    assert wait_for_unavailable(posenc_pb2_grpc.PosencStub(probe)) == S.UNAVAILABLE
                signalled.set()
                results = [f.result(timeout=300) for f in streams]
            channel.close()
            assert results == [(tokens, "length")] * 16  # none lost, none cut short
            assert proc.wait(timeout=60) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
        log.seek(0)
        text = log.read()
    assert "signal 15: draining and stopping (16 Generate streams open; in-flight work gets up to 300 s)" in text


def test_sigterm_grace_seconds_cuts_off_what_runs_longer(tiny_artifacts, tmp_path):
    root, _ = tiny_artifacts
    models = tmp_path / "models"
    models.mkdir()
    copy(root, "rope", models)
    with open(tmp_path / "worker.log", "w+") as log:
        proc, port = worker_process(models, log, "--max-new-tokens", "100000", "--grace-seconds", "0.5")
        try:
            with grpc.insecure_channel(f"127.0.0.1:{port}", options=NO_RUNAHEAD) as channel:
                stub = posenc_pb2_grpc.PosencStub(channel)
                stream = stub.Generate(pb.GenerateRequest(model="rope", prompt=pb.Prompt(text="a"),
                                                          max_new_tokens=100000), timeout=300)
                next(stream)
                proc.send_signal(signal.SIGTERM)
                got = 1
                with pytest.raises(grpc.RpcError):
                    for _ in stream:
                        got += 1
                assert got < 100000
            assert proc.wait(timeout=60) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
        log.seek(0)
        assert "(1 Generate streams open; in-flight work gets up to 0.5 s)" in log.read()


# --- limits ------------------------------------------------------------------------------------------------


def test_concurrent_stream_limit(tiny_artifacts):
    root, _ = tiny_artifacts
    srv = start(root, limits=Limits(max_streams=2, max_new_tokens=5000))
    channel, stub = stub_of(srv)
    try:  # long streams, so both still hold their slot when the third asks (they are cancelled below)
        open_ = [stub.Generate(pb.GenerateRequest(model="rope", prompt=pb.Prompt(text="a"), max_new_tokens=5000),
                               timeout=60) for _ in range(2)]
        for s in open_:
            next(s)
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(pb.GenerateRequest(model="rope", prompt=pb.Prompt(text="a"), max_new_tokens=2),
                               timeout=30))
        assert err.value.code() == S.RESOURCE_EXHAUSTED and "limit is 2" in err.value.details()
        assert stub.Predict(pb.PredictRequest(model="rope", prompt=pb.Prompt(text="a"))).top  # unary unaffected
        for s in open_:
            s.cancel()
        for _ in range(100):  # the slots free as the cancelled streams notice
            if srv.registry.streams == 0:
                break
            time.sleep(0.05)
        assert len(list(stub.Generate(pb.GenerateRequest(model="rope", prompt=pb.Prompt(text="a"),
                                                         max_new_tokens=2), timeout=30))) == 2
    finally:
        channel.close()
        srv.stop(grace=1)


def test_server_side_request_deadline(tiny_artifacts):
    root, _ = tiny_artifacts
    srv = start(root, limits=Limits(max_request_s=1.0, max_new_tokens=100000))
    channel, stub = stub_of(srv)
    try:
        stream = stub.Generate(pb.GenerateRequest(model="rope", prompt=pb.Prompt(text="a"), max_new_tokens=100000),
                               timeout=60)  # the client would wait a minute; the server allows 1 s
        got = 0
        with pytest.raises(grpc.RpcError) as err:
            for _ in stream:
                got += 1
        assert err.value.code() == S.DEADLINE_EXCEEDED and got < 100000
        assert stub.Predict(pb.PredictRequest(model="rope", prompt=pb.Prompt(text="a")), timeout=10).top
    finally:
        channel.close()
        srv.stop(grace=1)


@pytest.mark.parametrize("name", ["../rope", "/etc/passwd", "rope/../rope", "rope/", "..", ".", "rope\x00",
                                  "~", "%2e%2e/rope", "a" * 5000])
def test_model_names_cannot_reach_outside_the_model_directory(stub, channel, name):
    with pytest.raises(grpc.RpcError) as err:
        stub.Predict(pb.PredictRequest(model=name, prompt=pb.Prompt(text="x")), timeout=10)
    assert err.value.code() == S.NOT_FOUND
    with pytest.raises(grpc.RpcError) as err:
        stub.Encoding(pb.EncodingRequest(model=name, length=4), timeout=10)
    assert err.value.code() == S.NOT_FOUND
    kserve = grpc_service_pb2_grpc.GRPCInferenceServiceStub(channel)
    with pytest.raises(grpc.RpcError) as err:
        kserve.ModelMetadata(kv.ModelMetadataRequest(name=name), timeout=10)
    assert err.value.code() == S.NOT_FOUND
    tensor = kv.ModelInferRequest.InferInputTensor(name="input_ids", datatype="INT64", shape=[1, 1])
    tensor.contents.int64_contents.append(1)
    with pytest.raises(grpc.RpcError) as err:
        kserve.ModelInfer(kv.ModelInferRequest(model_name=name, inputs=[tensor]), timeout=10)
    assert err.value.code() == S.NOT_FOUND
    assert not kserve.ModelReady(kv.ModelReadyRequest(name=name), timeout=10).ready


def test_malformed_bodies_are_invalid_argument_not_internal(channel, stub):
    for method in ("/posenc.v1.Posenc/Predict", "/posenc.v1.Posenc/Compare",
                   "/inference.GRPCInferenceService/ModelInfer"):
        call = channel.unary_unary(method, request_serializer=None, response_deserializer=None)
        for body in (b"\xff\xff\xff", b"\x0a\x05rope", b"\x12\x03\x0a\x01\xff"):  # garbage, truncated, bad UTF-8
            with pytest.raises(grpc.RpcError) as err:
                call(body, timeout=10)
            assert err.value.code() == S.INVALID_ARGUMENT, (method, body, err.value.details())
    stream = channel.unary_stream("/posenc.v1.Posenc/Generate", request_serializer=None, response_deserializer=None)
    with pytest.raises(grpc.RpcError) as err:
        list(stream(b"\x0a\x02\xc3\x28", timeout=10))  # model name with invalid UTF-8
    assert err.value.code() == S.INVALID_ARGUMENT
    assert stub.Predict(pb.PredictRequest(model="rope", prompt=pb.Prompt(text="ok")), timeout=10).top


def test_load_with_a_low_queue_bound_answers_only_ok_or_queue_full(tiny_artifacts):
    root, _ = tiny_artifacts
    srv = start(root, max_queue=2, max_batch=2, max_wait_ms=20.0)
    slow_runs(srv.registry.engine("rope"), 0.01)  # arrivals pile up behind each run
    channel, stub = stub_of(srv)
    codes = []

    def call(i):
        try:
            stub.Predict(pb.PredictRequest(model="rope", prompt=pb.Prompt(text="x" * (1 + i % 40))), timeout=30)
            return "OK"
        except grpc.RpcError as err:
            return err.code().name

    try:
        with ThreadPoolExecutor(32) as pool:
            codes = list(pool.map(call, range(400)))
    finally:
        channel.close()
        srv.stop(grace=1)
    assert set(codes) <= {"OK", "RESOURCE_EXHAUSTED"} and codes.count("OK") > 0
    assert codes.count("RESOURCE_EXHAUSTED") > 0, "a bound of 2 under 32 callers should overflow"


def test_resident_memory_stops_growing_under_repeated_load(tiny_artifacts):
    """The same request mix, five rounds: after the first round memory grows by no more than a small margin."""
    root, _ = tiny_artifacts
    srv = start(root)
    channel, stub = stub_of(srv)
    rss = []

    def rss_mb():
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024

    def mix(i):
        model = ["rope", "alibi", "t5", "fire", "shaw", "sinusoidal", "none"][i % 7]
        text = "abcdefghij" * (1 + i % 5)
        if i % 3 == 0:
            return len(list(stub.Generate(pb.GenerateRequest(model=model, prompt=pb.Prompt(text=text),
                                                             max_new_tokens=8), timeout=30)))
        if i % 3 == 1:
            return stub.Score(pb.ScoreRequest(model=model, prompt=pb.Prompt(text=text)), timeout=30).perplexity
        return len(stub.Predict(pb.PredictRequest(model=model, prompt=pb.Prompt(text=text),
                                                  attention=pb.ATTENTION_FULL), timeout=30).attention)

    try:
        with ThreadPoolExecutor(16) as pool:
            for _ in range(5):
                list(pool.map(mix, range(300)))
                rss.append(rss_mb())
    finally:
        channel.close()
        srv.stop(grace=1)
    # growth is the claim: no round ends 25 MB above the lowest round since the first (the kernel may take back
    # pages, such as a mapped file's, in any round; that is not growth)
    assert all(rss[i] - min(rss[1:i]) < 25 for i in range(2, len(rss))), f"resident memory by round (MB): {rss}"
