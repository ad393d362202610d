"""StableLM: LayerNorms with biases, rotary on the first partial_rotary_factor of each head (0.25 by default),
q/k/v biases when use_qkv_bias, a bias-free per-head LayerNorm on queries and keys when qk_layernorm, and the
parallel block x + attn(ln(x)) + mlp(ln(x)) (one norm for both) when use_parallel_residual."""

from __future__ import annotations

from typing import Any

import torch

from model.hf.families.base import Fields, Mapping, final_norm_and_head, separate_attention

MODEL_TYPE = "stablelm"


def family(f: Fields) -> tuple[dict[str, Any], Mapping]:
    heads, d = f.int("num_attention_heads"), f.int("hidden_size")
    parallel = bool(f.get("use_parallel_residual", default=False))
    cfg = {"variant": "rope", "vocab_size": f.int("vocab_size"), "d_model": d, "n_layers": f.int("num_hidden_layers"),
           "n_heads": heads, "n_kv_heads": f.int("num_key_value_heads", default=heads),
           "d_mlp": f.int("intermediate_size"), "context": f.int("max_position_embeddings", default=4096),
           "layer_norm_eps": float(f.get("layer_norm_eps", default=1e-5)), "mlp": "gated",
           "activation": f.activation("hidden_act", default="silu"), "qkv_bias": bool(f.get("use_qkv_bias",
                                                                                             default=False)),
           "out_bias": False, "mlp_bias": False, "parallel_residual": parallel, "shared_norm": parallel,
           "qk_norm": "layernorm_per_head" if f.get("qk_layernorm", default=False) else "none",
           "tie_head": bool(f.get("tie_word_embeddings", default=False)), **f.rope()}
    if "partial_rotary_factor" not in f.data and not (f.data.get("rope_parameters") or {}).get(
            "partial_rotary_factor"):
        cfg["rope_fraction"] = 0.25  # StableLmConfig's default

    def weights(c, w):
        D, F, H, KVH, Dh = c.d_model, c.d_mlp, c.n_heads, c.kv_heads, c.head_dim
        yield "tok.weight", w.take("model.embed_tokens.weight", (c.vocab_size, D))
        for i in range(c.n_layers):
            h, b = f"model.layers.{i}.", f"blocks.{i}."
            yield from separate_attention(c, w, h, b)  # out_bias is False: no o_proj bias
            if c.qk_norm != "none":
                for ours, theirs, n in (("q_norm", "q_layernorm", H), ("k_norm", "k_layernorm", KVH)):
                    yield f"{b}attn.{ours}.weight", torch.stack(
                        [w.take(f"{h}self_attn.{theirs}.norms.{j}.weight", (Dh,)) for j in range(n)])
            for name, shape in (("gate", (F, D)), ("up", (F, D)), ("down", (D, F))):
                yield f"{b}mlp.{name}.weight", w.take(f"{h}mlp.{name}_proj.weight", shape)
            norms = (("input_layernorm", "ln1"),) if parallel else (("input_layernorm", "ln1"),
                                                                      ("post_attention_layernorm", "ln2"))
            for ln, ours in norms:
                yield b + ours + ".weight", w.take(h + ln + ".weight", (D,))
                yield b + ours + ".bias", w.take(h + ln + ".bias", (D,))
        yield from final_norm_and_head(c, w, "model.norm")

    return cfg, weights
