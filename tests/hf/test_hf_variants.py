"""posenc's own positional variants tied to independent implementations where the math is the same: its rope
against LLaMA's and GPT-NeoX's rotary functions, its alibi against BLOOM's build_alibi_tensor, and whole default-
architecture posenc models (learned, rope) written into transformers' GPT-2 and GPT-NeoX and run there."""

import pytest
import torch
import transformers as tf
from transformers.models.bloom.modeling_bloom import build_alibi_tensor
from transformers.models.gpt_neox import modeling_gpt_neox as neox
from transformers.models.llama import modeling_llama as llama

from model.config import ModelConfig
from model.transformer import positions_from_mask
from model.variants.alibi import Alibi, alibi_slopes
from model.variants.rope import Rope
from tests.model.helpers import left_pad, tiny_model


def positions(*rows):
    return torch.tensor(rows)


@pytest.mark.parametrize("hf_rope, ours", [
    ({"rope_type": "default", "rope_theta": 10000.0}, {}),
    ({"rope_type": "default", "rope_theta": 500000.0}, {"rope_base": 500000.0}),
    ({"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}, {"rope_scaling": "linear", "rope_factor": 4.0}),
])
def test_rope_equals_llama_rotary(hf_rope, ours):
    cfg = ModelConfig(variant="rope", **ours)  # posenc's default: d_model 128, 4 heads, head_dim 32
    hf_cfg = tf.LlamaConfig(hidden_size=128, num_attention_heads=4, rope_parameters=hf_rope)
    rotary = llama.LlamaRotaryEmbedding(hf_cfg)
    pos = positions([0, 1, 2, 3, 517, 1023, 4095])
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 4, 7, 32, generator=g), torch.randn(1, 4, 7, 32, generator=g)
    cos, sin = rotary(q, pos)
    want = llama.apply_rotary_pos_emb(q, k, cos, sin)
    got = Rope(cfg).rotate(q, k, pos)
    for a, b in zip(got, want, strict=True):
        assert torch.allclose(a, b, atol=1e-6, rtol=0), (a - b).abs().max()
    # and honest: a wrong base would not pass
    assert not torch.allclose(Rope(cfg.replace(rope_base=20000.0)).rotate(q, k, pos)[0], want[0], atol=1e-3)


def test_partial_rope_equals_gpt_neox_rotary():
    cfg = ModelConfig(variant="rope", rope_fraction=0.25)  # 8 of 32 dims rotate, as Pythia's rotary_pct
    hf_cfg = tf.GPTNeoXConfig(hidden_size=128, num_attention_heads=4, rotary_pct=0.25)
    rotary = neox.GPTNeoXRotaryEmbedding(hf_cfg)
    pos = positions([0, 5, 99, 2048])
    q, k = torch.randn(2, 4, 4, 32), torch.randn(2, 4, 4, 32)
    cos, sin = rotary(q, pos)
    want = neox.apply_rotary_pos_emb(q, k, cos, sin)
    got = Rope(cfg).rotate(q, k, pos)
    for a, b in zip(got, want, strict=True):
        assert torch.allclose(a, b, atol=1e-6, rtol=0)


@pytest.mark.parametrize("heads", [1, 2, 3, 4, 6, 8, 12, 16, 24])
def test_alibi_slopes_equal_bloom(heads):
    mask = torch.ones(1, 2, dtype=torch.int64)  # key position 1: the tensor holds slope x 1
    bloom = build_alibi_tensor(mask, heads, torch.float32).view(heads, 2)[:, 1]
    ours = torch.tensor(alibi_slopes(heads), dtype=torch.float32)
    assert torch.allclose(ours, bloom, rtol=1e-6, atol=0)  # float32 powers vs Python's: the last bit may differ


@pytest.mark.parametrize("heads", [4, 6])
def test_alibi_attention_equals_bloom_under_left_padding(heads):
    """BLOOM adds slope x key position (from the mask); posenc -slope x (i - j): a per-row constant apart, so the
    softmax is the same, padded rows and cached queries included."""
    ids, mask = left_pad([[1] * 9, [1] * 4, [1] * 7])
    B, S = mask.shape
    variant = Alibi(ModelConfig(variant="alibi", d_model=16 * heads, n_heads=heads))
    k_pos = positions_from_mask(mask)
    scores = torch.randn(B, heads, S, S, generator=torch.Generator().manual_seed(heads))
    allowed = torch.ones(S, S).tril().bool()[None, None] & mask.bool()[:, None, None, :]
    blocked = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)
    ours = torch.softmax(scores + variant.score_bias(None, k_pos, k_pos) + blocked, -1)
    bloom = torch.softmax(scores + build_alibi_tensor(mask, heads, torch.float32).view(B, heads, 1, S) + blocked, -1)
    real = mask.bool()[:, None, :, None].expand_as(ours)
    assert torch.allclose(ours[real], bloom[real], atol=1e-6, rtol=0)
    # the last query alone (a cached decode step) sees the same row
    last = torch.softmax(scores[:, :, -1:] + variant.score_bias(None, k_pos[:, -1:], k_pos) + blocked[:, :, -1:], -1)
    assert torch.allclose(last, bloom[:, :, -1:], atol=1e-6)


def gpt2_from_posenc(model):
    """posenc's default-architecture learned model written into GPT2LMHeadModel (Conv1D stores (in, out))."""
    c = model.cfg
    hf = tf.AutoModelForCausalLM.from_config(tf.GPT2Config(
        vocab_size=c.vocab_size, n_embd=c.d_model, n_layer=c.n_layers, n_head=c.n_heads, n_inner=c.d_mlp,
        n_positions=c.context, activation_function="gelu", layer_norm_epsilon=c.layer_norm_eps,
        bos_token_id=None, eos_token_id=None),
        attn_implementation="eager").eval()
    s = model.state_dict()
    state = {"transformer.wte.weight": s["tok.weight"], "transformer.wpe.weight": s["pos.table.weight"],
             "transformer.ln_f.weight": s["ln_f.weight"], "transformer.ln_f.bias": s["ln_f.bias"]}
    for i in range(c.n_layers):
        h, b = f"transformer.h.{i}.", f"blocks.{i}."
        for hf_name, ours in (("attn.c_attn", "attn.qkv"), ("attn.c_proj", "attn.out"), ("mlp.c_fc", "mlp.0"),
                              ("mlp.c_proj", "mlp.2")):
            state[h + hf_name + ".weight"] = s[b + ours + ".weight"].t()
            state[h + hf_name + ".bias"] = s[b + ours + ".bias"]
        for hf_name, ours in (("ln_1", "ln1"), ("ln_2", "ln2")):
            for part in (".weight", ".bias"):
                state[h + hf_name + part] = s[b + ours + part]
    missing, unexpected = hf.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}  # tied to wte
    hf.tie_weights()
    return hf


def neox_from_posenc(model):
    """posenc's default-architecture rope model as GPT-NeoX: rotary_pct 1, sequential residual, exact GELU, tied."""
    c = model.cfg
    hf = tf.AutoModelForCausalLM.from_config(tf.GPTNeoXConfig(
        vocab_size=c.vocab_size, hidden_size=c.d_model, num_hidden_layers=c.n_layers, num_attention_heads=c.n_heads,
        intermediate_size=c.d_mlp, rotary_pct=1.0, rotary_emb_base=c.rope_base, use_parallel_residual=False,
        hidden_act="gelu", tie_word_embeddings=True, layer_norm_eps=c.layer_norm_eps, max_position_embeddings=4096,
        bos_token_id=None, eos_token_id=None),
        attn_implementation="eager").eval()
    s = model.state_dict()

    def per_head(t):  # [Q | K | V] -> GPT-NeoX's (heads, 3, head_dim) layout
        return t.reshape(3, c.n_heads, -1, *t.shape[1:]).transpose(0, 1).reshape(t.shape)

    state = {"gpt_neox.embed_in.weight": s["tok.weight"], "gpt_neox.final_layer_norm.weight": s["ln_f.weight"],
             "gpt_neox.final_layer_norm.bias": s["ln_f.bias"]}
    for i in range(c.n_layers):
        h, b = f"gpt_neox.layers.{i}.", f"blocks.{i}."
        names = {"attention.query_key_value": "attn.qkv", "attention.dense": "attn.out",
                 "mlp.dense_h_to_4h": "mlp.0", "mlp.dense_4h_to_h": "mlp.2", "input_layernorm": "ln1",
                 "post_attention_layernorm": "ln2"}
        for hf_name, ours in names.items():
            for part in ("weight", "bias"):
                t = s[f"{b}{ours}.{part}"]
                state[f"{h}{hf_name}.{part}"] = per_head(t) if ours == "attn.qkv" else t
    missing, unexpected = hf.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    hf.tie_weights()
    return hf


@pytest.mark.parametrize("variant, convert, length", [("learned", gpt2_from_posenc, 16),
                                                      ("rope", neox_from_posenc, 64)])
def test_posenc_default_model_is_the_transformers_model(variant, convert, length):
    """The same weights in both libraries give the same logits and attention, left padding included: posenc's
    learned model is GPT-2 (with exact GELU) and its rope model is GPT-NeoX with full rotary and sequential
    residuals.  A positional formula off anywhere would show here."""
    # 2 heads of 16 dims: 1/sqrt(16) is exact, so scaling q (posenc) or the scores (transformers) rounds alike and
    # the comparison is tight (with 8-dim heads that rounding alone reaches 1.5e-6 in a probability)
    model = tiny_model(variant, n_heads=2)
    hf = convert(model)
    rows = [torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(n)).tolist()
            for n in (length, length // 2, 3)]
    ids, mask = left_pad(rows)
    with torch.no_grad():
        ours = model(ids, mask)
        ref = hf(input_ids=ids, attention_mask=mask, position_ids=positions_from_mask(mask), output_attentions=True)
    real = mask.bool()
    assert torch.allclose(ours.logits[real], ref.logits[real], atol=1e-5, rtol=0)
    for layer, a in enumerate(ref.attentions):
        got = ours.attentions[:, layer].permute(0, 2, 1, 3)[real]
        assert torch.allclose(got, a.permute(0, 2, 1, 3)[real], atol=1e-6, rtol=0)
