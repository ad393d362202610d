"""Architecture as data: each config value changes the model the way its family needs, and the properties every
model must hold (cached decoding, left padding) hold for every combination imported families use."""

import pytest
import torch

from model.attention import Positions
from model.config import ModelConfig
from model.layers import GatedMLP, RMSNorm
from model.transformer import Transformer
from model.variants.rope import apply_rope, rope_angles
from tests.model.helpers import left_pad

SHAPES = {
    "llama": dict(variant="rope", norm="rmsnorm", mlp="gated", activation="silu", n_kv_heads=2, qkv_bias=False,
                  out_bias=False, mlp_bias=False, tie_head=False, d_head=24),
    "neox": dict(variant="rope", rope_fraction=0.25, parallel_residual=True, tie_head=False),
    "interleaved": dict(variant="rope", rope_pairing="interleaved", rope_fraction=0.5),
    "bloom": dict(variant="alibi", embed_norm=True, activation="gelu_tanh"),
    "gpt2": dict(variant="learned", activation="gelu_tanh", context=40),
}


def model_for(shape: str, seed: int = 0, **extra) -> Transformer:
    torch.manual_seed(seed)
    cfg = ModelConfig(**{"vocab_size": 300, "d_model": 64, "n_heads": 4, "n_layers": 2, "d_mlp": 96, "context": 20,
                         **SHAPES[shape], **extra})
    model = Transformer(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    return model.eval()


@pytest.mark.parametrize("shape", SHAPES)
def test_cached_decoding_and_left_padding(shape):
    model = model_for(shape)
    ids = torch.randint(0, 300, (1, 12), generator=torch.Generator().manual_seed(1))
    full = model(ids)
    out = model(ids[:, :5])
    logits, past = [out.logits], out.presents
    for t in range(5, 12):
        step = model(ids[:, t:t + 1], past_key_values=past)
        logits.append(step.logits)
        past = step.presents
    assert torch.allclose(torch.cat(logits, 1), full.logits, atol=1e-4, rtol=0)
    assert past[0][0].shape[1] == model.cfg.kv_heads  # the cache holds kv heads, not query heads
    rows = [ids[0].tolist(), ids[0, :7].tolist()]
    batch_ids, mask = left_pad(rows)
    batch = model(batch_ids, mask)
    alone = model(torch.tensor([rows[1]]))
    assert torch.allclose(batch.logits[1, 5:], alone.logits[0], atol=1e-4, rtol=0)


def test_grouped_kv_heads_equal_the_repeated_multi_head_model():
    gqa = model_for("llama")
    cfg = gqa.cfg.replace(n_kv_heads=0)
    mha = Transformer(cfg).eval()
    state = dict(gqa.state_dict())
    H, KVH, Dh = cfg.n_heads, gqa.cfg.kv_heads, cfg.head_dim
    for i in range(cfg.n_layers):
        w = state[f"blocks.{i}.attn.qkv.weight"]
        q, k, v = w[:H * Dh], w[H * Dh:(H + KVH) * Dh], w[(H + KVH) * Dh:]
        rep = [t.view(KVH, Dh, -1).repeat_interleave(H // KVH, 0).reshape(H * Dh, -1) for t in (k, v)]
        state[f"blocks.{i}.attn.qkv.weight"] = torch.cat([q, *rep])
    mha.load_state_dict(state)
    ids = torch.randint(0, 300, (2, 9))
    a, b = gqa(ids), mha(ids)
    assert torch.allclose(a.logits, b.logits, atol=1e-5) and torch.allclose(a.attentions, b.attentions, atol=1e-6)


def test_partial_rope_leaves_the_tail_and_interleaved_is_a_permutation_of_half_split():
    cfg = ModelConfig(d_model=64, n_heads=4, rope_fraction=0.5)  # head_dim 16, 8 rotated dims
    x = torch.randn(1, 1, 3, 16)
    c, s = rope_angles(torch.tensor([[0, 5, 9]]), cfg)
    y = apply_rope(x, c, s)
    assert torch.equal(y[..., 8:], x[..., 8:]) and not torch.allclose(y[..., 1:, :8], x[..., 1:, :8])
    inter = cfg.replace(rope_pairing="interleaved")
    ci, si = rope_angles(torch.tensor([[0, 5, 9]]), inter)
    perm = torch.tensor([0, 4, 1, 5, 2, 6, 3, 7])  # half-split dims (k, k + 4) placed at (2k, 2k + 1)
    xi = x.clone()
    xi[..., :8] = x[..., perm]
    yi = apply_rope(xi, ci, si, interleaved=True)
    assert torch.allclose(yi[..., :8], y[..., perm], atol=1e-6) and torch.equal(yi[..., 8:], x[..., 8:])


def test_rmsnorm_gated_mlp_parallel_residual_and_untied_head_are_what_they_say():
    x = torch.randn(2, 3, 8)
    n = RMSNorm(8, 1e-6)
    assert torch.allclose(n(x), x / x.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt(), atol=1e-6)
    cfg = ModelConfig(d_model=8, n_heads=2, d_mlp=16, mlp="gated", activation="silu")
    mlp = GatedMLP(cfg)
    want = mlp.down(torch.nn.functional.silu(mlp.gate(x)) * mlp.up(x))
    assert torch.equal(mlp(x), want)
    neox = model_for("neox")
    ids = torch.randint(0, 300, (1, 4))
    out = neox(ids)
    # the whole forward by hand: parallel residual (both branches read the block input), untied head
    x = neox.tok(ids)
    for i, block in enumerate(neox.blocks):
        attn = block.attn
        q = torch.tensor([[0, 1, 2, 3]])
        allowed = torch.ones(4, 4).tril().bool()
        mask = torch.zeros(4, 4).masked_fill(~allowed, torch.finfo(torch.float32).min)[None, None]
        a, _, _ = attn(block.ln1(x), Positions(neox.pos, q, q, mask, torch.ones(1, 1, 4, 1)), neox.empty_past(1)[i])
        x = x + a + block.mlp(block.ln2(x))
    assert torch.allclose(neox.head(neox.ln_f(x)), out.logits, atol=1e-5)
    assert not hasattr(model_for("gpt2"), "head")  # tied: logits use the token embedding
    assert "ln_emb.weight" in model_for("bloom").state_dict()
