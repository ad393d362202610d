"""BLOOM: ALiBi, per-head fused query_key_value, a norm right after the embedding."""

from __future__ import annotations

from typing import Any

from model.hf.families.base import Fields, Mapping, final_norm_and_head, per_head_qkv, prefixed

MODEL_TYPE = "bloom"


def family(f: Fields) -> tuple[dict[str, Any], Mapping]:
    f.refuse_present({"apply_residual_connection_post_layernorm": False})
    d = f.int("hidden_size", "n_embed")
    cfg = {"variant": "alibi", "vocab_size": f.int("vocab_size"), "d_model": d, "n_layers": f.int("n_layer"),
           "n_heads": f.int("n_head", "num_attention_heads"), "d_mlp": 4 * d,
           "context": f.int("seq_length", default=2048),
           "layer_norm_eps": float(f.get("layer_norm_epsilon", default=1e-5)), "activation": "gelu_tanh",
           "embed_norm": True, "tie_head": bool(f.get("tie_word_embeddings", default=True))}

    def weights(c, w):
        p = prefixed(w, ("transformer.", "word_embeddings.weight"), ("", "word_embeddings.weight"))
        D, F, H = c.d_model, c.d_mlp, c.n_heads
        yield "tok.weight", w.take(p + "word_embeddings.weight", (c.vocab_size, D))
        yield "ln_emb.weight", w.take(p + "word_embeddings_layernorm.weight", (D,))
        yield "ln_emb.bias", w.take(p + "word_embeddings_layernorm.bias", (D,))
        for i in range(c.n_layers):
            h, b = f"{p}h.{i}.", f"blocks.{i}."
            yield b + "attn.qkv.weight", per_head_qkv(w.take(h + "self_attention.query_key_value.weight",
                                                               (3 * D, D)), H)
            yield b + "attn.qkv.bias", per_head_qkv(w.take(h + "self_attention.query_key_value.bias", (3 * D,)), H)
            yield b + "attn.out.weight", w.take(h + "self_attention.dense.weight", (D, D))
            yield b + "attn.out.bias", w.take(h + "self_attention.dense.bias", (D,))
            yield b + "mlp.0.weight", w.take(h + "mlp.dense_h_to_4h.weight", (F, D))
            yield b + "mlp.0.bias", w.take(h + "mlp.dense_h_to_4h.bias", (F,))
            yield b + "mlp.2.weight", w.take(h + "mlp.dense_4h_to_h.weight", (D, F))
            yield b + "mlp.2.bias", w.take(h + "mlp.dense_4h_to_h.bias", (D,))
            for ln, ours in (("input_layernorm", "ln1"), ("post_attention_layernorm", "ln2")):
                yield b + ours + ".weight", w.take(h + ln + ".weight", (D,))
                yield b + ours + ".bias", w.take(h + ln + ".bias", (D,))
        yield from final_norm_and_head(c, w, p + "ln_f")

    return cfg, weights
