"""GPT-NeoX / Pythia: partial rotary, per-head fused query_key_value, parallel residual."""

from __future__ import annotations

from typing import Any

from model.hf.families.base import Fields, Mapping, final_norm_and_head, per_head_qkv

MODEL_TYPE = "gpt_neox"


def family(f: Fields) -> tuple[dict[str, Any], Mapping]:
    bias = bool(f.get("attention_bias", default=True))
    cfg = {"variant": "rope", "vocab_size": f.int("vocab_size"), "d_model": f.int("hidden_size"),
           "n_layers": f.int("num_hidden_layers"), "n_heads": f.int("num_attention_heads"),
           "d_mlp": f.int("intermediate_size"), "context": f.int("max_position_embeddings", default=2048),
           "layer_norm_eps": float(f.get("layer_norm_eps", default=1e-5)),
           "activation": f.activation("hidden_act", default="gelu"),
           "parallel_residual": bool(f.get("use_parallel_residual", default=True)),
           "qkv_bias": bias, "out_bias": bias, "tie_head": bool(f.get("tie_word_embeddings", default=False)),
           **f.rope(fraction_names=("rotary_pct",))}
    if "rotary_pct" not in f.data and "partial_rotary_factor" not in f.data and not (
            f.data.get("rope_parameters") or {}).get("partial_rotary_factor"):
        cfg["rope_fraction"] = 0.25  # GPTNeoXConfig's default

    def weights(c, w):
        D, F, H = c.d_model, c.d_mlp, c.n_heads
        yield "tok.weight", w.take("gpt_neox.embed_in.weight", (c.vocab_size, D))
        for i in range(c.n_layers):
            h, b = f"gpt_neox.layers.{i}.", f"blocks.{i}."
            yield b + "attn.qkv.weight", per_head_qkv(w.take(h + "attention.query_key_value.weight", (3 * D, D)), H)
            if c.qkv_bias:
                yield b + "attn.qkv.bias", per_head_qkv(w.take(h + "attention.query_key_value.bias", (3 * D,)), H)
            yield b + "attn.out.weight", w.take(h + "attention.dense.weight", (D, D))
            if c.out_bias:
                yield b + "attn.out.bias", w.take(h + "attention.dense.bias", (D,))
            yield b + "mlp.0.weight", w.take(h + "mlp.dense_h_to_4h.weight", (F, D))
            yield b + "mlp.0.bias", w.take(h + "mlp.dense_h_to_4h.bias", (F,))
            yield b + "mlp.2.weight", w.take(h + "mlp.dense_4h_to_h.weight", (D, F))
            yield b + "mlp.2.bias", w.take(h + "mlp.dense_4h_to_h.bias", (D,))
            for ln, ours in (("input_layernorm", "ln1"), ("post_attention_layernorm", "ln2")):
                yield b + ours + ".weight", w.take(h + ln + ".weight", (D,))
                yield b + ours + ".bias", w.take(h + ln + ".bias", (D,))
        # transformers 5 saves the untied head as embed_out.weight, its module is lm_head
        head = "embed_out.weight" if w.has("embed_out.weight") or not w.has("lm_head.weight") else "lm_head.weight"
        yield from final_norm_and_head(c, w, "gpt_neox.final_layer_norm", head)

    return cfg, weights
