"""LFM2 (Liquid AI): gated short-convolution layers beside grouped-query attention layers with RoPE and a per-head
RMSNorm of queries and keys (q_layernorm, k_layernorm).  layer_types names each layer "conv" or "full_attention"
(derived from full_attn_idxs when absent, every layer attending when both are); a conv layer is
out_proj(C * conv(B * x)) over conv_L_cache tokens (model/mixers.py), its order coming from the convolution alone.
The MLP's width follows Lfm2MLP: with block_auto_adjust_ff_dim, 2/3 of intermediate_size times
block_ffn_dim_multiplier, rounded up to block_multiple_of.  The final norm is called embedding_norm."""

from __future__ import annotations

from typing import Any

from model.config import LayerSpec
from model.hf.families.base import Fields, Mapping, final_norm_and_head, separate_attention

MODEL_TYPE = "lfm2"
DEFAULT_THETA = 1_000_000.0  # Lfm2Config.default_theta
KINDS = {"full_attention": "attention", "conv": "short_conv"}


def mlp_width(f: Fields) -> int:
    width = f.int("intermediate_size", "block_ff_dim", default=12288)
    if not f.get("block_auto_adjust_ff_dim", default=True):
        return width
    width = int(2 * width / 3)
    multiplier = f.get("block_ffn_dim_multiplier", default=None)
    if multiplier is not None:
        multiple = f.int("block_multiple_of", default=256)
        width = int(multiplier * width)
        width = multiple * ((width + multiple - 1) // multiple)
    return width


def family(f: Fields) -> tuple[dict[str, Any], Mapping]:
    n, heads = f.int("num_hidden_layers"), f.int("num_attention_heads")
    attending = f.get("full_attn_idxs", default=list(range(n)))
    types = f.layer_types(n, ["full_attention" if i in attending else "conv" for i in range(n)], kinds=tuple(KINDS))
    cfg = {"variant": "rope", "vocab_size": f.int("vocab_size"), "d_model": f.int("hidden_size"), "n_layers": n,
           "n_heads": heads, "n_kv_heads": f.int("num_key_value_heads", default=heads),
           "d_head": f.int("head_dim", default=f.int("hidden_size") // heads), "d_mlp": mlp_width(f),
           "context": f.int("max_position_embeddings", default=128_000), "norm": "rmsnorm",
           "layer_norm_eps": f.number("norm_eps", 1e-5), "mlp": "gated", "activation": "silu", "qkv_bias": False,
           "out_bias": False, "mlp_bias": False, "qk_norm": "rmsnorm",
           "tie_head": bool(f.get("tie_word_embeddings", "tie_embedding", default=True)),
           "conv_kernel": f.int("conv_L_cache", default=3), "conv_bias": bool(f.get("conv_bias", default=False)),
           "layers": [LayerSpec(mixer=KINDS[t]) for t in types], **f.rope(default_theta=DEFAULT_THETA)}

    def weights(c, w):
        D, F, Dh, K = c.d_model, c.d_mlp, c.head_dim, c.conv_kernel
        yield "tok.weight", w.take("model.embed_tokens.weight", (c.vocab_size, D))
        for i in range(c.n_layers):
            h, b = f"model.layers.{i}.", f"blocks.{i}."
            if c.attends(i):
                yield from separate_attention(c, w, h, b, out="out_proj")
                yield b + "attn.q_norm.weight", w.take(h + "self_attn.q_layernorm.weight", (Dh,))
                yield b + "attn.k_norm.weight", w.take(h + "self_attn.k_layernorm.weight", (Dh,))
            else:
                parts = (("in_proj", "in_proj", (3 * D, D)), ("conv", "conv", (D, 1, K)), ("out_proj", "out", (D, D)))
                for theirs, ours, shape in parts:
                    yield f"{b}attn.{ours}.weight", w.take(f"{h}conv.{theirs}.weight", shape)
                    if c.conv_bias:
                        yield f"{b}attn.{ours}.bias", w.take(f"{h}conv.{theirs}.bias", (shape[0],))
            for theirs, ours, shape in (("w1", "gate", (F, D)), ("w3", "up", (F, D)), ("w2", "down", (D, F))):
                yield f"{b}mlp.{ours}.weight", w.take(f"{h}feed_forward.{theirs}.weight", shape)
            yield b + "ln1.weight", w.take(h + "operator_norm.weight", (D,))
            yield b + "ln2.weight", w.take(h + "ffn_norm.weight", (D,))
        yield from final_norm_and_head(c, w, "model.embedding_norm")

    return cfg, weights
