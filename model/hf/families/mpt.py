"""MPT: ALiBi with slopes 2^(-alibi_bias_max * h / n_heads) (MPT's own rule; its ordering for head counts that are
not a power of two is the paper's), a fused [Q | K | V] projection, no biases anywhere (LayerNorms included),
exact GELU and a tied head.  The attention options MPT has besides ALiBi (clipping, q/k LayerNorm, a softmax scale,
prefix LM) are refused."""

from __future__ import annotations

from typing import Any

from model.hf.families.base import Fields, Mapping, prefixed

MODEL_TYPE = "mpt"


def family(f: Fields) -> tuple[dict[str, Any], Mapping]:
    f.refuse_present({"logit_scale": (), "no_bias": True, "norm_type": ("low_precision_layernorm", "layernorm")})
    attn = f.data.get("attn_config") or {}
    if not isinstance(attn, dict):
        f.refuse("attn_config", attn, "a JSON object")
    for field, harmless in (("alibi", (True,)), ("clip_qkv", (None,)), ("qk_ln", (False, None)),
                            ("softmax_scale", (None,)), ("prefix_lm", (False, None)),
                            ("attn_uses_sequence_id", (False, None))):
        if attn.get(field, harmless[0]) not in harmless:
            f.refuse(f"attn_config.{field}", attn[field], f"posenc implements only {harmless[0]!r}")
    bias_max = attn.get("alibi_bias_max", 8)
    if not isinstance(bias_max, (int, float)) or isinstance(bias_max, bool) or bias_max <= 0:
        f.refuse("attn_config.alibi_bias_max", bias_max, "a positive number")
    d = f.int("d_model", "hidden_size")
    ratio = f.count("expansion_ratio", 4, least=1)
    cfg = {"variant": "alibi", "vocab_size": f.int("vocab_size"), "d_model": d,
           "n_layers": f.int("n_layers", "num_hidden_layers"), "n_heads": f.int("n_heads", "num_attention_heads"),
           "d_mlp": ratio * d, "context": f.int("max_seq_len", default=2048),
           "layer_norm_eps": float(f.get("layer_norm_epsilon", default=1e-5)), "activation": "gelu",
           "norm_bias": False, "qkv_bias": False, "out_bias": False, "mlp_bias": False,
           "alibi_bias_max": float(bias_max), "tie_head": bool(f.get("tie_word_embeddings", default=True))}

    def weights(c, w):
        p = prefixed(w, ("transformer.", "wte.weight"), ("", "wte.weight"))
        D, F = c.d_model, c.d_mlp
        yield "tok.weight", w.take(p + "wte.weight", (c.vocab_size, D))
        for i in range(c.n_layers):
            h, b = f"{p}blocks.{i}.", f"blocks.{i}."
            yield b + "attn.qkv.weight", w.take(h + "attn.Wqkv.weight", (3 * D, D))
            yield b + "attn.out.weight", w.take(h + "attn.out_proj.weight", (D, D))
            yield b + "mlp.0.weight", w.take(h + "ffn.up_proj.weight", (F, D))
            yield b + "mlp.2.weight", w.take(h + "ffn.down_proj.weight", (D, F))
            yield b + "ln1.weight", w.take(h + "norm_1.weight", (D,))
            yield b + "ln2.weight", w.take(h + "norm_2.weight", (D,))
        yield "ln_f.weight", w.take(p + "norm_f.weight", (D,))
        if not c.tie_head:
            yield "head.weight", w.take("lm_head.weight", (c.vocab_size, D))

    return cfg, weights
