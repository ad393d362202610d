"""Imported families against transformers' eager forward, the independent reference: posenc's PyTorch model and
the exported graph in onnxruntime, on a left-padded batch of 3 at lengths 1, 7 and 200, through the KV cache, and
32 greedy tokens against generate().  Compared on real (unpadded) query rows: transformers gives a pad query a
uniform row, posenc zeros it."""

import json

import numpy as np
import onnxruntime as ort
import pytest
import torch

from model.hf import import_folder
from tests.conftest import torch_threads
from tests.emulated import ZEN3, assert_avx2_only, emulated
from tests.hf import float32, float64
from tests.hf.conftest import EXTERNAL, FAMILIES
from tests.hf.helpers import VOCAB


def batch(length: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """3 rows, left-padded: full, about half, one token."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (3, length), generator=g)
    mask = torch.ones(3, length, dtype=torch.int64)
    mask[1, : length // 2] = 0
    mask[2, : length - 1] = 0
    return ids, mask


def hf_forward(family, hf, ids, mask, past=None):
    kw = {}
    if family != "bloom":  # arange positions otherwise; BLOOM builds ALiBi from the mask itself
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        kw["position_ids"] = pos[:, -ids.shape[1]:]
    with torch.no_grad():
        return hf(input_ids=ids, attention_mask=mask, output_attentions=True, use_cache=True, past_key_values=past,
                  **kw)


def real_rows(mask: torch.Tensor, new: int) -> torch.Tensor:
    return mask[:, -new:].bool()  # (B, T) queries that are real tokens


class Graph:
    def __init__(self, folder):
        opts = ort.SessionOptions()
        opts.log_severity_level = 3
        # this xdist worker's share of the cores, threads that sleep between runs: the spinning default took the
        # cores from the other worker (and from the transformers reference each check runs next)
        opts.intra_op_num_threads = torch_threads()
        opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
        self.session = ort.InferenceSession(str(folder / "model.onnx"), opts, providers=["CPUExecutionProvider"])
        self.meta = json.loads((folder / "model.json").read_text())
        self.outputs = [o["name"] for o in self.meta["outputs"]]
        self.carried = [s["input"] for s in self.meta["state"]]

    def empty(self, b: int) -> list[np.ndarray]:
        s = self.meta["sizes"]  # keys and values of length 0; a fixed-size state (a mixer's) of zeros
        return [np.zeros((b, s["n_kv_heads"], 0, s["head_dim"]) if c["sequence_axis"] is not None else
                         (b, *c["shape"][1:]), np.float32) for c in self.meta["state"]]

    def run(self, ids, mask, past):
        feeds = {"input_ids": np.asarray(ids), "attention_mask": np.asarray(mask),
                 **dict(zip(self.carried, past, strict=True))}
        out = self.session.run(self.outputs, feeds)
        return torch.from_numpy(out[0]), torch.from_numpy(out[1]), out[2:]


def compare(ref, logits, attentions, mask, new, tol_logits, tol_attn):
    real = real_rows(mask, new)
    d_logits = (ref.logits - logits)[real].abs().max().item()
    d_attn = 0.0
    for layer, a in enumerate(ref.attentions):
        b = attentions[:, layer]
        d_attn = max(d_attn, (a - b).permute(0, 2, 1, 3)[real].abs().max().item())
    assert d_logits <= tol_logits and d_attn <= tol_attn, (d_logits, d_attn)
    return d_logits, d_attn


@pytest.fixture(scope="module")
def torch_models(hf_families):
    """Each family's saved folder imported into posenc's PyTorch model (no export needed)."""
    return {f: import_folder(hf_families.saved_folder(f)[0])[0] for f in FAMILIES}


@pytest.mark.numerics
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("length", [1, 7, 200])
def test_pytorch_model_equals_transformers(hf_families, torch_models, family, length):
    """In float64 (tests/hf/float64.py): transformers runs each row alone, posenc the left-padded batch."""
    ids, mask = batch(length)
    hf64 = float64.double(hf_families.saved_folder(family)[1])
    refs = float64.rows_alone(lambda hf, i, m: hf_forward(family, hf, i, m), hf64, ids, mask)
    with torch.no_grad():
        out = float64.double(torch_models[family])(ids, mask)
    float64.compare(family, refs, out.logits, out.attentions, mask)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("length", [1, 7, 200])
def test_onnx_graph_equals_transformers(hf_families, family, length):
    graph = Graph(hf_families[family]["artifact"])
    ids, mask = batch(length, seed=1)
    hf = hf_families[family]["hf"]
    ref = hf_forward(family, hf, ids, mask)
    logits, attentions, _ = graph.run(ids, mask, graph.empty(3))
    compare(ref, logits, attentions, mask, length, *float32.tolerances(hf.config, ref.logits, length))


def test_onnx_graphs_equal_transformers_on_an_emulated_avx2_cpu(hf_families, tmp_path):
    """The same parity with onnxruntime's kernels those of an AMD Zen 3 (AVX2, no AVX-512, no VNNI), whatever this
    machine has: the graphs run under qemu's emulated CPU (tests/emulated.py), transformers here, 200 positions."""
    hf_families.prefetch(FAMILIES)
    ids, mask = batch(200, seed=1)
    np.savez(tmp_path / "batch.npz", ids=ids.numpy(), mask=mask.numpy())
    pairs = [str(p) for f in FAMILIES for p in (hf_families[f]["artifact"], tmp_path / f"{f}.npz")]
    res = emulated(ZEN3, "-m", "tests.direct", "exact", tmp_path / "batch.npz", *pairs)
    assert res.returncode == 0, res.stderr[-2000:]
    for family in FAMILIES:
        out = np.load(tmp_path / f"{family}.npz")
        assert_avx2_only(out["features"])
        hf = hf_families[family]["hf"]
        ref = hf_forward(family, hf, ids, mask)
        compare(ref, torch.from_numpy(out["logits"]), torch.from_numpy(out["attentions"]), mask, 200,
                *float32.tolerances(hf.config, ref.logits, 200))


@pytest.mark.parametrize("family", FAMILIES)
def test_onnx_kv_cache_steps_equal_transformers_cache(hf_families, family):
    hf, graph = hf_families[family]["hf"], Graph(hf_families[family]["artifact"])
    ids, mask = batch(9, seed=2)
    ref = hf_forward(family, hf, ids, mask)
    logits, attentions, past = graph.run(ids, mask, graph.empty(3))
    compare(ref, logits, attentions, mask, 9, *float32.tolerances(hf.config, ref.logits, 9))
    hf_past = ref.past_key_values
    g = torch.Generator().manual_seed(3)
    for _ in range(3):
        step = torch.randint(0, VOCAB, (3, 1), generator=g)
        mask = torch.cat([mask, torch.ones(3, 1, dtype=torch.int64)], dim=1)
        ref = hf_forward(family, hf, step, mask, past=hf_past)
        hf_past = ref.past_key_values
        logits, attentions, past = graph.run(step, mask, past)
        compare(ref, logits, attentions, mask, 1, *float32.tolerances(hf.config, ref.logits, mask.shape[1]))


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_tokens_equal_transformers_generate(hf_families, family):
    hf, graph = hf_families[family]["hf"], Graph(hf_families[family]["artifact"])
    prompt = torch.randint(0, VOCAB, (1, 6), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = hf.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=32,
                           min_new_tokens=32, pad_token_id=0)[0, 6:].tolist()
    got, cur, mask, past = [], prompt.numpy(), np.ones((1, 6), np.int64), graph.empty(1)
    for _ in range(32):
        logits, _, past = graph.run(cur, mask, past)
        got.append(int(logits[0, -1].argmax()))
        cur, mask = np.array([[got[-1]]]), np.concatenate([mask, np.ones((1, 1), np.int64)], axis=1)
    assert got == want


@pytest.mark.parametrize("family", FAMILIES)
def test_artifact_carries_the_tokenizer_and_validates(hf_families, family):
    from tokenizers import Tokenizer

    from export import artifact

    entry = hf_families[family]
    folder = entry["artifact"]
    assert entry["report"].passed, entry["report"].format_table()
    manifest = artifact.verify(folder)
    assert "tokenizer.json" in manifest["files"]
    assert ("model.onnx.data" in manifest["files"]) == (family == EXTERNAL)  # weights outside the protobuf
    assert meta_external(folder) == ("model.onnx.data" if family == EXTERNAL else None)
    assert (folder / "tokenizer.json").read_bytes() == (entry["folder"] / "tokenizer.json").read_bytes()
    meta = json.loads((folder / "model.json").read_text())
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    assert meta["tokenizer"] == {"type": "huggingface-tokenizers", "file": "tokenizer.json",
                                 "vocab_size": tok.get_vocab_size(), "bos_token_id": 0, "eos_token_id": 0,
                                 "eos_token_ids": [0]}
    assert meta["sizes"]["vocab_size"] == VOCAB > tok.get_vocab_size()  # embedding rows may exceed the tokenizer
    assert meta["family"] == family and meta["source"]["kind"] == "huggingface"
    assert meta["max_positions"] == (256 if family == "gpt2" else None)
    ids = tok.encode("def f(x): return x  # 中文").ids
    assert ids and max(ids) < meta["sizes"]["vocab_size"]


def meta_external(folder):
    return json.loads((folder / "model.json").read_text()).get("onnx_external_data")


def test_external_data_and_tokenizer_are_covered_by_the_manifest(hf_families, tmp_path):
    import shutil

    from export import artifact
    from export.errors import ArtifactError

    src = hf_families[EXTERNAL]["artifact"]
    assert (src / "model.onnx").stat().st_size < (src / "model.onnx.data").stat().st_size
    flipped = tmp_path / "flipped"
    shutil.copytree(src, flipped)
    data = bytearray((flipped / "model.onnx.data").read_bytes())
    data[len(data) // 2] ^= 0x10
    (flipped / "model.onnx.data").write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match="model.onnx.data does not match"):
        artifact.verify(flipped)
    unlisted = tmp_path / "unlisted"
    shutil.copytree(src, unlisted)
    manifest = json.loads((unlisted / "manifest.json").read_text())
    del manifest["files"]["tokenizer.json"]
    (unlisted / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match="does not list tokenizer.json"):
        artifact.verify(unlisted)


def test_the_worker_loader_accepts_external_data_and_the_tokenizer(hf_families):
    """service.artifacts (torch-free) verifies every manifest file, model.onnx.data and tokenizer.json included, and
    onnxruntime reads the external data beside model.onnx."""
    from service.artifacts import load_artifact

    folder = hf_families[EXTERNAL]["artifact"]
    loaded = load_artifact(folder, threads=1)
    graph = Graph(folder)
    ids, mask = batch(7)
    logits, _, _ = graph.run(ids, mask, graph.empty(3))
    feeds = {"input_ids": ids.numpy(), "attention_mask": mask.numpy(), **dict(zip(graph.carried, graph.empty(3),
                                                                                 strict=True))}
    assert np.array_equal(loaded.session.run(["logits"], feeds)[0], logits.numpy())
