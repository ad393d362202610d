import pytest

FAMILIES = ["gpt2", "gpt_neox", "llama", "bloom"]
EXTERNAL = "bloom"


@pytest.fixture(scope="session")
def hf_families(tmp_path_factory):
    """Per family: the saved Hugging Face folder, the transformers model and the imported artifact (each exported
    once, validated by the exporter at short lengths; the parity tests go to length 200).  BLOOM's graph is written
    with external data (model.onnx.data), as BLOOM-560m's must be, so every parity test also covers that path."""
    import torch

    from export.hf import import_artifact
    from tests.hf.helpers import save_family

    root = tmp_path_factory.mktemp("hf")
    out = {}
    for family in FAMILIES:
        folder = root / "hf" / family
        hf = save_family(family, folder)
        report, info = import_artifact(folder, root / "artifacts" / family, validation_max_length=16,
                                       external_data=family == EXTERNAL)
        out[family] = {"folder": folder, "hf": hf, "artifact": root / "artifacts" / family, "report": report,
                       "info": info}
    torch.set_num_threads(2)
    return out


def pytest_collection_modifyitems(items):
    """Under pytest-xdist (make test), every test of the imported families runs in one worker, so the families are
    built and exported once (--dist loadgroup)."""
    for item in items:
        if "hf_families" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.xdist_group("hf"))
