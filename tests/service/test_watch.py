"""`python -m service --watch-seconds N`: a real worker on loopback picks up artifact folders that appear after it
started (how `make serve` serves each model as soon as its build has written it), and leaves a half-written
folder alone until its files are complete."""

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos.posenc.v1 import posenc_pb2 as pb
from protos.posenc.v1 import posenc_pb2_grpc
from service.watch import snapshot

ROOT = Path(__file__).resolve().parents[2]


def names(stub) -> list[str]:
    return [m.name for m in stub.ListModels(pb.ListModelsRequest(), timeout=10).models]


def wait_for(stub, wanted: list[str]) -> list[str]:
    for _ in range(300):  # 30 s: the watcher looks every 0.1 s and reloads after one quiet look
        seen = names(stub)
        if seen == wanted:
            return seen
        time.sleep(0.1)
    return seen


def health(channel) -> int:
    return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=10).status


def publish(src: Path, models: Path, name: str) -> None:
    """What python -m export does: assemble a hidden folder beside the others, then rename it into place."""
    staging = models / f".{name}.tmp-1"
    shutil.copytree(src, staging)
    os.rename(staging, models / name)


@pytest.fixture
def watching_worker(tmp_path):
    models = tmp_path / "models"
    models.mkdir()
    log = open(tmp_path / "worker.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "service", "--model-dir", str(models), "--port", "0",
                             "--metrics-port", "-1", "--http-port", "-1", "--threads", "1", "--watch-seconds", "0.1"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=log, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("posenc serving no models on "), (line, (tmp_path / "worker.log").read_text())
        channel = grpc.insecure_channel(f"127.0.0.1:{int(line.rsplit(':', 1)[1])}")
        yield models, channel, posenc_pb2_grpc.PosencStub(channel)
        channel.close()
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        log.close()


def test_a_worker_started_on_an_empty_folder_serves_each_artifact_once_it_is_written(tiny_artifacts,
                                                                                      watching_worker):
    root, _ = tiny_artifacts
    models, channel, stub = watching_worker
    assert names(stub) == []
    assert health(channel) == health_pb2.HealthCheckResponse.NOT_SERVING  # live, but nothing to serve yet

    publish(root / "rope", models, "rope")
    assert wait_for(stub, ["rope"]) == ["rope"]
    assert stub.Predict(pb.PredictRequest(model="rope", prompt=pb.Prompt(text="ab")), timeout=10).top
    assert health(channel) == health_pb2.HealthCheckResponse.SERVING

    # A folder copied file by file that stops half-way: its model.onnx is shorter than the manifest says and its
    # encoding.onnx is not there yet.
    half = models / "alibi"
    half.mkdir()
    for name in ("manifest.json", "model.json"):
        shutil.copy(root / "alibi" / name, half / name)
    whole = (root / "alibi" / "model.onnx").read_bytes()
    (half / "model.onnx").write_bytes(whole[: len(whole) // 2])
    publish(root / "fire", models, "fire")  # comes in after the half folder: one reload sees both
    assert wait_for(stub, ["fire", "rope"]) == ["fire", "rope"]  # and never the half folder

    (half / "model.onnx").write_bytes(whole)  # the copy completes: its files changed, so it is tried again
    for rest in sorted((root / "alibi").iterdir()):  # encoding.onnx, profile.onnx, fast.onnx, ...
        if not (half / rest.name).exists():
            shutil.copy(rest, half / rest.name)
    assert wait_for(stub, ["alibi", "fire", "rope"]) == ["alibi", "fire", "rope"]
    assert stub.Predict(pb.PredictRequest(model="alibi", prompt=pb.Prompt(text="ab")), timeout=10).top

    shutil.rmtree(models / "fire")
    assert wait_for(stub, ["alibi", "rope"]) == ["alibi", "rope"]


def test_snapshot_sees_files_change_and_skips_hidden_folders(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "model.onnx").write_bytes(b"12")
    (tmp_path / ".a.tmp-1").mkdir()
    first = snapshot(tmp_path)
    assert [name for name, _ in first] == ["a"]
    (tmp_path / ".a.tmp-1" / "model.onnx").write_bytes(b"123")
    assert snapshot(tmp_path) == first  # staging folders are nobody's business
    (tmp_path / "a" / "model.onnx").write_bytes(b"1234")
    assert snapshot(tmp_path) != first
    assert snapshot(tmp_path / "gone") is None
