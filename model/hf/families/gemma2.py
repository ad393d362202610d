"""Gemma 2: Gemma's layout (embeddings x sqrt(hidden_size), (1 + weight) RMSNorms, GeGLU) with sandwich norms (each
branch's output normed before its residual add: post_attention_layernorm, post_feedforward_layernorm; the MLP reads
pre_feedforward_layernorm), scores scaled by 1/sqrt(query_pre_attn_scalar) and soft-capped (attn_logit_softcapping)
before the mask, final logits soft-capped (final_logit_softcapping), and sliding-window layers as layer_types marks
them (Gemma2Config: every other layer from the first when absent)."""

from __future__ import annotations

from typing import Any

from model.hf.families.base import Fields, Mapping, final_norm_and_head, separate_attention

MODEL_TYPE = "gemma2"
NORMS = {"input_layernorm": "ln1", "post_attention_layernorm": "ln_attn_out", "pre_feedforward_layernorm": "ln2",
         "post_feedforward_layernorm": "ln_mlp_out"}


def gemma2_shaped(f: Fields, types: list[str], encoding: list[str] | None = None,
                  **values: Any) -> tuple[dict[str, Any], Mapping]:
    """Gemma 2's block and head, shared by Gemma 3's text model (which adds per-head q/k norms and its RoPE: each
    layer's encoding)."""
    f.refuse_present({"use_bidirectional_attention": False})
    heads = f.int("num_attention_heads")
    bias = bool(f.get("attention_bias", default=False))
    cfg = {"variant": "rope", "vocab_size": f.int("vocab_size"), "d_model": f.int("hidden_size"),
           "n_layers": f.int("num_hidden_layers"), "n_heads": heads,
           "n_kv_heads": f.int("num_key_value_heads", default=heads), "d_head": f.int("head_dim", default=256),
           "d_mlp": f.int("intermediate_size"), "context": f.int("max_position_embeddings", default=8192),
           "norm": "rmsnorm", "layer_norm_eps": float(f.get("rms_norm_eps", default=1e-6)), "mlp": "gated",
           "activation": f.activation("hidden_activation", "hidden_act", default="gelu_pytorch_tanh"),
           "qkv_bias": bias, "out_bias": bias, "mlp_bias": False,
           "tie_head": bool(f.get("tie_word_embeddings", default=True)),
           "embed_scale": float(f.int("hidden_size")) ** 0.5, "sandwich_norm": True,
           "attn_scale_dim": float(f.int("query_pre_attn_scalar", default=256)),
           "attn_softcap": f.number("attn_logit_softcapping", 0.0, zero=True),
           "final_softcap": f.number("final_logit_softcapping", 0.0, zero=True),
           **f.layers(types, window=4096, encoding=encoding or ["model"] * len(types)), **values}

    def weights(c, w):
        D, F, Dh = c.d_model, c.d_mlp, c.head_dim
        yield "tok.weight", w.take("model.embed_tokens.weight", (c.vocab_size, D))
        for i in range(c.n_layers):
            h, b = f"model.layers.{i}.", f"blocks.{i}."
            yield from separate_attention(c, w, h, b)
            if c.qk_norm == "rmsnorm":  # Gemma 3: (1 + weight) over head_dim
                yield b + "attn.q_norm.weight", w.take(h + "self_attn.q_norm.weight", (Dh,)) + 1
                yield b + "attn.k_norm.weight", w.take(h + "self_attn.k_norm.weight", (Dh,)) + 1
            for name, shape in (("gate", (F, D)), ("up", (F, D)), ("down", (D, F))):
                yield f"{b}mlp.{name}.weight", w.take(f"{h}mlp.{name}_proj.weight", shape)
            for theirs, ours in NORMS.items():
                yield f"{b}{ours}.weight", w.take(f"{h}{theirs}.weight", (D,)) + 1
        for name, tensor in final_norm_and_head(c, w, "model.norm"):
            yield name, tensor + 1 if name == "ln_f.weight" else tensor

    return cfg, weights


def family(f: Fields) -> tuple[dict[str, Any], Mapping]:
    n = f.int("num_hidden_layers")
    types = f.layer_types(n, ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)])
    return gemma2_shaped(f, types, **f.rope())
