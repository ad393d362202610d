"""GPT-2: learned absolute positions, Conv1D weights stored (in, out)."""

from __future__ import annotations

from typing import Any

from model.hf.families.base import Fields, Mapping, final_norm_and_head, prefixed

MODEL_TYPE = "gpt2"


def family(f: Fields) -> tuple[dict[str, Any], Mapping]:
    f.refuse_present({"scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False,
                      "add_cross_attention": False, "scale_attn_weights": True})
    d = f.int("n_embd", "hidden_size")
    cfg = {"variant": "learned", "vocab_size": f.int("vocab_size"), "d_model": d,
           "n_layers": f.int("n_layer", "num_hidden_layers"), "n_heads": f.int("n_head", "num_attention_heads"),
           "d_mlp": f.int("n_inner", default=4 * d), "context": f.int("n_positions", "max_position_embeddings"),
           "layer_norm_eps": float(f.get("layer_norm_epsilon", default=1e-5)),
           "activation": f.activation("activation_function", default="gelu_new"),
           "tie_head": bool(f.get("tie_word_embeddings", default=True))}

    def weights(c, w):
        p = prefixed(w, ("transformer.", "wte.weight"), ("", "wte.weight"))
        D, F = c.d_model, c.d_mlp
        yield "tok.weight", w.take(p + "wte.weight", (c.vocab_size, D))
        yield "pos.table.weight", w.take(p + "wpe.weight", (c.context, D))
        for i in range(c.n_layers):
            h, b = f"{p}h.{i}.", f"blocks.{i}."
            for name, shape in (("attn.c_attn", (D, 3 * D)), ("attn.c_proj", (D, D)), ("mlp.c_fc", (D, F)),
                                ("mlp.c_proj", (F, D))):
                ours = {"attn.c_attn": "attn.qkv", "attn.c_proj": "attn.out", "mlp.c_fc": "mlp.0",
                        "mlp.c_proj": "mlp.2"}[name]
                yield b + ours + ".weight", w.take(h + name + ".weight", shape).t()  # Conv1D stores (in, out)
                yield b + ours + ".bias", w.take(h + name + ".bias", (shape[1],))
            for ln, ours in (("ln_1", "ln1"), ("ln_2", "ln2")):
                yield b + ours + ".weight", w.take(h + ln + ".weight", (D,))
                yield b + ours + ".bias", w.take(h + ln + ".bias", (D,))
        yield from final_norm_and_head(c, w, p + "ln_f")

    return cfg, weights
