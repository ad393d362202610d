"""Qwen3-Next: Gated DeltaNet layers (linear_attention, model/deltanet.py) beside gated grouped-query attention layers
(full_attention; every full_attention_interval-th layer where layer_types is absent) with RoPE on
partial_rotary_factor of each head (0.25 by default) and a per-head RMSNorm of queries and keys.  The attention's
q_proj gives each head its queries and an output gate side by side; the heads' output is multiplied by the gate's
sigmoid before o_proj.  Every norm but the delta layers' output norm scales by 1 + weight (folded into the weight).
The MLP is top-k softmax experts (the top probabilities renormalized, norm_topk_prob) beside one shared expert
whose output a learned sigmoid gate scales, on the layers decoder_sparse_step and mlp_only_layers leave sparse; a
dense SwiGLU of intermediate_size on the rest."""

from __future__ import annotations

from typing import Any

import torch

from model.config import LayerSpec
from model.hf.families.base import Fields, Mapping, final_norm_and_head

MODEL_TYPE = "qwen3_next"
KINDS = {"linear_attention": "gated_deltanet", "full_attention": "attention"}


def family(f: Fields) -> tuple[dict[str, Any], Mapping]:
    n, heads, hidden = f.int("num_hidden_layers"), f.int("num_attention_heads"), f.int("hidden_size")
    interval = f.int("full_attention_interval", default=4)
    types = f.layer_types(n, ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n)],
                          kinds=tuple(KINDS))
    f.refuse_present({"hidden_act": "silu", "norm_topk_prob": True})
    v_heads, k_heads = f.int("linear_num_value_heads"), f.int("linear_num_key_heads")
    if v_heads % k_heads:
        f.refuse("linear_num_value_heads", v_heads, f"a multiple of linear_num_key_heads ({k_heads})")
    f.ssm_heads("linear_num_value_heads", heads=heads)
    experts = f.count("num_experts", 0)  # 0: every layer a dense MLP
    top_k = f.int("num_experts_per_tok") if experts else 0
    expert_width = f.int("moe_intermediate_size") if experts else 0
    shared = f.count("shared_expert_intermediate_size", 0) if experts else 0
    if experts and (not shared or shared % expert_width):
        f.refuse("shared_expert_intermediate_size", shared, f"a positive multiple of moe_intermediate_size "
                 f"({expert_width}) (posenc's shared experts are whole experts)")
    if experts and not 0 < top_k <= experts:
        f.refuse("num_experts_per_tok", top_k, f"1 to num_experts ({experts})")
    dense = set(f.get("mlp_only_layers", default=None) or ())
    step = f.int("decoder_sparse_step", default=1)
    sparse = [bool(experts) and i not in dense and (i + 1) % step == 0 for i in range(n)]
    cfg = {"variant": "rope", "vocab_size": f.int("vocab_size"), "d_model": hidden, "n_layers": n, "n_heads": heads,
           "n_kv_heads": f.int("num_key_value_heads", default=heads),
           "d_head": f.int("head_dim", default=hidden // heads), "d_mlp": f.int("intermediate_size"),
           "context": f.int("max_position_embeddings", default=32768), "norm": "rmsnorm",
           "layer_norm_eps": f.number("rms_norm_eps", 1e-6), "mlp": "gated", "activation": "silu",
           "qkv_bias": bool(f.get("attention_bias", default=False)),
           "out_bias": bool(f.get("attention_bias", default=False)), "mlp_bias": False, "qk_norm": "rmsnorm",
           "attn_gate": True, "tie_head": bool(f.get("tie_word_embeddings", default=False)),
           "n_experts": experts if any(sparse) else 0, "experts_top_k": top_k if any(sparse) else 0,
           "d_expert": expert_width if any(sparse) else 0,
           "shared_experts": shared // expert_width if any(sparse) else 0, "shared_gate": any(sparse),
           "conv_kernel": f.int("linear_conv_kernel_dim", default=4), "conv_bias": False,
           "ssm_heads": v_heads, "ssm_head_dim": f.int("linear_value_head_dim"),
           "ssm_state": f.int("linear_key_head_dim"), "ssm_groups": k_heads,
           "layers": [LayerSpec(mixer=KINDS[t], experts=sparse[i] or not any(sparse)) for i, t in enumerate(types)],
           **f.rope(fraction_names=("partial_rotary_factor",))}
    if all((source or {}).get("partial_rotary_factor") is None for source in (
            f.data, f.data.get("rope_parameters"), f.data.get("rope_scaling"))):
        cfg["rope_fraction"] = 0.25  # Qwen3NextConfig's default where no source gives it

    def weights(c, w):
        D = c.d_model
        yield "tok.weight", w.take("model.embed_tokens.weight", (c.vocab_size, D))
        for i in range(c.n_layers):
            h, b = f"model.layers.{i}.", f"blocks.{i}."
            if c.attends(i):
                yield from attention(c, w, h + "self_attn.", b + "attn.")
            else:
                yield from deltanet(c, w, h + "linear_attn.", b + "attn.")
            yield from mlp(c, w, h + "mlp.", b + "mlp.", c.layer(i).experts and c.n_experts)
            yield b + "ln1.weight", 1 + w.take(h + "input_layernorm.weight", (D,))
            yield b + "ln2.weight", 1 + w.take(h + "post_attention_layernorm.weight", (D,))
        for name, t in final_norm_and_head(c, w, "model.norm"):
            yield name, 1 + t if name == "ln_f.weight" else t

    return cfg, weights


def attention(c, w, h: str, b: str):
    """q_proj's rows per head are [queries | gate]: the queries join k and v in qkv, the gates make the gate."""
    D, H, KVH, Dh = c.d_model, c.n_heads, c.kv_heads, c.head_dim
    q_gate = w.take(h + "q_proj.weight", (2 * H * Dh, D)).view(H, 2, Dh, D)
    k, v = w.take(h + "k_proj.weight", (KVH * Dh, D)), w.take(h + "v_proj.weight", (KVH * Dh, D))
    yield b + "qkv.weight", torch.cat([q_gate[:, 0].reshape(H * Dh, D), k, v])
    yield b + "gate.weight", q_gate[:, 1].reshape(H * Dh, D)
    if c.qkv_bias:
        q_bias = w.take(h + "q_proj.bias", (2 * H * Dh,)).view(H, 2, Dh)
        yield b + "qkv.bias", torch.cat([q_bias[:, 0].reshape(-1), w.take(h + "k_proj.bias", (KVH * Dh,)),
                                         w.take(h + "v_proj.bias", (KVH * Dh,))])
        yield b + "gate.bias", q_bias[:, 1].reshape(-1)
    yield b + "out.weight", w.take(h + "o_proj.weight", (D, H * Dh))
    if c.out_bias:
        yield b + "out.bias", w.take(h + "o_proj.bias", (D,))
    yield b + "q_norm.weight", 1 + w.take(h + "q_norm.weight", (Dh,))
    yield b + "k_norm.weight", 1 + w.take(h + "k_norm.weight", (Dh,))


def deltanet(c, w, h: str, b: str):
    """in_proj_qkvz's rows are grouped by key head, [q | k | v of its value heads | z of them], and in_proj_ba's
    [b | a of its value heads]: regrouped as posenc's [q all | k all | v all | z all | b all | a all]."""
    D, H, dv, dk, G, K = c.d_model, c.ssm_heads, c.ssm_head_dim, c.ssm_state, c.ssm_groups, c.conv_kernel
    r = H // G
    qkvz = w.take(h + "in_proj_qkvz.weight", (2 * G * dk + 2 * H * dv, D)).view(G, 2 * dk + 2 * r * dv, D)
    q, k, v, z = qkvz.split([dk, dk, r * dv, r * dv], dim=1)
    ba = w.take(h + "in_proj_ba.weight", (2 * H, D)).view(G, 2 * r, D)
    yield b + "in_proj.weight", torch.cat([t.reshape(-1, D) for t in (q, k, v, z, ba[:, :r], ba[:, r:])])
    yield b + "conv.weight", w.take(h + "conv1d.weight", (2 * G * dk + H * dv, 1, K))
    for name in ("dt_bias", "A_log"):
        yield b + name, w.take(h + name, (H,))
    yield b + "norm_weight", w.take(h + "norm.weight", (dv,))
    yield b + "out.weight", w.take(h + "out_proj.weight", (D, H * dv))


def mlp(c, w, h: str, b: str, sparse: bool):
    """A dense SwiGLU, or the router, the experts (each expert's gate_proj, up_proj, down_proj as the files hold them,
    or the module's fused (E, 2F, D) gate_up_proj and (E, D, F) down_proj) as posenc's (E, D, F) and (E, F, D), the
    shared expert and its gate."""
    D = c.d_model
    if not sparse:
        for name, shape in (("gate", (c.d_mlp, D)), ("up", (c.d_mlp, D)), ("down", (D, c.d_mlp))):
            yield f"{b}{name}.weight", w.take(f"{h}{name}_proj.weight", shape)
        return
    E, F, S = c.n_experts, c.d_expert, c.d_expert * c.shared_experts
    yield b + "router.weight", w.take(h + "gate.weight", (E, D))
    if w.has(h + "experts.gate_up_proj"):
        gate_up = w.take(h + "experts.gate_up_proj", (E, 2 * F, D))
        gate, up, down = gate_up[:, :F], gate_up[:, F:], w.take(h + "experts.down_proj", (E, D, F))
    else:
        gate, up, down = (torch.stack([w.take(f"{h}experts.{e}.{name}_proj.weight", shape) for e in range(E)])
                          for name, shape in (("gate", (F, D)), ("up", (F, D)), ("down", (D, F))))
    yield b + "gate.weight", gate.transpose(1, 2)
    yield b + "up.weight", up.transpose(1, 2)
    yield b + "down.weight", down.transpose(1, 2)
    for name, shape in (("gate", (S, D)), ("up", (S, D)), ("down", (D, S))):
        yield f"{b}shared.{name}.weight", w.take(f"{h}shared_expert.{name}_proj.weight", shape)
    yield b + "shared_gate.weight", w.take(h + "shared_expert_gate.weight", (1, D))
