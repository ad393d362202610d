"""LLaMA-shaped models: RMSNorm, gated MLP, grouped-query attention, half-split rotary."""

from __future__ import annotations

from typing import Any

from model.hf.families.base import Fields, Mapping, final_norm_and_head, separate_attention

MODEL_TYPE = "llama"


def family(f: Fields) -> tuple[dict[str, Any], Mapping]:
    f.refuse_present({"sliding_window": (), "use_sliding_window": False})
    return llama_shaped(f)


def llama_shaped(f: Fields, *, qkv_bias: bool | None = None, out_bias: bool | None = None,
                 **values: Any) -> tuple[dict[str, Any], Mapping]:
    """LLaMA's layout, shared by the families that differ from it in a few values (Mistral, Qwen2, Qwen3): q/k/v
    biases and the output's (attention_bias unless given), and any config values the caller adds (a window, a
    per-head query/key norm, whose weights q_norm / k_norm are then read)."""
    heads = f.int("num_attention_heads")
    bias = bool(f.get("attention_bias", default=False))
    cfg = {"variant": "rope", "vocab_size": f.int("vocab_size"), "d_model": f.int("hidden_size"),
           "n_layers": f.int("num_hidden_layers"), "n_heads": heads,
           "n_kv_heads": f.int("num_key_value_heads", default=heads),
           "d_head": f.int("head_dim", default=f.int("hidden_size") // heads),
           "d_mlp": f.int("intermediate_size"), "context": f.int("max_position_embeddings", default=2048),
           "norm": "rmsnorm", "layer_norm_eps": float(f.get("rms_norm_eps", default=1e-6)),
           "mlp": "gated", "activation": f.activation("hidden_act", default="silu"),
           "qkv_bias": bias if qkv_bias is None else qkv_bias, "out_bias": bias if out_bias is None else out_bias,
           "mlp_bias": bool(f.get("mlp_bias", default=False)),
           "tie_head": bool(f.get("tie_word_embeddings", default=False)), **f.rope(), **values}

    def weights(c, w):
        D, F, Dh = c.d_model, c.d_mlp, c.head_dim
        yield "tok.weight", w.take("model.embed_tokens.weight", (c.vocab_size, D))
        for i in range(c.n_layers):
            h, b = f"model.layers.{i}.", f"blocks.{i}."
            yield from separate_attention(c, w, h, b)
            if c.qk_norm == "rmsnorm":
                yield b + "attn.q_norm.weight", w.take(h + "self_attn.q_norm.weight", (Dh,))
                yield b + "attn.k_norm.weight", w.take(h + "self_attn.k_norm.weight", (Dh,))
            for name, shape in (("gate", (F, D)), ("up", (F, D)), ("down", (D, F))):
                yield f"{b}mlp.{name}.weight", w.take(f"{h}mlp.{name}_proj.weight", shape)
                if c.mlp_bias:
                    yield f"{b}mlp.{name}.bias", w.take(f"{h}mlp.{name}_proj.bias", (shape[0],))
            yield b + "ln1.weight", w.take(h + "input_layernorm.weight", (D,))
            yield b + "ln2.weight", w.take(h + "post_attention_layernorm.weight", (D,))
        yield from final_norm_and_head(c, w, "model.norm")

    return cfg, weights
