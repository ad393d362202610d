"""Every row of the error contract (ARCHITECTURE.md section 6) against a real server; after each, a good request
still succeeds."""

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest

from protos.posenc.v1 import posenc_pb2 as pb
from protos.posenc.v1 import posenc_pb2_grpc
from service.registry import Limits
from tests.serving import hook, slow_runs, start

ROOT = Path(__file__).resolve().parents[2]
S = grpc.StatusCode


def text(t):
    return pb.Prompt(text=t)


def ids(*values):
    return pb.Prompt(tokens=pb.TokenIds(ids=list(values)))


def still_good(stub):
    assert stub.Predict(pb.PredictRequest(model="rope", prompt=text("ok"))).top


CASES = [
    ("unknown model", "Predict", pb.PredictRequest(model="gpt5", prompt=text("hi")), S.NOT_FOUND, "unknown model"),
    ("empty prompt", "Predict", pb.PredictRequest(model="rope", prompt=text("")), S.INVALID_ARGUMENT, "empty prompt"),
    ("no prompt", "Score", pb.ScoreRequest(model="rope"), S.INVALID_ARGUMENT, "empty prompt"),
    ("bad token id", "Predict", pb.PredictRequest(model="rope", prompt=ids(1, 300)), S.INVALID_ARGUMENT, "300"),
    ("negative token", "Predict", pb.PredictRequest(model="rope", prompt=ids(-1)), S.INVALID_ARGUMENT, "-1"),
    ("bad top_k", "Predict", pb.PredictRequest(model="rope", prompt=text("a"), top_k=999), S.INVALID_ARGUMENT,
     "top_k"),
    ("bad layer", "Predict", pb.PredictRequest(model="rope", prompt=text("a"), attention=pb.ATTENTION_FULL,
                                               layers=[2]), S.INVALID_ARGUMENT, "layer index 2"),
    ("bad head", "Predict", pb.PredictRequest(model="rope", prompt=text("a"), attention=pb.ATTENTION_FULL,
                                              heads=[9]), S.INVALID_ARGUMENT, "head index 9"),
    ("bad temperature", "Generate", pb.GenerateRequest(model="rope", prompt=text("a"), temperature=-1),
     S.INVALID_ARGUMENT, "temperature"),
    ("bad top_p", "Generate", pb.GenerateRequest(model="rope", prompt=text("a"), top_p=2), S.INVALID_ARGUMENT,
     "top_p"),
    ("too many new tokens", "Generate", pb.GenerateRequest(model="rope", prompt=text("a"), max_new_tokens=10**6),
     S.INVALID_ARGUMENT, "max_new_tokens"),
    ("past learned table", "Predict", pb.PredictRequest(model="learned", prompt=text("x" * 17)), S.INVALID_ARGUMENT,
     "max_positions=16"),
    ("past server cap", "Score", pb.ScoreRequest(model="alibi", prompt=text("x" * 201)), S.INVALID_ARGUMENT,
     "limit of 200 tokens"),
    ("one-token score", "Score", pb.ScoreRequest(model="alibi", prompt=text("x")), S.INVALID_ARGUMENT,
     "at least two"),
]


@pytest.mark.parametrize("name, rpc, request_, code, words", CASES, ids=[c[0] for c in CASES])
def test_error_contract(stub, name, rpc, request_, code, words):
    with pytest.raises(grpc.RpcError) as err:
        result = getattr(stub, rpc)(request_)
        if rpc == "Generate":
            list(result)
    assert err.value.code() == code, err.value.details()
    assert words in err.value.details()
    still_good(stub)


def test_too_large_response_is_resource_exhausted_with_a_hint(tiny_artifacts):
    root, _ = tiny_artifacts
    srv = start(root, limits=Limits(max_message_bytes=64 * 1024))
    try:
        with grpc.insecure_channel(f"127.0.0.1:{srv.port}") as ch:
            stub = posenc_pb2_grpc.PosencStub(ch)
            with pytest.raises(grpc.RpcError) as err:
                stub.Predict(pb.PredictRequest(model="alibi", prompt=text("y" * 60), attention=pb.ATTENTION_FULL))
            assert err.value.code() == S.RESOURCE_EXHAUSTED
            assert "LAST_ROW" in err.value.details()
            ok = stub.Predict(pb.PredictRequest(model="alibi", prompt=text("y" * 60),
                                                attention=pb.ATTENTION_LAST_ROW))
            assert len(ok.attention) == 8
    finally:
        srv.stop(grace=1)


def test_queue_full_is_resource_exhausted(tiny_artifacts):
    root, _ = tiny_artifacts
    srv = start(root, max_queue=1, max_batch=1, workers=32)
    slow_runs(srv.registry.engine("rope"), 0.05)  # arrivals pile up behind each run
    codes = []
    try:
        with grpc.insecure_channel(f"127.0.0.1:{srv.port}") as ch:
            stub = posenc_pb2_grpc.PosencStub(ch)
            barrier = threading.Barrier(24)

            def call():
                barrier.wait()
                try:
                    stub.Score(pb.ScoreRequest(model="rope", prompt=text("q" * 64)))
                    codes.append(S.OK)
                except grpc.RpcError as e:
                    codes.append(e.code())

            threads = [threading.Thread(target=call) for _ in range(24)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=60)
            assert S.RESOURCE_EXHAUSTED in codes and S.OK in codes
            assert set(codes) <= {S.OK, S.RESOURCE_EXHAUSTED}
            assert stub.Predict(pb.PredictRequest(model="rope", prompt=text("ok"))).top
    finally:
        srv.stop(grace=1)


def test_deadline_passing_in_the_queue_is_deadline_exceeded_and_not_run(stub, server, request):

    engine, ran = server.registry.engine("t5"), []

    def slow_run(work):  # the first batch holds the loop long enough for the next request's deadline to pass
        ran.append([len(j.ids) for j in work])
        if len(ran) == 1:
            time.sleep(0.6)

    previous = hook(engine, slow_run)
    request.addfinalizer(lambda: engine.use(previous))
    blocker = threading.Thread(target=lambda: stub.Score(pb.ScoreRequest(model="t5", prompt=text("abc"))))
    blocker.start()
    time.sleep(0.1)
    with pytest.raises(grpc.RpcError) as err:
        stub.Score(pb.ScoreRequest(model="t5", prompt=text("x" * 50)), timeout=0.2)
    assert err.value.code() == S.DEADLINE_EXCEEDED
    blocker.join(timeout=10)
    time.sleep(0.2)
    assert [50] not in ran  # the expired request never reached onnxruntime
    still_good(stub)


def test_shutting_down_refuses_new_work(tiny_artifacts):
    root, _ = tiny_artifacts
    srv = start(root)
    with grpc.insecure_channel(f"127.0.0.1:{srv.port}") as ch:
        stub = posenc_pb2_grpc.PosencStub(ch)
        srv.registry.shutting_down = True
        with pytest.raises(grpc.RpcError) as err:
            stub.Predict(pb.PredictRequest(model="rope", prompt=text("a")))
        assert err.value.code() == S.UNAVAILABLE
    srv.stop(grace=1)


def test_internal_error_keeps_serving(stub, server, monkeypatch):
    def boom(*a, **k):
        raise RuntimeError("simulated fault")

    monkeypatch.setattr(server.ops, "score", boom)
    with pytest.raises(grpc.RpcError) as err:
        stub.Score(pb.ScoreRequest(model="rope", prompt=text("ab")))
    assert err.value.code() == S.INTERNAL and "request id" in err.value.details()
    still_good(stub)


def test_bad_artifact_is_refused_and_the_others_served(tiny_artifacts, tmp_path):
    import shutil

    root, _ = tiny_artifacts
    for name in ("rope", "alibi"):
        shutil.copytree(root / name, tmp_path / name)
    onnx_file = tmp_path / "alibi" / "model.onnx"
    data = bytearray(onnx_file.read_bytes())
    data[100] ^= 0xFF
    onnx_file.write_bytes(bytes(data))
    shutil.copytree(root / "t5", tmp_path / "t5")
    (tmp_path / "t5" / "manifest.json").unlink()
    (tmp_path / "t5" / "manifest.json").mkdir()  # unreadable as a file: an OSError, not a parse error
    srv = start(tmp_path)
    try:
        assert sorted(srv.registry.models) == ["rope"]
        assert "sha256" in srv.rejected["alibi"]
        assert "cannot read it" in srv.rejected["t5"] and "manifest.json" in srv.rejected["t5"]
    finally:
        srv.stop(grace=1)


def test_service_imports_without_torch():
    code = ("import sys; sys.modules['torch'] = None\n"
            "import service.server, service.__main__, service.registry, service.operations, service.servicer\n"
            "print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_sigterm_drains_in_flight_work_and_exits_zero(tiny_artifacts):
    import signal

    root, _ = tiny_artifacts
    cmd = [sys.executable, "-m", "service", "--model-dir", str(root), "--port", "0", "--metrics-port", "0",
           "--http-port", "-1", "--threads", "1"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        line = proc.stdout.readline()
        assert "posenc serving" in line, line
        port = int(line.rsplit(":", 1)[1])
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = posenc_pb2_grpc.PosencStub(ch)
            stream = stub.Generate(pb.GenerateRequest(model="rope", prompt=text("a"), max_new_tokens=64))
            first = next(stream)  # in flight
            proc.send_signal(signal.SIGTERM)
            refused = None  # new work is refused while draining or after, once the worker has the signal
            for _ in range(400):
                try:
                    stub.Predict(pb.PredictRequest(model="rope", prompt=text("a")), timeout=5)
                except grpc.RpcError as err:
                    if err.code() != S.CANCELLED:  # CANCELLED: caught by gRPC's own shutdown (grpc/grpc#41785)
                        refused = err.code()
                        break
                time.sleep(0.025)
            assert refused == S.UNAVAILABLE
            rest = list(stream)  # the stream in flight still finishes
            assert len(rest) + 1 == 64 and rest[-1].finish_reason == "length" and first.token.piece
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


# --- the worker's own settings -------------------------------------------------------------------------------


BAD_SETTINGS = [  # (flags, environment, what the one line must say)
    (["--port", "abc"], {}, "invalid int value: 'abc'"),
    ([], {"POSENC_PORT": "abc"}, "POSENC_PORT='abc'"),
    ([], {"POSENC_MAX_WAIT_MS": "soon"}, "POSENC_MAX_WAIT_MS='soon'"),
    (["--log-level", "loud"], {}, "--log-level 'loud'"),
    ([], {"POSENC_LOG_LEVEL": "loud"}, "--log-level 'loud'"),
    (["--model-dir", "FILE"], {}, "is not a directory"),
    (["--model-dir", "MISSING"], {}, "does not exist"),
    (["--port", "70000"], {}, "--port must be between 0 and 65535"),
    (["--threads", "0"], {}, "--threads must be >= 1"),
    (["--max-batch", "-3"], {}, "--max-batch must be >= 1"),
    (["--max-wait-ms", "nan"], {}, "--max-wait-ms must be >= 0"),
    (["--grace-seconds", "-1"], {}, "--grace-seconds must be >= 0"),
    ([], {"POSENC_GRACE_SECONDS": "forever"}, "POSENC_GRACE_SECONDS='forever'"),
    (["--memory-arena", "2"], {}, "invalid choice"),
    ([], {"POSENC_MEMORY_ARENA": "2"}, "--memory-arena must be between 0 and 1"),
    ([], {"POSENC_SHARED_ARENA": "2"}, "--shared-arena must be between 0 and 1"),
    (["--concurrent-runs", "-1"], {}, "--concurrent-runs must be >= 0"),
    (["--tls-cert", "MISSING", "--tls-key", "MISSING"], {}, "--tls-cert"),
    (["--tls-cert", "FILE"], {}, "needs both"),
    (["--tls-client-ca", "FILE"], {}, "--tls-client-ca (mutual TLS) needs"),
    (["--no-such-flag"], {}, "unrecognized arguments"),
]


def worker_args(flags, tmp_path, root):
    subst = {"FILE": str(ROOT / "README.md"), "MISSING": str(tmp_path / "missing")}
    flags = [subst.get(f, f) for f in flags]
    if "--model-dir" not in flags:
        flags = ["--model-dir", str(root), *flags]
    return [*flags, "--port", "0", "--metrics-port", "-1", "--http-port", "-1"] if "--port" not in flags else [
        *flags, "--metrics-port", "-1", "--http-port", "-1"]


@pytest.mark.parametrize("flags, environ, message", BAD_SETTINGS, ids=[" ".join(c[0]) or str(c[1])
                                                                       for c in BAD_SETTINGS])
def test_bad_worker_settings_are_one_line_and_exit_2(flags, environ, message, tmp_path, monkeypatch, capsys):
    """The worker's parser in process (every case), then the real `python -m service` for a few below."""
    from service.__main__ import parse

    root = tmp_path / "models"
    root.mkdir()
    for key in [k for k in __import__("os").environ if k.startswith("POSENC_")]:
        monkeypatch.delenv(key)
    for key, value in environ.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(SystemExit) as exit_:
        parse(worker_args(flags, tmp_path, root))
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and message in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("flags, environ, message", [c for c in BAD_SETTINGS if c[2] in (
    "POSENC_PORT='abc'", "is not a directory", "--log-level 'loud'")])
def test_bad_settings_stop_the_real_worker_process(flags, environ, message, tmp_path):
    root = tmp_path / "models"
    root.mkdir()
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("POSENC_")}, **environ}
    res = subprocess.run([sys.executable, "-m", "service", *worker_args(flags, tmp_path, root)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and message in res.stderr and len(res.stderr.strip().splitlines()) == 1, res
    assert "posenc serving" not in res.stdout
