"""API keys and per-key limits on the gRPC port (service.auth), against a real worker: every posenc.v1 and KServe
method refuses a call without a valid key (UNAUTHENTICATED) and answers with one, health and readiness stay open,
the header is fuzzed, keys never reach the log, refusals are counted, TLS too, the client CLI, the client channel,
the healthcheck and the standard tritonclient (its own process) send the key; a key over its rate or its calls in
flight gets RESOURCE_EXHAUSTED with retry-after while another key is served; a ModelInfer of several rows counts
one per row against its key's limits."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from client.channel import TLS, ChannelError, channel_for, instance_of
from protos.inference import grpc_service_pb2, grpc_service_pb2_grpc
from protos.posenc.v1 import posenc_pb2 as pb
from protos.posenc.v1 import posenc_pb2_grpc
from service.auth import KeyFileError, bearer, parse_key_lines, parse_keys
from tests.client.test_tls import SAN, issue
from tests.service.test_kserve import raw_request
from tests.serving import hook, slow_runs, start

ROOT = Path(__file__).resolve().parents[2]
KEY, HASHED_KEY = "k-3f9a2c41d0e7b5", "team-b.7Qx2"
METHODS = [(f"/{s.full_name}/{m.name}", m.client_streaming, m.server_streaming)
           for s in (pb.DESCRIPTOR.services_by_name["Posenc"],
                     grpc_service_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"])
           for m in s.methods]
OPEN = {"/inference.GRPCInferenceService/ServerLive", "/inference.GRPCInferenceService/ServerReady"}
FUZZ = ["", "Bearer", "Bearer ", "bearer    ", "Basic " + KEY, KEY, "Bearer " + KEY + "x", "Bearer " + KEY[:-1],
        "Bearer " + "a" * 4000, "Bearer   ", "Bearer " + KEY.upper(), "Token " + KEY, "Bearer " + KEY + "~",
        "Bearer " + KEY + " " + KEY]


def key_file(folder: Path) -> Path:
    path = folder / "keys"
    digest = hashlib.sha256(HASHED_KEY.encode()).hexdigest()
    path.write_text(f"# accepted keys\n{KEY}\n\nsha256:{digest}\n")
    return path


@pytest.fixture(scope="module")
def keyed(tiny_artifacts, tmp_path_factory):
    root, _ = tiny_artifacts
    srv = start(root, api_keys_file=key_file(tmp_path_factory.mktemp("keys")), instance="keyed")
    yield srv
    srv.stop(grace=1)


def raw_call(channel, method: str, client_streaming: bool, server_streaming: bool, metadata=None):
    """The status code of one call with an empty body (bytes in, bytes out: no parsing on this side)."""
    kind = {(False, False): channel.unary_unary, (False, True): channel.unary_stream,
            (True, False): channel.stream_unary, (True, True): channel.stream_stream}[
        (client_streaming, server_streaming)]
    call = kind(method)
    request = iter([b""]) if client_streaming else b""
    try:
        out = call(request, timeout=20, metadata=metadata)
        if server_streaming:
            list(out)
        return grpc.StatusCode.OK
    except grpc.RpcError as err:
        return err.code()


def bearer_of(key: str) -> tuple:
    return (("authorization", f"Bearer {key}"),)


def refusals(srv, transport: str, reason: str) -> float:
    return srv.metrics.registry.get_sample_value("posenc_refusals_total",
                                                 {"transport": transport, "reason": reason}) or 0.0


def test_key_files_and_headers_parse_and_bad_files_never_quote_a_key():
    digests = parse_keys(f"# c\n{KEY}\n  sha256:{'AB' * 32}  \n")
    assert digests == [hashlib.sha256(KEY.encode()).digest(), bytes.fromhex("ab" * 32)]
    for bad in ("", "# only a comment\n", "sha256:abc\n", "has space-secret\n", "ключ\n"):
        with pytest.raises(KeyFileError) as err:
            parse_keys(bad)
        assert "secret" not in str(err.value) and "ключ" not in str(err.value)
    entries = parse_key_lines(f"{KEY} requests_per_second=0.5 max_concurrent=1\n{HASHED_KEY}\n")
    assert entries == [(hashlib.sha256(KEY.encode()).digest(), {"requests_per_second": 0.5, "max_concurrent": 1}),
                       (hashlib.sha256(HASHED_KEY.encode()).digest(), {})]
    for bad in (f"{KEY} rps=5\n", f"{KEY} max_concurrent=-1\n", f"{KEY} requests_per_second=x\n"):
        with pytest.raises(KeyFileError, match="line 1: after the key"):
            parse_key_lines(bad)
    assert bearer("Bearer abc") == bearer(b"bearer  abc ") == b"abc"
    assert bearer("Bearer") is None and bearer("Bearer   ") is None and bearer("abc") is None and bearer(None) is None


def test_every_method_refuses_a_call_without_a_key_and_answers_one_with_it(keyed):
    assert {m.split("/")[1] for m, _, _ in METHODS} == {"posenc.v1.Posenc", "inference.GRPCInferenceService"}
    with grpc.insecure_channel(f"127.0.0.1:{keyed.port}") as ch:
        for method, cs, ss in METHODS:
            code = raw_call(ch, method, cs, ss)
            if method in OPEN:
                assert code == grpc.StatusCode.OK, method
                continue
            assert code == grpc.StatusCode.UNAUTHENTICATED, method
            for key in (KEY, HASHED_KEY):  # a plain key and a key the file holds only as sha256:
                assert raw_call(ch, method, cs, ss, bearer_of(key)) != grpc.StatusCode.UNAUTHENTICATED, method
        health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING  # probes need no key
        reflection = "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"
        assert raw_call(ch, reflection, True, True) == grpc.StatusCode.UNAUTHENTICATED


def test_fuzzed_authorization_headers_are_refused_and_the_worker_keeps_serving(keyed, caplog):
    before = refusals(keyed, "grpc", "missing") + refusals(keyed, "grpc", "invalid")
    with caplog.at_level(logging.DEBUG), grpc.insecure_channel(f"127.0.0.1:{keyed.port}") as ch:
        stub = posenc_pb2_grpc.PosencStub(ch)
        sent = 0
        for value in FUZZ:
            try:
                stub.ListModels(pb.ListModelsRequest(), timeout=10, metadata=(("authorization", value),))
                raise AssertionError(f"accepted {value[:40]!r}")
            except grpc.RpcError as err:
                assert err.code() == grpc.StatusCode.UNAUTHENTICATED, (value[:40], err)
                assert KEY not in (err.details() or "")
            sent += 1
        # a non-ASCII value cannot travel in gRPC metadata; its bytes in a -bin header are refused the same way
        try:
            stub.ListModels(pb.ListModelsRequest(), timeout=10, metadata=(("authorization-bin", "ключ".encode()),))
            raise AssertionError("accepted a binary header")
        except grpc.RpcError as err:
            assert err.code() == grpc.StatusCode.UNAUTHENTICATED
        sent += 1
        assert stub.ListModels(pb.ListModelsRequest(), timeout=10, metadata=bearer_of(KEY)).models
    after = refusals(keyed, "grpc", "missing") + refusals(keyed, "grpc", "invalid")
    assert after - before == sent
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert KEY not in logged and HASHED_KEY not in logged


def test_the_client_channel_cli_and_lab_send_posenc_api_key(keyed, monkeypatch):
    target = f"127.0.0.1:{keyed.port}"
    with channel_for(target, api_key=KEY) as ch:
        _, call = posenc_pb2_grpc.PosencStub(ch).ListModels.with_call(pb.ListModelsRequest(), timeout=10)
        assert instance_of(call) == "keyed"
    monkeypatch.setenv("POSENC_API_KEY", HASHED_KEY)
    with channel_for(target) as ch:
        gen = list(posenc_pb2_grpc.PosencStub(ch).Generate(
            pb.GenerateRequest(model="rope", prompt=pb.Prompt(text="ab"), max_new_tokens=3), timeout=10))
        assert len(gen) == 3
    monkeypatch.setenv("POSENC_API_KEY", "two words")
    with pytest.raises(ChannelError, match="printable ASCII"):
        channel_for(target)
    env = {k: v for k, v in os.environ.items() if k != "POSENC_API_KEY"}
    cli = [sys.executable, "-m", "client", "--target", target, "list"]
    ok = subprocess.run(cli, capture_output=True, text=True, cwd=ROOT, timeout=60, env=env | {"POSENC_API_KEY": KEY})
    assert ok.returncode == 0 and "rope" in ok.stdout, ok.stderr
    refused = subprocess.run(cli, capture_output=True, text=True, cwd=ROOT, timeout=60, env=env)
    assert refused.returncode != 0 and "UNAUTHENTICATED" in refused.stderr and KEY not in refused.stderr
    lab = [sys.executable, "-m", "lab", "--target", target, "compare", "dog bites man"]
    ok = subprocess.run(lab, capture_output=True, text=True, cwd=ROOT, timeout=120, env=env | {"POSENC_API_KEY": KEY})
    assert ok.returncode == 0 and "rope" in ok.stdout, ok.stderr  # a lab command, through the same channel
    health = subprocess.run([sys.executable, "-m", "service.healthcheck", "--target", target], capture_output=True,
                            text=True, cwd=ROOT, timeout=60, env=env)
    assert health.returncode == 0, health.stdout + health.stderr  # the probe needs no key


def test_tritonclient_sends_the_key_in_its_headers(keyed):
    script = """
import json, sys
import tritonclient.grpc as tc
from tritonclient.utils import InferenceServerException
c = tc.InferenceServerClient(sys.argv[1])
out = {"ready": c.is_server_ready()}
try:
    c.get_model_metadata("rope")
    out["without"] = "OK"
except InferenceServerException as e:
    out["without"] = e.status()
out["with"] = c.get_model_metadata("rope", headers={"authorization": "Bearer " + sys.argv[2]}, as_json=True)["name"]
print(json.dumps(out))
"""
    res = subprocess.run([sys.executable, "-c", script, f"127.0.0.1:{keyed.port}", KEY], capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out == {"ready": True, "without": "StatusCode.UNAUTHENTICATED", "with": "rope"}


def test_keys_over_tls_and_mutual_tls(tiny_artifacts, tmp_path):
    root, _ = tiny_artifacts
    issue(tmp_path, "server", san=SAN)
    srv = start(root, api_keys_file=key_file(tmp_path), tls_cert=tmp_path / "server.pem",
                tls_key=tmp_path / "server.key")
    try:
        tls = TLS(ca=tmp_path / "server.pem")
        with channel_for(f"127.0.0.1:{srv.port}", tls=tls, api_key=KEY) as ch:
            assert posenc_pb2_grpc.PosencStub(ch).ListModels(pb.ListModelsRequest(), timeout=10).models
        with channel_for(f"127.0.0.1:{srv.port}", tls=tls) as ch:
            with pytest.raises(grpc.RpcError) as err:
                posenc_pb2_grpc.PosencStub(ch).ListModels(pb.ListModelsRequest(), timeout=10)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        srv.stop(grace=1)


def test_a_bad_key_file_stops_the_worker_with_one_line(tmp_path, tiny_artifacts):
    root, _ = tiny_artifacts
    bad = tmp_path / "keys"
    bad.write_text("two secret-words\n")
    for args in (["--api-keys", str(bad)], ["--api-keys-file", str(tmp_path / "absent")]):
        out = subprocess.run([sys.executable, "-m", "service", "--model-dir", str(root), "--port", "0",
                              "--http-port", "-1", "--metrics-port", "-1", *args], capture_output=True, text=True,
                             cwd=ROOT, timeout=120)
        assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr
        assert "secret" not in out.stderr


def test_a_key_with_its_own_limits_is_held_to_them_and_the_others_to_the_flags(tiny_artifacts, tmp_path):
    root, _ = tiny_artifacts
    keys = tmp_path / "keys"
    keys.write_text(f"{KEY} requests_per_second=1\n{HASHED_KEY}\n")  # KEY: 1 a second; HASHED_KEY: no limit
    srv = start(root, api_keys_file=keys)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{srv.port}") as ch:
            stub = posenc_pb2_grpc.PosencStub(ch)
            for _ in range(5):
                assert stub.ListModels(pb.ListModelsRequest(), timeout=10, metadata=bearer_of(HASHED_KEY)).models
            assert stub.ListModels(pb.ListModelsRequest(), timeout=10, metadata=bearer_of(KEY)).models
            with pytest.raises(grpc.RpcError) as err:
                stub.ListModels(pb.ListModelsRequest(), timeout=10, metadata=bearer_of(KEY))
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "1 requests per second" in \
                err.value.details()
    finally:
        srv.stop(grace=1)


def test_per_key_rate_and_concurrency_limits_refuse_one_key_and_serve_another(tiny_artifacts, tmp_path):
    root, _ = tiny_artifacts
    srv = start(root, api_keys_file=key_file(tmp_path), key_requests_per_second=2.0, key_max_concurrent=1)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{srv.port}") as ch:
            stub = posenc_pb2_grpc.PosencStub(ch)
            codes, trailers = [], []
            for _ in range(4):  # a burst of 2, then the bucket is empty for ~0.5 s
                try:
                    stub.ListModels(pb.ListModelsRequest(), timeout=10, metadata=bearer_of(KEY))
                    codes.append("OK")
                except grpc.RpcError as err:
                    codes.append(err.code().name)
                    trailers.append(dict(err.trailing_metadata() or ()))
            assert codes[:2] == ["OK", "OK"] and "RESOURCE_EXHAUSTED" in codes[2:], codes
            assert all(t.get("retry-after") == "1" for t in trailers), trailers
            # the other key has its own bucket
            assert stub.ListModels(pb.ListModelsRequest(), timeout=10, metadata=bearer_of(HASHED_KEY)).models
            assert refusals(srv, "grpc", "rate") == codes.count("RESOURCE_EXHAUSTED")

            # one call in flight per key: a slow stream holds KEY's only slot
            slow_runs(srv.registry.engine("rope"), 0.05)
            time.sleep(1.1)  # buckets full again
            stream = stub.Generate(pb.GenerateRequest(model="rope", prompt=pb.Prompt(text="a"), max_new_tokens=20),
                                   timeout=60, metadata=bearer_of(KEY))
            first = next(stream)
            with pytest.raises(grpc.RpcError) as err:
                stub.Predict(pb.PredictRequest(model="rope", prompt=pb.Prompt(text="ab")), timeout=10,
                             metadata=bearer_of(KEY))
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "in flight" in err.value.details()
            served = []  # the other key is served while KEY's stream runs
            other = threading.Thread(target=lambda: served.append(stub.Predict(
                pb.PredictRequest(model="rope", prompt=pb.Prompt(text="ab")), timeout=10,
                metadata=bearer_of(HASHED_KEY)).top))
            other.start()
            other.join(timeout=30)
            rest = list(stream)
            assert served and served[0]
            assert first.token.id >= 0 and len(rest) == 19
            time.sleep(1.1)
            assert stub.Predict(pb.PredictRequest(model="rope", prompt=pb.Prompt(text="ab")), timeout=10,
                                metadata=bearer_of(KEY)).top  # the slot came back when the stream ended
            assert refusals(srv, "grpc", "concurrent") == 1
    finally:
        srv.stop(grace=1)


def gate_runs(engine) -> tuple[threading.Event, threading.Event]:
    """(entered, release): every onnxruntime call of the engine waits for `release` (bounded), `entered` set
    when the first one arrives; so a request's prompts are known to be inside the model while it is held."""
    entered, release = threading.Event(), threading.Event()

    def run(work):
        entered.set()
        release.wait(60)

    hook(engine, run)
    return entered, release


def test_a_call_of_several_rows_counts_each_row_against_its_keys_limits(tiny_artifacts, tmp_path):
    """Per-key limits count what a call occupies: a ModelInfer of 2 rows is 2 requests of its key's rate and 2 of
    its calls in flight; one of more rows than the key may hold is refused whole, naming the limit."""
    root, _ = tiny_artifacts
    rate_key, held_key = "rate-key.2", "held-key.2"
    keys = tmp_path / "keys"
    keys.write_text(f"{rate_key} requests_per_second=2\n{held_key} max_concurrent=2\n{KEY}\n")
    srv = start(root, api_keys_file=keys)
    two, three = np.array([[5, 6, 7], [8, 9, 10]]), np.array([[5, 6], [7, 8], [9, 10]])
    try:
        with grpc.insecure_channel(f"127.0.0.1:{srv.port}") as ch:
            stub, kserve = posenc_pb2_grpc.PosencStub(ch), grpc_service_pb2_grpc.GRPCInferenceServiceStub(ch)
            # the rate: a burst of 2 requests is spent by one call of 2 rows
            assert kserve.ModelInfer(raw_request(two), timeout=30, metadata=bearer_of(rate_key)).outputs
            with pytest.raises(grpc.RpcError) as err:
                stub.ListModels(pb.ListModelsRequest(), timeout=10, metadata=bearer_of(rate_key))
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err.value
            assert int(dict(err.value.trailing_metadata())["retry-after"]) >= 1
            # more rows than the key may have in flight: never runs, so INVALID_ARGUMENT saying the key's limit
            with pytest.raises(grpc.RpcError) as err:
                kserve.ModelInfer(raw_request(three), timeout=30, metadata=bearer_of(held_key))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "at most 2" in err.value.details()
            # whichever outputs: a profile alone (run on the profile graph, not with the logits) counts its rows too
            with pytest.raises(grpc.RpcError) as err:
                kserve.ModelInfer(raw_request(three, outputs=["profile"]), timeout=30, metadata=bearer_of(held_key))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "at most 2" in err.value.details()
            # 2 rows in flight hold both of the key's slots: its next call is refused, another key is served
            entered, release = gate_runs(srv.registry.engine("rope"))
            held = []
            worker = threading.Thread(target=lambda: held.append(kserve.ModelInfer(
                raw_request(two), timeout=60, metadata=bearer_of(held_key))))
            worker.start()
            try:
                assert entered.wait(30)  # the rows are inside the model, the call in flight
                with pytest.raises(grpc.RpcError) as err:
                    stub.ListModels(pb.ListModelsRequest(), timeout=10, metadata=bearer_of(held_key))
                assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "in flight" in err.value.details()
                assert stub.ListModels(pb.ListModelsRequest(), timeout=10, metadata=bearer_of(KEY)).models
            finally:
                release.set()
                worker.join(60)
            assert held and held[0].outputs[0].shape == [2, 3, srv.registry.models["rope"].vocab_size]
            assert stub.ListModels(pb.ListModelsRequest(), timeout=10, metadata=bearer_of(held_key)).models
            assert refusals(srv, "grpc", "rate") == 1 and refusals(srv, "grpc", "concurrent") == 3
    finally:
        srv.stop(grace=1)
