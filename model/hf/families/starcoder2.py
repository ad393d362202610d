"""StarCoder2: LayerNorms with biases (norm_epsilon), RoPE on whole heads (half-split) with grouped-query attention,
a plain MLP c_proj(act(c_fc(x))) (GELU tanh by default), biases on every projection when use_bias, a sliding
window over every layer when sliding_window is set (null: none), tied head by default."""

from __future__ import annotations

from typing import Any

from model.hf.families.base import Fields, Mapping, final_norm_and_head, separate_attention

MODEL_TYPE = "starcoder2"


def family(f: Fields) -> tuple[dict[str, Any], Mapping]:
    heads, hidden, n = f.int("num_attention_heads"), f.int("hidden_size"), f.int("num_hidden_layers")
    bias = bool(f.get("use_bias", default=True))
    cfg = {"variant": "rope", "vocab_size": f.int("vocab_size"), "d_model": hidden, "n_layers": n, "n_heads": heads,
           "n_kv_heads": f.int("num_key_value_heads", default=2),
           "d_head": f.int("head_dim", default=hidden // heads), "d_mlp": f.int("intermediate_size"),
           "context": f.int("max_position_embeddings", default=4096), "norm": "layernorm",
           "layer_norm_eps": float(f.get("norm_epsilon", default=1e-5)), "mlp": "plain",
           "activation": f.activation("hidden_act", default="gelu_pytorch_tanh"), "qkv_bias": bias,
           "out_bias": bias, "mlp_bias": bias, "tie_head": bool(f.get("tie_word_embeddings", default=True)),
           **f.rope(), **f.window(n)}

    def weights(c, w):
        D, F = c.d_model, c.d_mlp
        yield "tok.weight", w.take("model.embed_tokens.weight", (c.vocab_size, D))
        for i in range(c.n_layers):
            h, b = f"model.layers.{i}.", f"blocks.{i}."
            yield from separate_attention(c, w, h, b)
            for theirs, ours, shape in (("c_fc", "0", (F, D)), ("c_proj", "2", (D, F))):
                yield f"{b}mlp.{ours}.weight", w.take(f"{h}mlp.{theirs}.weight", shape)
                if c.mlp_bias:
                    yield f"{b}mlp.{ours}.bias", w.take(f"{h}mlp.{theirs}.bias", (shape[0],))
            for ln, ours in (("input_layernorm", "ln1"), ("post_attention_layernorm", "ln2")):
                yield b + ours + ".weight", w.take(h + ln + ".weight", (D,))
                yield b + ours + ".bias", w.take(h + ln + ".bias", (D,))
        yield from final_norm_and_head(c, w, "model.norm")

    return cfg, weights
