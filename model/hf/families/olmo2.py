"""OLMo 2: LLaMA's projections, SwiGLU MLP, RoPE and grouped-query attention, with one RMSNorm over all the heads'
queries together and another over the keys (q_norm, k_norm: hidden-wide weights, applied to the whole projection
before the head split and RoPE), and the norms moved onto the branches' outputs: x + post_attention_layernorm(attn(x))
then x + post_feedforward_layernorm(mlp(x)), no norm before either branch; the final norm as LLaMA's."""

from __future__ import annotations

from typing import Any

from model.hf.families.base import Fields, Mapping, final_norm_and_head, separate_attention

MODEL_TYPE = "olmo2"


def family(f: Fields) -> tuple[dict[str, Any], Mapping]:
    heads, hidden = f.int("num_attention_heads"), f.int("hidden_size")
    bias = bool(f.get("attention_bias", default=False))
    cfg = {"variant": "rope", "vocab_size": f.int("vocab_size"), "d_model": hidden,
           "n_layers": f.int("num_hidden_layers"), "n_heads": heads,
           "n_kv_heads": f.int("num_key_value_heads", default=heads),
           "d_head": f.int("head_dim", default=hidden // heads), "d_mlp": f.int("intermediate_size"),
           "context": f.int("max_position_embeddings", default=2048), "norm": "rmsnorm",
           "layer_norm_eps": float(f.get("rms_norm_eps", default=1e-5)), "mlp": "gated",
           "activation": f.activation("hidden_act", default="silu"), "qkv_bias": bias, "out_bias": bias,
           "mlp_bias": False, "tie_head": bool(f.get("tie_word_embeddings", default=False)),
           "qk_norm": "rmsnorm_all_heads", "sandwich_norm": True, "pre_norm": False, **f.rope()}

    def weights(c, w):
        D, F, H, KVH, Dh = c.d_model, c.d_mlp, c.n_heads, c.kv_heads, c.head_dim
        yield "tok.weight", w.take("model.embed_tokens.weight", (c.vocab_size, D))
        for i in range(c.n_layers):
            h, b = f"model.layers.{i}.", f"blocks.{i}."
            yield from separate_attention(c, w, h, b)
            yield b + "attn.q_norm.weight", w.take(h + "self_attn.q_norm.weight", (H * Dh,))
            yield b + "attn.k_norm.weight", w.take(h + "self_attn.k_norm.weight", (KVH * Dh,))
            for name, shape in (("gate", (F, D)), ("up", (F, D)), ("down", (D, F))):
                yield f"{b}mlp.{name}.weight", w.take(f"{h}mlp.{name}_proj.weight", shape)
            yield b + "ln_attn_out.weight", w.take(h + "post_attention_layernorm.weight", (D,))
            yield b + "ln_mlp_out.weight", w.take(h + "post_feedforward_layernorm.weight", (D,))
        yield from final_norm_and_head(c, w, "model.norm")

    return cfg, weights
