"""ARCHITECTURE.md section 8 is true: the StarCoder2 example there, as written, is one module and one registry
entry, and with nothing else changed it imports a tiny random StarCoder2 equal to transformers' eager forward
(below, at and past its window, left-padded) and exports with parity.  posenc registers a starcoder2 module of its
own; these tests take it out of the registry or put the example in its place."""

import importlib.util
import re
import sys
from pathlib import Path

import pytest
import torch

from model.errors import ImportRefusedError
from model.hf import families, import_folder
from tests.hf.helpers import VOCAB, perturb, tokenizer_json
from tests.hf.test_hf_parity import batch, real_rows

ROOT = Path(__file__).resolve().parents[2]
WINDOW = 5


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    import tokenizers
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.Starcoder2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                              intermediate_size=64, max_position_embeddings=256, sliding_window=WINDOW,
                              vocab_size=VOCAB, bos_token_id=0, eos_token_id=0)
    hf = tf.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
    perturb(hf, 0)
    path = tmp_path_factory.mktemp("starcoder2")
    hf.save_pretrained(path, safe_serialization=True)
    tf.PreTrainedTokenizerFast(tokenizer_object=tokenizers.Tokenizer.from_str(tokenizer_json())).save_pretrained(path)
    return path, hf


@pytest.fixture
def starcoder2(tmp_path, monkeypatch):
    doc = (ROOT / "ARCHITECTURE.md").read_text()
    code = re.search(r"```python\n(# model/hf/families/starcoder2\.py\n.*?)```", doc, re.S).group(1)
    line = re.search(r"```python\n(REGISTRY = \(\.\.\., starcoder2\).*?)\n```", doc, re.S).group(1)
    assert "starcoder2" in line  # the registry entry the document shows
    path = tmp_path / "starcoder2_example.py"
    path.write_text(code)
    spec = importlib.util.spec_from_file_location("starcoder2_example", path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "starcoder2_example", module)
    spec.loader.exec_module(module)
    monkeypatch.setitem(families.FAMILIES, module.MODEL_TYPE, module.family)  # the registry entry
    return module


def test_the_folder_is_refused_until_the_family_is_registered(folder, monkeypatch):
    monkeypatch.delitem(families.FAMILIES, "starcoder2")  # posenc's own starcoder2 module out: the example stands in
    with pytest.raises(ImportRefusedError, match="model_type 'starcoder2' has no module"):
        import_folder(folder[0])


@pytest.mark.parametrize("length", [3, WINDOW, 20])
def test_the_example_imports_equal_to_transformers(starcoder2, folder, length):
    path, hf = folder
    model, info = import_folder(path)
    assert info["family"] == "starcoder2" and model.cfg.sliding_window == WINDOW
    ids, mask = batch(length)
    with torch.no_grad():
        ref = hf(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
                 output_attentions=True)
        out = model(ids, mask)
    real = real_rows(mask, length)
    assert (ref.logits - out.logits)[real].abs().max() <= 1e-4
    for layer, a in enumerate(ref.attentions):
        assert (a - out.attentions[:, layer]).permute(0, 2, 1, 3)[real].abs().max() <= 3e-5


def test_the_example_exports_with_parity(starcoder2, folder, tmp_path):
    from export.hf import import_artifact

    report, _ = import_artifact(folder[0], tmp_path / "starcoder2", validation_max_length=16)
    assert report.passed
