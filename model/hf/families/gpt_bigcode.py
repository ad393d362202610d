"""GPT-BigCode (SantaCoder, StarCoder 1): GPT-2's block and learned absolute positions (wpe, n_positions rows) with
nn.Linear weights (stored (out, in), not GPT-2's Conv1D), multi-query attention (multi_query: one key/value head
shared by every query head, c_attn rows [Q all heads | K | V]; otherwise c_attn is laid out per head as (heads, 3,
head_dim)), scores scaled by 1/sqrt(head_dim) only when scale_attn_weights, tied head by default."""

from __future__ import annotations

from typing import Any

from model.hf.families.base import Fields, Mapping, final_norm_and_head, per_head_qkv, prefixed

MODEL_TYPE = "gpt_bigcode"


def family(f: Fields) -> tuple[dict[str, Any], Mapping]:
    f.refuse_present({"add_cross_attention": False})
    d, heads = f.int("n_embd", "hidden_size"), f.int("n_head", "num_attention_heads")
    multi_query = bool(f.get("multi_query", default=True))
    cfg = {"variant": "learned", "vocab_size": f.int("vocab_size"), "d_model": d,
           "n_layers": f.int("n_layer", "num_hidden_layers"), "n_heads": heads, "n_kv_heads": 1 if multi_query else 0,
           "d_mlp": f.int("n_inner", default=4 * d), "context": f.int("n_positions", "max_position_embeddings"),
           "layer_norm_eps": float(f.get("layer_norm_epsilon", default=1e-5)),
           "activation": f.activation("activation_function", default="gelu_pytorch_tanh"),
           "tie_head": bool(f.get("tie_word_embeddings", default=True))}
    if not f.get("scale_attn_weights", default=True):
        cfg["attn_scale_dim"] = 1.0  # the scores unscaled: 1/sqrt(1)

    def weights(c, w):
        p = prefixed(w, ("transformer.", "wte.weight"), ("", "wte.weight"))
        D, F, KV = c.d_model, c.d_mlp, c.kv_heads * c.head_dim
        yield "tok.weight", w.take(p + "wte.weight", (c.vocab_size, D))
        yield "pos.table.weight", w.take(p + "wpe.weight", (c.context, D))
        for i in range(c.n_layers):
            h, b = f"{p}h.{i}.", f"blocks.{i}."
            qkv_w, qkv_b = w.take(h + "attn.c_attn.weight", (D + 2 * KV, D)), w.take(h + "attn.c_attn.bias",
                                                                                     (D + 2 * KV,))
            if multi_query:  # already [Q | K | V]
                yield b + "attn.qkv.weight", qkv_w
                yield b + "attn.qkv.bias", qkv_b
            else:
                yield b + "attn.qkv.weight", per_head_qkv(qkv_w, c.n_heads)
                yield b + "attn.qkv.bias", per_head_qkv(qkv_b, c.n_heads)
            for theirs, ours, shape in (("attn.c_proj", "attn.out", (D, D)), ("mlp.c_fc", "mlp.0", (F, D)),
                                        ("mlp.c_proj", "mlp.2", (D, F))):
                yield b + ours + ".weight", w.take(h + theirs + ".weight", shape)
                yield b + ours + ".bias", w.take(h + theirs + ".bias", (shape[0],))
            for ln, ours in (("ln_1", "ln1"), ("ln_2", "ln2")):
                yield b + ours + ".weight", w.take(h + ln + ".weight", (D,))
                yield b + ours + ".bias", w.take(h + ln + ".bias", (D,))
        yield from final_norm_and_head(c, w, p + "ln_f")

    return cfg, weights
