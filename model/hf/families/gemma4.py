"""Gemma 4's text model (model_type gemma4_text, Gemma4ForCausalLM): Gemma 3's layout (embeddings x sqrt(hidden_size),
sandwich norms, GeGLU, per-head q/k RMSNorms before RoPE, sliding and full layers by layer_types) with plain
RMSNorm weights (no 1 +), each head's values RMS-normed with no weight (v_norm), scores unscaled (scaling 1), no
score cap, and RoPE per layer type from rope_parameters: the full (global) layers' proportional RoPE over the whole
head (partial_rotary_factor the share of pairs that turn, 1e6), the sliding (local) layers' default RoPE over the
whole head (1e4).  Gemma4TextConfig makes the last layer full whatever layer_types says (absent: every 6th full).

Refused where the config uses them: per-layer inputs (hidden_size_per_layer_input > 0, on by default), layers that
reuse an earlier layer's keys and values (num_kv_shared_layers), the MoE block beside the MLP (enable_moe_block),
full layers with their own head size or key/value heads (global_head_dim, absent = 512; num_global_key_value_heads
with attention_k_eq_v; per_layer_config), bidirectional attention, and a block output scaled by a layer_scalar
tensor other than 1.  attention_k_eq_v's full layers take their values from the key projection (before its norm):
the value rows are the key rows."""

from __future__ import annotations

from typing import Any

import torch

from model.errors import ImportRefusedError
from model.hf.families.base import Fields, Mapping, final_norm_and_head
from model.hf.families.gemma2 import NORMS

MODEL_TYPE = "gemma4_text"
ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},  # Gemma4TextConfig's when absent
        "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0}}


def refuse_unreproduced(f: Fields) -> None:
    """The parts of Gemma 4's text path posenc does not reproduce, each refused where the config turns it on."""
    if per_layer := f.count("hidden_size_per_layer_input", 256):
        f.refuse("hidden_size_per_layer_input", per_layer, "0: per-layer input embeddings are not implemented")
    if shared := f.count("num_kv_shared_layers", 0):
        f.refuse("num_kv_shared_layers", shared, "0: every layer its own keys and values")
    f.refuse_present({"enable_moe_block": False})
    f.require("use_bidirectional_attention", (None, "vision"), None, "causal text attention: null or 'vision'")


def one_head_size(f: Fields, head_dim: int, kv_heads: int) -> None:
    """Gemma4TextConfig gives the full layers global_head_dim (512 when absent) and, with attention_k_eq_v,
    num_global_key_value_heads, unless config.json has per_layer_config (null: no layer differs), which then says
    each layer's: refused unless every layer has the model's head size and key/value heads (posenc's layers share
    one)."""
    why = "the model's, as every layer's: posenc's layers share one head size and key/value head count"
    if "per_layer_config" not in f.data:
        size = f.int("global_head_dim", default=512)
        if size != head_dim:
            f.refuse("global_head_dim", size, f"head_dim ({head_dim}), {why}")
        wide = f.data.get("num_global_key_value_heads") if f.data.get("attention_k_eq_v") else None
        if wide is not None and wide != kv_heads:
            f.refuse("num_global_key_value_heads", wide, f"num_key_value_heads ({kv_heads}), {why}")
        return
    per = f.data["per_layer_config"] or {}
    if not isinstance(per, dict) or not all(isinstance(v, dict) for v in per.values()):
        f.refuse("per_layer_config", per, "an object of layer overrides")
    for layer, overrides in per.items():
        for key, value in overrides.items():
            if f.data.get(key) != value:
                f.refuse(f"per_layer_config.{layer}.{key}", value, f"{key} = {f.data.get(key)!r}, {why}")


def rope_per_type(f: Fields, types: list[str], head_dim: int) -> dict[str, Any]:
    """The full layers' RoPE (encoding "model": any registered type, proportional by default) and the sliding
    layers' base (encoding "local": default RoPE, unscaled).  Both rotate the whole head (rope_dims): transformers'
    Gemma 4 default RoPE ignores partial_rotary_factor, proportional spans the head.  Top-level rope_theta and
    partial_rotary_factor fill what an entry lacks (transformers' standardize_rope_params)."""
    params = f.data.get("rope_parameters") or ROPE
    if not isinstance(params, dict) or not set(types) <= set(params) <= set(ROPE) or \
            not all(isinstance(params[t], dict) for t in set(types)):
        f.refuse("rope_parameters", params, "an object per layer type: full_attention, sliding_attention")
    rope = Fields({**f.data, "rope_parameters": params["full_attention"], "rope_scaling": None}, f.path,
                  f.rope_override).rope(ROPE["full_attention"]["rope_theta"])
    if rope["rope_scaling"] == "none":
        rope["rope_fraction"] = 1.0  # transformers' Gemma 4 default RoPE turns every pair
    elif rope["rope_scaling"] != "proportional" and rope["rope_fraction"] != 1.0:
        f.refuse("rope_parameters.full_attention.partial_rotary_factor", rope["rope_fraction"],
                 "1 (transformers' Gemma 4 rotates the whole head) except with proportional")
    out = {**rope, "rope_dims": head_dim}
    if "sliding_attention" in types:
        local = {"rope_theta": f.data.get("rope_theta"), **params["sliding_attention"]}
        if local.get("rope_type", "default") != "default" or not isinstance(local["rope_theta"], (int, float)) or \
                set(local) - {"rope_type", "rope_theta", "partial_rotary_factor"}:
            f.refuse("rope_parameters.sliding_attention", local, "the local layers' RoPE unscaled (rope_type "
                     "default) with a rope_theta")
        out["local_rope_base"] = float(local["rope_theta"])
    return out


def family(f: Fields) -> tuple[dict[str, Any], Mapping]:
    refuse_unreproduced(f)
    n, heads, hidden = f.int("num_hidden_layers"), f.int("num_attention_heads"), f.int("hidden_size")
    head_dim, kv_heads = f.int("head_dim", default=256), f.int("num_key_value_heads", default=4)
    one_head_size(f, head_dim, kv_heads)
    types = f.layer_types(n, ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(n)])
    types = [*types[:-1], "full_attention"]  # Gemma4TextConfig: the last layer is full
    bias, k_eq_v = bool(f.get("attention_bias", default=False)), bool(f.get("attention_k_eq_v", default=False))
    cfg = {"variant": "rope", "vocab_size": f.int("vocab_size"), "d_model": hidden, "n_layers": n, "n_heads": heads,
           "n_kv_heads": kv_heads, "d_head": head_dim, "d_mlp": f.int("intermediate_size"),
           "context": f.int("max_position_embeddings", default=131_072), "norm": "rmsnorm",
           "layer_norm_eps": float(f.get("rms_norm_eps", default=1e-6)), "mlp": "gated",
           "activation": f.activation("hidden_activation", default="gelu_pytorch_tanh"),
           "qkv_bias": bias, "out_bias": bias, "mlp_bias": False,
           "tie_head": bool(f.get("tie_word_embeddings", default=True)), "embed_scale": float(hidden) ** 0.5,
           "sandwich_norm": True, "qk_norm": "rmsnorm", "v_norm": True, "attn_scale_dim": 1.0,
           "final_softcap": f.number("final_logit_softcapping", 0.0, zero=True),
           **rope_per_type(f, types, head_dim),
           **f.layers(types, window=512, encoding=["local" if t == "sliding_attention" else "model" for t in types])}

    def weights(c, w):
        D, F, H, KVH, Dh = c.d_model, c.d_mlp, c.n_heads, c.kv_heads, c.head_dim
        yield "tok.weight", w.take("model.embed_tokens.weight", (c.vocab_size, D))
        for i, kind in enumerate(types):
            h, b, a = f"model.layers.{i}.", f"blocks.{i}.", f"model.layers.{i}.self_attn."
            scalar = w.take(h + "layer_scalar", (1,))
            if scalar.item() != 1.0:
                raise ImportRefusedError(f"{w.where[h + 'layer_scalar']}: {h}layer_scalar = {scalar.item():g} is not "
                                         "supported (1: posenc's blocks add to the residual stream unscaled)")
            for part, tail in (("weight", (D,)), ("bias", ()))[:2 if bias else 1]:
                q, k = (w.take(f"{a}{p}.{part}", (r, *tail)) for p, r in (("q_proj", H * Dh), ("k_proj", KVH * Dh)))
                # attention_k_eq_v: a full layer's values are its key projection's output (no v_proj)
                v = k if k_eq_v and kind == "full_attention" else w.take(f"{a}v_proj.{part}", (KVH * Dh, *tail))
                yield f"{b}attn.qkv.{part}", torch.cat([q, k, v])
            yield b + "attn.out.weight", w.take(a + "o_proj.weight", (D, H * Dh))
            if bias:
                yield b + "attn.out.bias", w.take(a + "o_proj.bias", (D,))
            yield b + "attn.q_norm.weight", w.take(a + "q_norm.weight", (Dh,))
            yield b + "attn.k_norm.weight", w.take(a + "k_norm.weight", (Dh,))
            for name, shape in (("gate", (F, D)), ("up", (F, D)), ("down", (D, F))):
                yield f"{b}mlp.{name}.weight", w.take(f"{h}mlp.{name}_proj.weight", shape)
            for theirs, ours in NORMS.items():
                yield f"{b}{ours}.weight", w.take(f"{h}{theirs}.weight", (D,))
        yield from final_norm_and_head(c, w, "model.norm")

    return cfg, weights
