import pytest


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
