"""GPT-J: rotary on the first rotary_dim dims of each head with interleaved pairs (2k, 2k+1), separate bias-free
q/k/v/out projections, the parallel block x + attn(ln_1(x)) + mlp(ln_1(x)) (one norm), and an untied head with a
bias."""

from __future__ import annotations

from typing import Any

import torch

from model.hf.families.base import Fields, Mapping, final_norm_and_head, prefixed

MODEL_TYPE = "gptj"


def family(f: Fields) -> tuple[dict[str, Any], Mapping]:
    d, heads = f.int("n_embd", "hidden_size"), f.int("n_head", "num_attention_heads")
    rotary = f.rotary_dim(d // heads)
    tied = bool(f.get("tie_word_embeddings", default=False))
    cfg = {"variant": "rope", "vocab_size": f.int("vocab_size"), "d_model": d,
           "n_layers": f.int("n_layer", "num_hidden_layers"), "n_heads": heads,
           "d_mlp": f.int("n_inner", default=4 * d),
           "context": f.int("n_positions", "max_position_embeddings", default=2048),
           "layer_norm_eps": float(f.get("layer_norm_epsilon", default=1e-5)),
           "activation": f.activation("activation_function", default="gelu_new"),
           "parallel_residual": True, "shared_norm": True, "qkv_bias": False, "out_bias": False,
           "tie_head": tied, "head_bias": not tied,
           # GPT-J's sin/cos table is built with base 10000 whatever the config says; no scaling
           "rope_base": 10000.0, "rope_fraction": rotary / (d // heads), "rope_pairing": "interleaved"}

    def weights(c, w):
        p = prefixed(w, ("transformer.", "wte.weight"), ("", "wte.weight"))
        D, F = c.d_model, c.d_mlp
        yield "tok.weight", w.take(p + "wte.weight", (c.vocab_size, D))
        for i in range(c.n_layers):
            h, b = f"{p}h.{i}.", f"blocks.{i}."
            yield b + "attn.qkv.weight", torch.cat([w.take(f"{h}attn.{n}_proj.weight", (D, D)) for n in "qkv"])
            yield b + "attn.out.weight", w.take(h + "attn.out_proj.weight", (D, D))
            yield b + "mlp.0.weight", w.take(h + "mlp.fc_in.weight", (F, D))
            yield b + "mlp.0.bias", w.take(h + "mlp.fc_in.bias", (F,))
            yield b + "mlp.2.weight", w.take(h + "mlp.fc_out.weight", (D, F))
            yield b + "mlp.2.bias", w.take(h + "mlp.fc_out.bias", (D,))
            yield b + "ln1.weight", w.take(h + "ln_1.weight", (D,))
            yield b + "ln1.bias", w.take(h + "ln_1.bias", (D,))
        yield from final_norm_and_head(c, w, p + "ln_f")
        if c.head_bias:
            yield "head.bias", w.take("lm_head.bias", (c.vocab_size,))

    return cfg, weights
