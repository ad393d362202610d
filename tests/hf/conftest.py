import pytest

from tests.conftest import torch_threads

FAMILIES = ["gpt2", "gpt_neox", "llama", "bloom"]
EXTERNAL = "bloom"


@pytest.fixture(scope="session")
def hf_families(tmp_path_factory, worker_id):
    """Per family: the saved Hugging Face folder, the transformers model and the imported artifact (each exported
    once per run, validated by the exporter at short lengths; the parity tests go to length 200), built the first
    time a test asks for it and shared by both pytest-xdist workers as the Zoo's families are.  BLOOM's graph is
    written with external data (model.onnx.data), as BLOOM-560m's must be, so every parity test also covers that
    path."""
    shared = None if worker_id == "master" else tmp_path_factory.getbasetemp().parent / "hf-families"
    return Zoo(tmp_path_factory.mktemp("hf"), shared, validation_max_length=16, external={EXTERNAL},
               families=FAMILIES)


# the families imported after the first four, each proven in test_families.py
MORE = ["qwen2", "mistral", "qwen3", "gemma", "stablelm", "gptj", "mpt", "falcon", "falcon_alibi", "phi3", "opt",
        "smollm3", "ministral", "gemma2", "gemma3", "cohere2", "olmo2",
        "starcoder2", "phi", "codegen", "gpt_bigcode", "gpt_oss",
        "deepseek_v3", "gemma4_text", "lfm2", "granitemoehybrid",
        "nemotron_h", "falcon_h1", "qwen3_next"]


class Zoo:
    """Families, each saved, imported and exported (validated at short lengths) the first time a test asks for it,
    once per run: one tiny export per family, shared by all its checks.  Under pytest-xdist the
    exports live in the run's common temp folder, built by whichever worker asks first (a file lock per family) and
    read by the other, so the families' tests spread over both workers; each worker saves its own Hugging Face
    folder and model (seeded, so the same weights the export came from)."""

    def __init__(self, root, shared=None, validation_max_length=8, external=(), families=()):
        self.root, self.shared, self.saved, self.built = root, shared or root, {}, {}
        self.validation_max_length, self.external, self.families = validation_max_length, set(external), families

    def items(self):
        """(family, entry) for the families this zoo was made with, each built on first use."""
        self.prefetch(self.families)
        return [(family, self[family]) for family in self.families]

    def prefetch(self, families):
        """Each family built or read, first those no other worker is building (a lock not taken at once is passed
        over), then the rest: two workers asking for the same families at once build half each, instead of one
        waiting on the other's lock family after family."""
        for blocking in (False, True):
            for family in families:
                self._entry(family, blocking)

    def saved_folder(self, family):
        """(the Hugging Face folder, the transformers model), saved once per worker; no export."""
        if family not in self.saved:
            from tests.hf.helpers import save_family

            folder = self.root / "hf" / family
            self.saved[family] = folder, save_family(family, folder)
        return self.saved[family]

    def __getitem__(self, family):
        return self._entry(family, blocking=True)

    def _entry(self, family, blocking):
        """The family's entry, built (or read) under its lock; None when blocking is False and another worker holds
        the lock."""
        if family not in self.built:
            import torch
            from filelock import FileLock

            from export.hf import import_artifact
            from tests.conftest import _report_of

            folder, hf = self.saved_folder(family)
            artifact, done = self.shared / "artifacts" / family, self.shared / f"{family}.done"
            (self.shared / "artifacts").mkdir(parents=True, exist_ok=True)
            lock = FileLock(str(self.shared / f"{family}.lock"))
            try:
                lock.acquire(blocking=blocking)
            except TimeoutError:  # filelock's Timeout: another worker is building it
                return None
            try:
                if done.exists():
                    report, info = _report_of(artifact), None
                else:
                    report, info = import_artifact(folder, artifact, validation_max_length=self.validation_max_length,
                                                   external_data=family in self.external)
                    done.write_text("")
            finally:
                lock.release()
            self.built[family] = {"folder": folder, "hf": hf, "artifact": artifact, "report": report, "info": info}
            torch.set_num_threads(torch_threads())
        return self.built[family]


@pytest.fixture(scope="session")
def hf_zoo(tmp_path_factory, worker_id):
    shared = None if worker_id == "master" else tmp_path_factory.getbasetemp().parent / "zoo"
    return Zoo(tmp_path_factory.mktemp("zoo"), shared)
