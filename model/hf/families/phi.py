"""Phi (phi-1, phi-1.5, phi-2): the parallel block x + attn(ln(x)) + mlp(ln(x)) reading one LayerNorm
(input_layernorm), RoPE half-split on the first partial_rotary_factor of each head (0.5 by default), biases on every
projection (q/k/v, dense, fc1/fc2), a plain GELU-tanh MLP (gelu_new), an optional LayerNorm with bias over head_dim
on queries and keys shared by the heads (qk_layernorm, before RoPE), a final LayerNorm (final_layernorm) and an untied
head with a bias."""

from __future__ import annotations

from typing import Any

import torch

from model.hf.families.base import Fields, Mapping

MODEL_TYPE = "phi"


def family(f: Fields) -> tuple[dict[str, Any], Mapping]:
    # a tied head would share the embedding but keep lm_head's bias: posenc's head is tied or biased, not both
    f.refuse_present({"tie_word_embeddings": False})
    heads, hidden = f.int("num_attention_heads"), f.int("hidden_size")
    cfg = {"variant": "rope", "vocab_size": f.int("vocab_size"), "d_model": hidden,
           "n_layers": f.int("num_hidden_layers"), "n_heads": heads,
           "n_kv_heads": f.int("num_key_value_heads", default=heads),
           "d_head": f.int("head_dim", default=hidden // heads), "d_mlp": f.int("intermediate_size"),
           "context": f.int("max_position_embeddings", default=2048), "norm": "layernorm",
           "layer_norm_eps": float(f.get("layer_norm_eps", default=1e-5)), "mlp": "plain",
           "activation": f.activation("hidden_act", default="gelu_new"), "qkv_bias": True, "out_bias": True,
           "mlp_bias": True, "parallel_residual": True, "shared_norm": True, "tie_head": False, "head_bias": True,
           "qk_norm": "layernorm" if f.get("qk_layernorm", default=False) else "none", **f.rope()}
    if "partial_rotary_factor" not in f.data and not (f.data.get("rope_parameters") or {}).get(
            "partial_rotary_factor"):
        cfg["rope_fraction"] = 0.5  # PhiConfig's default

    def weights(c, w):
        D, F, H, KVH, Dh = c.d_model, c.d_mlp, c.n_heads, c.kv_heads, c.head_dim
        yield "tok.weight", w.take("model.embed_tokens.weight", (c.vocab_size, D))
        for i in range(c.n_layers):
            h, b = f"model.layers.{i}.", f"blocks.{i}."
            sizes = (("q_proj", H * Dh), ("k_proj", KVH * Dh), ("v_proj", KVH * Dh))
            yield b + "attn.qkv.weight", torch.cat([w.take(f"{h}self_attn.{n}.weight", (s, D)) for n, s in sizes])
            yield b + "attn.qkv.bias", torch.cat([w.take(f"{h}self_attn.{n}.bias", (s,)) for n, s in sizes])
            yield b + "attn.out.weight", w.take(h + "self_attn.dense.weight", (D, H * Dh))
            yield b + "attn.out.bias", w.take(h + "self_attn.dense.bias", (D,))
            if c.qk_norm == "layernorm":
                for ours, theirs in (("q_norm", "q_layernorm"), ("k_norm", "k_layernorm")):
                    for part in ("weight", "bias"):
                        yield f"{b}attn.{ours}.{part}", w.take(f"{h}self_attn.{theirs}.{part}", (Dh,))
            for theirs, ours, shape in (("fc1", "0", (F, D)), ("fc2", "2", (D, F))):
                yield f"{b}mlp.{ours}.weight", w.take(f"{h}mlp.{theirs}.weight", shape)
                yield f"{b}mlp.{ours}.bias", w.take(f"{h}mlp.{theirs}.bias", (shape[0],))
            yield b + "ln1.weight", w.take(h + "input_layernorm.weight", (D,))
            yield b + "ln1.bias", w.take(h + "input_layernorm.bias", (D,))
        yield "ln_f.weight", w.take("model.final_layernorm.weight", (D,))
        yield "ln_f.bias", w.take("model.final_layernorm.bias", (D,))
        yield "head.weight", w.take("lm_head.weight", (c.vocab_size, D))
        yield "head.bias", w.take("lm_head.bias", (c.vocab_size,))

    return cfg, weights
