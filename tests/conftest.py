import grpc
import pytest

from protos.posenc.v1 import posenc_pb2_grpc
from service.registry import Limits
from tests.serving import start


def pytest_configure(config):
    # Keep torch to the two cores this project is sized for; import lazily so torch-free tests stay torch-free.
    try:
        import torch
    except ImportError:  # the worker-only environment
        return
    torch.set_num_threads(2)


@pytest.fixture
def rng_seed():
    return 1234


@pytest.fixture(scope="session")
def tiny_artifacts(tmp_path_factory):
    """One validated artifact per registered variant, from scaled-up random tiny weights (exported once)."""
    import torch

    from export.build import build_artifact
    from model.variants import REGISTRY
    from tests.model.helpers import tiny_model

    root = tmp_path_factory.mktemp("artifacts")
    reports = {}
    for variant in REGISTRY:
        reports[variant] = build_artifact(tiny_model(variant), root / variant, name=variant, opset=23,
                                          source={"kind": "random", "preset": "tiny"}, training={}, force=False)
    torch.set_num_threads(2)
    return root, reports


# A real worker per test module, on a loopback port, over the tiny artifacts.
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
