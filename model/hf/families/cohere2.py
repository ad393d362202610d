"""Cohere 2: a parallel block reading one bias-free LayerNorm (x + attn(ln(x)) + mlp(ln(x))), a gated SiLU MLP,
head_dim = hidden_size / heads (Cohere2Config sets it so), RoPE with interleaved pairs (2k, 2k+1) on the
sliding-window layers only, no positional encoding at all on the global (full_attention) layers, and the tied
head's logits multiplied by logit_scale.  layer_types, when absent, is Cohere2Config's: every
sliding_window_pattern-th layer global (4), the rest sliding."""

from __future__ import annotations

from typing import Any

from model.hf.families.base import Fields, Mapping, final_norm_and_head, separate_attention

MODEL_TYPE = "cohere2"


def family(f: Fields) -> tuple[dict[str, Any], Mapping]:
    n, heads, hidden = f.int("num_hidden_layers"), f.int("num_attention_heads"), f.int("hidden_size")
    pattern = f.int("sliding_window_pattern", default=4)
    types = f.layer_types(n, ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)])
    bias = bool(f.get("attention_bias", default=False))
    cfg = {"variant": "rope", "vocab_size": f.int("vocab_size"), "d_model": hidden, "n_layers": n, "n_heads": heads,
           "n_kv_heads": f.int("num_key_value_heads", default=heads), "d_head": hidden // heads,
           "d_mlp": f.int("intermediate_size"), "context": f.int("max_position_embeddings", default=8192),
           "norm": "layernorm", "norm_bias": False, "layer_norm_eps": float(f.get("layer_norm_eps", default=1e-5)),
           "mlp": "gated", "activation": f.activation("hidden_act", default="silu"), "qkv_bias": bias,
           "out_bias": bias, "mlp_bias": False, "tie_head": bool(f.get("tie_word_embeddings", default=True)),
           "parallel_residual": True, "shared_norm": True, "rope_pairing": "interleaved",
           "logit_scale": f.number("logit_scale", 0.0625), **f.rope(),
           **f.layers(types, window=4096, encoding=["model" if t == "sliding_attention" else "none" for t in types])}

    def weights(c, w):
        D, F = c.d_model, c.d_mlp
        yield "tok.weight", w.take("model.embed_tokens.weight", (c.vocab_size, D))
        for i in range(c.n_layers):
            h, b = f"model.layers.{i}.", f"blocks.{i}."
            yield from separate_attention(c, w, h, b)
            for name, shape in (("gate", (F, D)), ("up", (F, D)), ("down", (D, F))):
                yield f"{b}mlp.{name}.weight", w.take(f"{h}mlp.{name}_proj.weight", shape)
            yield b + "ln1.weight", w.take(h + "input_layernorm.weight", (D,))
        yield from final_norm_and_head(c, w, "model.norm")

    return cfg, weights
