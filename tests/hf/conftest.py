import pytest

from tests.conftest import torch_threads

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


# the families imported after the first four, each proven in test_families.py
MORE = ["qwen2", "mistral", "qwen3", "gemma", "stablelm", "gptj", "mpt", "falcon", "falcon_alibi", "phi3", "opt",
        "smollm3", "ministral", "gemma2", "gemma3", "cohere2", "olmo2",
        "starcoder2", "phi"]


class Zoo:
    """The further families, each saved, imported and exported (validated at short lengths) the first time a test
    asks for it, once per session: one tiny export per family, shared by all its checks."""

    def __init__(self, root):
        self.root, self.saved, self.built = root, {}, {}

    def saved_folder(self, family):
        """(the Hugging Face folder, the transformers model), saved once; no export."""
        if family not in self.saved:
            from tests.hf.helpers import save_family

            folder = self.root / "hf" / family
            self.saved[family] = folder, save_family(family, folder)
        return self.saved[family]

    def __getitem__(self, family):
        if family not in self.built:
            import torch

            from export.hf import import_artifact

            folder, hf = self.saved_folder(family)
            report, info = import_artifact(folder, self.root / "artifacts" / family, validation_max_length=8)
            self.built[family] = {"folder": folder, "hf": hf, "artifact": self.root / "artifacts" / family,
                                  "report": report, "info": info}
            torch.set_num_threads(torch_threads())
        return self.built[family]


@pytest.fixture(scope="session")
def hf_zoo(tmp_path_factory):
    return Zoo(tmp_path_factory.mktemp("zoo"))


def pytest_collection_modifyitems(items):
    """Under pytest-xdist (make test), every test of the imported families runs in one worker, so the families are
    built and exported once (--dist loadgroup)."""
    for item in items:
        if "hf_families" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.xdist_group("hf"))
        elif "hf_zoo" in getattr(item, "fixturenames", ()):  # the further families: their own worker
            item.add_marker(pytest.mark.xdist_group("hf-zoo"))
