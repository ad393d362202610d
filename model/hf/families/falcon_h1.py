"""Falcon-H1 (TII): every layer is a hybrid, a Mamba-2 layer (model/ssm.py) beside grouped-query attention with
RoPE, both reading the same normed input and their outputs summed before the residual add, then a SwiGLU MLP.  Its
maximal-update multipliers are constants that scale linear maps, so they are folded into the weights: the
embedding (embedding_multiplier) and logits (lm_head_multiplier) multipliers stay model values, while
attention_in_multiplier and key_multiplier scale q/k/v and k, attention_out_multiplier the attention's output,
ssm_in_multiplier and ssm_multipliers (the mup vector over z, x, B, C and dt) in_proj's rows, ssm_out_multiplier
out_proj, and mlp_multipliers the gate and down projections.  The Mamba-2 output is y * silu(z) without
mamba_rms_norm, else RMS-normed by groups before (mamba_norm_before_gate) or after the gate.  The layer's maps are
its attention's; its Mamba-2 layer is served and decoded with its state but not drawn."""

from __future__ import annotations

from typing import Any

import torch

from model.config import LayerSpec
from model.hf.families.base import Fields, Mapping, final_norm_and_head
from model.hf.families.granitemoehybrid import mamba

MODEL_TYPE = "falcon_h1"


def family(f: Fields) -> tuple[dict[str, Any], Mapping]:
    n, heads, hidden = f.int("num_hidden_layers"), f.int("num_attention_heads"), f.int("hidden_size")
    f.refuse_present({"mamba_proj_bias": False, "projectors_bias": False, "hidden_act": "silu"})
    f.unclamped_time_steps()
    d_ssm = f.get("mamba_d_ssm", default=None)
    inner = d_ssm if d_ssm is not None else f.int("mamba_expand", default=2) * hidden
    ssm_heads = f.int("mamba_n_heads")
    head_dim = f.get("mamba_d_head", default="auto")
    head_dim = inner // ssm_heads if head_dim == "auto" else head_dim
    if head_dim * ssm_heads != inner:
        f.refuse("mamba_d_head", head_dim, f"mamba_n_heads x mamba_d_head = the Mamba-2 width ({inner})")
    multipliers = {name: list(f.get(name, default=None) or [1.0] * size)
                   for name, size in (("ssm_multipliers", 5), ("mlp_multipliers", 2))}
    for name, size in (("ssm_multipliers", 5), ("mlp_multipliers", 2)):
        if len(multipliers[name]) != size:
            f.refuse(name, multipliers[name], f"{size} numbers")
    norm = ("norm_then_gate" if f.get("mamba_norm_before_gate", default=True) else "gated") \
        if f.get("mamba_rms_norm", default=False) else "none"
    cfg = {"variant": "rope", "vocab_size": f.int("vocab_size"), "d_model": hidden, "n_layers": n, "n_heads": heads,
           "n_kv_heads": f.int("num_key_value_heads", default=heads),
           "d_head": f.int("head_dim", default=hidden // heads), "d_mlp": f.int("intermediate_size"),
           "context": f.int("max_position_embeddings", default=8192), "norm": "rmsnorm",
           "layer_norm_eps": f.number("rms_norm_eps", 1e-5), "mlp": "gated", "activation": "silu",
           "qkv_bias": bool(f.get("attention_bias", default=False)),
           "out_bias": bool(f.get("attention_bias", default=False)), "mlp_bias": bool(f.get("mlp_bias", default=False)),
           "tie_head": bool(f.get("tie_word_embeddings", default=False)),
           "embed_scale": f.number("embedding_multiplier", 1.0), "logit_scale": f.number("lm_head_multiplier", 1.0),
           "conv_kernel": f.int("mamba_d_conv", default=4), "conv_bias": bool(f.get("mamba_conv_bias", default=True)),
           "ssm_heads": ssm_heads, "ssm_head_dim": head_dim, "ssm_state": f.int("mamba_d_state"),
           "ssm_groups": f.int("mamba_n_groups", default=1), "ssm_norm": norm,
           "layers": [LayerSpec(beside="mamba2")] * n, **f.rope()}
    scale = {name: f.number(name, 1.0) for name in ("attention_in_multiplier", "key_multiplier",
                                                    "attention_out_multiplier", "ssm_in_multiplier",
                                                    "ssm_out_multiplier")}

    def weights(c, w):
        D = c.d_model
        yield "tok.weight", w.take("model.embed_tokens.weight", (c.vocab_size, D))
        for i in range(c.n_layers):
            h, b = f"model.layers.{i}.", f"blocks.{i}."
            yield from attention(c, w, h + "self_attn.", b + "attn.", scale)
            rows = mup_rows(c, multipliers["ssm_multipliers"]) * scale["ssm_in_multiplier"]
            for name, t in mamba(c, w, h + "mamba.", b + "beside."):
                if name.endswith("in_proj.weight"):
                    t = t * rows[:, None].to(t.dtype)
                elif name.endswith("out.weight"):
                    t = t * scale["ssm_out_multiplier"]
                yield name, t
            yield from mlp(c, w, h + "feed_forward.", b + "mlp.", multipliers["mlp_multipliers"])
            yield b + "ln1.weight", w.take(h + "input_layernorm.weight", (D,))
            yield b + "ln2.weight", w.take(h + "pre_ff_layernorm.weight", (D,))
        yield from final_norm_and_head(c, w, "model.final_layernorm")

    return cfg, weights


def mup_rows(c, ssm: list[float]) -> torch.Tensor:
    """in_proj's per-row multipliers (transformers' compute_mup_vector): z, x, B, C and dt each times its own."""
    P, GN, H = c.ssm_heads * c.ssm_head_dim, c.ssm_groups * c.ssm_state, c.ssm_heads
    return torch.cat([torch.full((size,), float(m)) for size, m in zip((P, P, GN, GN, H), ssm, strict=True)])


def attention(c, w, h: str, b: str, scale: dict[str, float]):
    """q, k, v read the input times attention_in_multiplier (k's output times key_multiplier too), fused into qkv;
    the output projection times attention_out_multiplier."""
    D, H, KVH, Dh = c.d_model, c.n_heads, c.kv_heads, c.head_dim
    into, key, out = scale["attention_in_multiplier"], scale["key_multiplier"], scale["attention_out_multiplier"]
    sizes = (("q_proj", H * Dh, 1.0), ("k_proj", KVH * Dh, key), ("v_proj", KVH * Dh, 1.0))
    yield b + "qkv.weight", torch.cat([w.take(f"{h}{n}.weight", (s, D)) * (m * into) for n, s, m in sizes])
    if c.qkv_bias:
        yield b + "qkv.bias", torch.cat([w.take(f"{h}{n}.bias", (s,)) * m for n, s, m in sizes])
    yield b + "out.weight", w.take(h + "o_proj.weight", (D, H * Dh)) * out
    if c.out_bias:
        yield b + "out.bias", w.take(h + "o_proj.bias", (D,)) * out


def mlp(c, w, h: str, b: str, multipliers: list[float]):
    """down(up(x) * silu(gate(x) * gate_multiplier)) * down_multiplier, the multipliers in gate and down."""
    D, F = c.d_model, c.d_mlp
    gate, down = multipliers
    for name, shape, m in (("gate", (F, D), gate), ("up", (F, D), 1.0), ("down", (D, F), down)):
        yield f"{b}{name}.weight", w.take(f"{h}{name}_proj.weight", shape) * m
        if c.mlp_bias:
            yield f"{b}{name}.bias", w.take(f"{h}{name}_proj.bias", shape[:1]) * m
