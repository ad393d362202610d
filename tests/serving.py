import time

import grpc
import pytest

from protos.posenc.v1 import posenc_pb2_grpc
from service.api import Limits
from service.server import Server, Settings


def slow_runs(scheduler, seconds: float) -> None:
    """Make every onnxruntime call of a scheduler take `seconds` longer, so requests sent together overlap (a
    tiny model answers in well under a millisecond: each could otherwise find the model idle and run alone)."""
    scheduler.run = lambda jobs, run=scheduler.run: (time.sleep(seconds), run(jobs))[1]


def start(root, **overrides):
    overrides.setdefault("metrics_port", -1)
    settings = Settings(model_dir=root, host="127.0.0.1", port=0, threads=1, **overrides)
    return Server(settings).start()


@pytest.fixture(scope="module")
def server(tiny_artifacts):
    root, _ = tiny_artifacts
    srv = start(root, max_batch=8, max_wait_ms=5.0, limits=Limits(max_prompt_tokens=200, max_new_tokens=64))
    yield srv
    srv.stop(grace=1)


@pytest.fixture(scope="module")
def channel(server):
    ch = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    grpc.channel_ready_future(ch).result(timeout=10)
    yield ch
    ch.close()


@pytest.fixture(scope="module")
def stub(channel):
    return posenc_pb2_grpc.PosencStub(channel)
