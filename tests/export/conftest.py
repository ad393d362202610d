import pytest
import torch

from export.build import build_artifact
from model.variants import REGISTRY
from tests.model.helpers import tiny_model


@pytest.fixture(scope="session")
def tiny_artifacts(tmp_path_factory):
    """One validated artifact per registered variant, from scaled-up random tiny weights (exported once)."""
    root = tmp_path_factory.mktemp("artifacts")
    reports = {}
    for variant in REGISTRY:
        model = tiny_model(variant)
        reports[variant] = build_artifact(model, root / variant, name=variant, opset=18,
                                          source={"kind": "random", "preset": "tiny"}, training={}, force=False)
    torch.set_num_threads(2)
    return root, reports
