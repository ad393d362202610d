"""Falcon: rotary (half-split) or, with alibi, BLOOM's slopes added before the 1/sqrt(head_dim) scaling (so posenc's
slopes are scaled by it); multi-query (one key/value head), or grouped key/value heads with
new_decoder_architecture; a parallel block reading one norm (parallel_attn), or two (ln_attn, ln_mlp: the new
architecture's num_ln_in_parallel_attn = 2), or the sequential block; biases everywhere or nowhere (bias)."""

from __future__ import annotations

from typing import Any

import torch

from model.hf.families.base import Fields, Mapping, final_norm_and_head, per_head_qkv, prefixed

MODEL_TYPE = "falcon"


def family(f: Fields) -> tuple[dict[str, Any], Mapping]:
    d, heads = f.int("hidden_size", "n_embed"), f.int("num_attention_heads", "n_head")
    new = bool(f.get("new_decoder_architecture", default=False))
    parallel = bool(f.get("parallel_attn", default=True))
    alibi = bool(f.get("alibi", default=False))
    if new and not parallel:
        f.refuse("parallel_attn", False, "the new decoder architecture is parallel (transformers fails without it)")
    if new:
        kv = f.int("num_kv_heads", default=heads)
    elif f.get("multi_query", default=True):
        kv = 1
    else:
        kv = heads
        if f.get("num_kv_heads", default=heads) != heads:
            f.refuse("num_kv_heads", f.data["num_kv_heads"], "the old architecture without multi_query has one "
                     "key/value head per query head")
    norms = f.get("num_ln_in_parallel_attn", default=2 if new else 1) if parallel else 2
    if norms not in (1, 2) or (not new and parallel and norms != 1):
        f.refuse("num_ln_in_parallel_attn", norms, "1, or 2 with new_decoder_architecture")
    bias = bool(f.get("bias", default=False))
    cfg = {"variant": "alibi" if alibi else "rope", "vocab_size": f.int("vocab_size"), "d_model": d,
           "n_layers": f.int("num_hidden_layers", "n_layer"), "n_heads": heads, "n_kv_heads": kv,
           "d_mlp": f.int("ffn_hidden_size", default=4 * d), "context": f.int("max_position_embeddings", default=2048),
           "layer_norm_eps": float(f.get("layer_norm_epsilon", default=1e-5)),
           "activation": f.activation("activation", default="gelu"), "parallel_residual": parallel,
           "shared_norm": parallel and norms == 1, "qkv_bias": bias, "out_bias": bias, "mlp_bias": bias,
           "tie_head": bool(f.get("tie_word_embeddings", default=True))}
    cfg.update({"alibi_scale": (d // heads) ** -0.5} if alibi else f.rope())

    def weights(c, w):
        p = prefixed(w, ("transformer.", "word_embeddings.weight"), ("", "word_embeddings.weight"))
        D, F, H, KVH, Dh = c.d_model, c.d_mlp, c.n_heads, c.kv_heads, c.head_dim
        yield "tok.weight", w.take(p + "word_embeddings.weight", (c.vocab_size, D))
        for i in range(c.n_layers):
            h, b = f"{p}h.{i}.", f"blocks.{i}."
            for suffix, shape in (("weight", ((H + 2 * KVH) * Dh, D)), ("bias", ((H + 2 * KVH) * Dh,))):
                if suffix == "bias" and not c.qkv_bias:
                    continue
                t = w.take(h + "self_attention.query_key_value." + suffix, shape)
                yield b + "attn.qkv." + suffix, to_q_k_v(t, H, KVH, new)
            yield b + "attn.out.weight", w.take(h + "self_attention.dense.weight", (D, H * Dh))
            if c.out_bias:
                yield b + "attn.out.bias", w.take(h + "self_attention.dense.bias", (D,))
            for ours, theirs, shape in (("0", "dense_h_to_4h", (F, D)), ("2", "dense_4h_to_h", (D, F))):
                yield f"{b}mlp.{ours}.weight", w.take(f"{h}mlp.{theirs}.weight", shape)
                if c.mlp_bias:
                    yield f"{b}mlp.{ours}.bias", w.take(f"{h}mlp.{theirs}.bias", (shape[0],))
            if not c.parallel_residual:
                pairs = (("input_layernorm", "ln1"), ("post_attention_layernorm", "ln2"))
            elif c.shared_norm:
                pairs = (("input_layernorm", "ln1"),)
            else:
                pairs = (("ln_attn", "ln1"), ("ln_mlp", "ln2"))
            for ln, ours in pairs:
                yield b + ours + ".weight", w.take(h + ln + ".weight", (D,))
                yield b + ours + ".bias", w.take(h + ln + ".bias", (D,))
        yield from final_norm_and_head(c, w, p + "ln_f")

    return cfg, weights


def to_q_k_v(t: torch.Tensor, heads: int, kv_heads: int, new: bool) -> torch.Tensor:
    """Falcon's fused query_key_value rows -> posenc's [Q all heads | K all kv heads | V all kv heads]."""
    if new:  # grouped per kv head: its heads / kv_heads queries, then its key, then its value
        g = heads // kv_heads
        grouped = t.reshape(kv_heads, g + 2, -1, *t.shape[1:])
        q, k, v = grouped[:, :g], grouped[:, g], grouped[:, g + 1]
        return torch.cat([q.reshape(-1, *t.shape[1:]), k.reshape(-1, *t.shape[1:]), v.reshape(-1, *t.shape[1:])])
    if kv_heads == heads:  # per head (q, k, v), as BLOOM
        return per_head_qkv(t, heads)
    return t  # multi-query: already [Q all heads | K | V]
