"""Proportional RoPE (p-RoPE, transformers' rope_type "proportional", Gemma 4's global layers) against transformers:
its frequencies against transformers' own `_compute_proportional_rope_parameters`, a tiny LLaMA folder that names it
imported into posenc's PyTorch model (float64) and exported (float32 onnxruntime) against transformers' eager
forward on a left-padded batch below and past the trained length, and its refusals.  LlamaRotaryEmbedding takes
its frequencies from ROPE_INIT_FUNCTIONS[rope_type], and proportional's span the whole head, so LLaMA runs it."""

from __future__ import annotations

import json

import pytest
import torch

from export.__main__ import main
from model.config import ModelConfig
from model.hf import import_folder
from tests.hf import float32, float64
from tests.hf.helpers import VOCAB, perturb, tokenizer_json
from tests.hf.test_hf_parity import Graph, batch, compare, hf_forward

pytestmark = pytest.mark.xdist_group("proportional-rope")  # one worker saves the folders once (make test)

L0 = 32  # max_position_embeddings: the length the folders name as trained
THETA = 100.0  # a small base, so the turning pairs span fast and slow wavelengths over L0
# Gemma 4's form (partial_rotary_factor inside rope_parameters, no factor), and the top-level factor with a divisor
FOLDERS = {"quarter": ({"rope_type": "proportional", "rope_theta": THETA, "partial_rotary_factor": 0.25}, {}),
           "half-factor": ({"rope_type": "proportional", "rope_theta": THETA, "factor": 2.0},
                           {"partial_rotary_factor": 0.5})}


def llama_config(rope: dict, top: dict):
    import transformers as tf

    return tf.LlamaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                          head_dim=16, intermediate_size=48, max_position_embeddings=L0, rms_norm_eps=1e-6,
                          rope_parameters=dict(rope), tie_word_embeddings=False, vocab_size=VOCAB, bos_token_id=0,
                          eos_token_id=0, **top)


@pytest.mark.parametrize("head_dim, fraction, factor, theta", [
    (16, 0.25, 1.0, 100.0), (16, 0.5, 2.0, 10000.0), (32, 0.3, 1.0, 1e6), (24, 1.0, 4.0, 500.0), (8, 0.1, 1.0, 1e4)])
def test_frequencies_equal_transformers_compute_proportional(head_dim, fraction, factor, theta):
    """Bit for bit: posenc's float32 frequencies and transformers' function on the same config, zeros included."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from model import rope_scaling

    rope = {"rope_type": "proportional", "rope_theta": theta, "partial_rotary_factor": fraction, "factor": factor}
    hf = llama_config(rope, {})
    hf.head_dim = head_dim
    want, want_factor = ROPE_INIT_FUNCTIONS["proportional"](hf)
    cfg = ModelConfig(variant="rope", d_model=32, n_heads=2, d_head=head_dim, rope_base=theta, rope_fraction=fraction,
                      rope_scaling="proportional", rope_factor=factor)
    got = rope_scaling.inv_freq(cfg)
    assert cfg.rope_dim == head_dim and got.dtype == torch.float32 and torch.equal(got, want), (got, want)
    assert rope_scaling.attention_factor(cfg) == want_factor == 1.0
    assert int((got == 0).sum()) == head_dim // 2 - int(fraction * head_dim // 2)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Per form: the saved folder, transformers' float32 model and the exported artifact."""
    import tokenizers
    import transformers as tf

    out = {}
    for name, (rope, top) in FOLDERS.items():
        root = tmp_path_factory.mktemp(name)
        torch.manual_seed(0)
        hf = tf.LlamaForCausalLM(llama_config(rope, top)).eval()
        hf.config._attn_implementation = "eager"
        perturb(hf, 0)
        hf.save_pretrained(root / "hf", safe_serialization=True)
        tf.PreTrainedTokenizerFast(tokenizer_object=tokenizers.Tokenizer.from_str(tokenizer_json())).save_pretrained(
            root / "hf")
        assert main(["--from-hf", str(root / "hf"), "--out", str(root / "art"), "--validate-max-length", "8",
                     "--interventions", "off"]) == 0
        out[name] = {"folder": root / "hf", "hf": hf, "artifact": root / "art"}
    return out


@pytest.mark.parametrize("name", FOLDERS)
@pytest.mark.parametrize("length", [1, 7, L0 + 13])
def test_pytorch_model_equals_transformers(folders, name, length):
    """float64: transformers runs each row alone, posenc's imported model the left-padded batch."""
    model = import_folder(folders[name]["folder"])[0]
    assert model.cfg.rope_scaling == "proportional" and model.cfg.rope_dim == 16
    ids, mask = batch(length)
    hf64 = float64.double(folders[name]["hf"])
    refs = float64.rows_alone(lambda hf, i, m: hf_forward("llama", hf, i, m), hf64, ids, mask)
    with torch.no_grad():
        out = float64.double(model)(ids, mask)
    print(name, length, float64.compare("llama", refs, out.logits, out.attentions, mask))


@pytest.mark.parametrize("name", FOLDERS)
@pytest.mark.parametrize("length", [1, 7, L0 + 13])
def test_onnx_graph_equals_transformers(folders, name, length):
    hf, graph = folders[name]["hf"], Graph(folders[name]["artifact"])
    assert graph.meta["config"]["rope_scaling"] == "proportional"
    ids, mask = batch(length, seed=1)
    ref = hf_forward("llama", hf, ids, mask)
    logits, attentions, _ = graph.run(ids, mask, graph.empty(3))
    print(name, length, compare(ref, logits, attentions, mask, length,
                                *float32.tolerances(hf.config, ref.logits, length)))


def test_the_unturned_pairs_matter_and_stay_unrotated(folders):
    """The zero frequencies leave their pairs unrotated: the same folder read as plain RoPE over the whole head
    answers differently, so the comparisons above can tell the two apart."""
    from model.variants.rope import Rope

    cfg = import_folder(folders["quarter"]["folder"])[0].cfg
    q = torch.randn(1, 2, 9, 16, generator=torch.Generator().manual_seed(0))
    rq, _ = Rope(cfg).rotate(q, q, torch.arange(9)[None])
    half = 8
    still = [i for i in range(16) if i % half >= 2]  # pairs 2..7: dims (k, k + 8)
    assert torch.equal(rq[..., still], q[..., still]) and not torch.equal(rq[..., :2], q[..., :2])


@pytest.mark.parametrize("rope, message", [
    ({"rope_type": "proportional", "rope_theta": THETA, "partial_rotary_factor": 0.25, "factor": 0.5},
     "rope_parameters.factor = 0.5 must be >= 1"),
    ({"rope_type": "proportional", "rope_theta": THETA, "partial_rotary_factor": 1.5}, "rope_fraction must be in"),
    ({"rope_type": "proportional", "rope_theta": THETA, "factor": "two"}, "rope_parameters.factor = 'two' must be"),
    ({"rope_type": "proportional", "rope_theta": THETA, "original_max_position_embeddings": 16},
     "rope_parameters.original_max_position_embeddings is not supported with rope_type 'proportional'"),
])
def test_refusals_name_the_field_exit_2_and_write_nothing(folders, tmp_path, capsys, rope, message):
    out = tmp_path / "out"
    code = main(["--from-hf", str(folders["quarter"]["folder"]), "--out", str(out), "--rope-scaling",
                 json.dumps(rope)])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and message in err, err
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_the_config_names_the_same_whole_head_types_as_the_registry():
    """model/config.py stays free of torch by naming the whole-head types itself: it must name the registry's."""
    from model.config import WHOLE_HEAD_SCALINGS
    from model.rope_scaling.base import TYPES

    assert WHOLE_HEAD_SCALINGS == {name for name, t in TYPES.items() if t.whole_head}
