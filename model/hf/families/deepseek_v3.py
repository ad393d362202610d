"""DeepSeek-V3: LLaMA's pre-norm block with RMSNorms and multi-head latent attention (model/mla.py): queries through
q_a_proj, q_a_layernorm, q_b_proj (q_proj where q_lora_rank is null), keys and values from kv_a_proj_with_mqa's
latent (kv_a_layernorm, kv_b_proj: per head [k_nope | v]) and its one key part for RoPE shared by the heads; RoPE
only on qk_rope_head_dim dims of each query and that key part, in interleaved pairs (rope_interleave, the default)
or half-split; values v_head_dim wide.  Under a scaled RoPE with mscale_all_dim the scores are scaled by
mscale(factor, mscale_all_dim)^2 / sqrt(qk_head_dim) (transformers' yarn_apply_mscale), carried as attn_scale_dim.
The first first_k_dense_replace layers have a dense SwiGLU MLP; the others a mixture of experts (sigmoid scores,
e_score_correction_bias for the choice only, n_group groups of which topk_group are kept, norm_topk_prob,
routed_scaling_factor) beside n_shared_experts shared experts, computed densely (model/layers.py MoE).  The
latent norms' eps is DeepseekV3RMSNorm's default, 1e-6, whatever rms_norm_eps says.  Experts are read as the Hub's
files store them (mlp.experts.{j}.gate_proj / up_proj / down_proj); quantized (FP8) files are refused."""

from __future__ import annotations

from typing import Any

import torch

from model.config import LayerSpec
from model.hf.families.base import Fields, Mapping, final_norm_and_head
from model.rope_scaling.base import NONE, mscale

MODEL_TYPE = "deepseek_v3"


def score_scale_dim(qk_head_dim: int, rope: dict[str, Any]) -> float:
    """The attn_scale_dim whose 1/sqrt is transformers' DeepSeek softmax scale: qk_head_dim^-0.5, times
    mscale(factor, mscale_all_dim)^2 under a scaled RoPE that sets mscale_all_dim."""
    if rope["rope_scaling"] == NONE or not rope["rope_mscale_all_dim"]:
        return 0.0
    return qk_head_dim / mscale(rope["rope_factor"], rope["rope_mscale_all_dim"]) ** 4


def family(f: Fields) -> tuple[dict[str, Any], Mapping]:
    f.refuse_quantized()
    heads, n = f.int("num_attention_heads"), f.int("num_hidden_layers")
    kv_heads = f.int("num_key_value_heads", default=heads)
    if kv_heads != heads:  # kv_b_proj makes a key and value per head; transformers would regroup them again
        f.refuse("num_key_value_heads", kv_heads, f"equal to num_attention_heads ({heads}) in latent attention")
    nope, rope_dims = f.count("qk_nope_head_dim", 128), f.count("qk_rope_head_dim", 64, least=2)
    values = f.count("v_head_dim", 128, least=1)
    if values > nope + rope_dims:
        f.refuse("v_head_dim", values, f"at most qk_nope_head_dim + qk_rope_head_dim ({nope + rope_dims}): "
                 "values are cached padded to the key's width")
    rope = f.rope()
    fraction = rope.pop("rope_fraction")
    if fraction != 1.0:
        f.refuse("partial_rotary_factor", fraction, "1: qk_rope_head_dim is the rotated part")
    experts, dense = f.count("n_routed_experts", 256, least=1), min(f.count("first_k_dense_replace", 3), n)
    groups, top_k = f.count("n_group", 8, least=1), f.count("num_experts_per_tok", 8, least=1)
    if experts % groups or (groups > 1 and experts // groups < 2):  # a group ranks by its two best experts
        f.refuse("n_group", groups, f"a divisor of n_routed_experts ({experts}) leaving 2 or more per group")
    kept = f.count("topk_group", 4, least=1)
    if kept > groups or top_k > kept * (experts // groups):
        f.refuse("topk_group", kept, f"at most n_group ({groups}), its groups holding num_experts_per_tok ({top_k})")
    cfg = {"variant": "rope", "vocab_size": f.int("vocab_size"), "d_model": f.int("hidden_size"), "n_layers": n,
           "n_heads": heads, "d_head": nope + rope_dims, "rope_dims": rope_dims, "v_head_dim": values,
           "mla_kv_rank": f.int("kv_lora_rank"), "mla_q_rank": f.count("q_lora_rank", 0),
           "rope_pairing": "interleaved" if f.get("rope_interleave", default=True) else "half",
           "attn_scale_dim": score_scale_dim(nope + rope_dims, rope),
           "d_mlp": f.int("intermediate_size"), "context": f.int("max_position_embeddings", default=4096),
           "norm": "rmsnorm", "layer_norm_eps": float(f.get("rms_norm_eps", default=1e-6)), "mlp": "gated",
           "activation": f.activation("hidden_act", default="silu"),
           "qkv_bias": bool(f.get("attention_bias", default=False)),
           "out_bias": bool(f.get("attention_bias", default=False)), "mlp_bias": False,
           "tie_head": bool(f.get("tie_word_embeddings", default=False)),
           "n_experts": experts, "experts_top_k": top_k, "router": "sigmoid", "expert_groups": groups,
           "expert_groups_top_k": kept,
           "router_norm": bool(f.get("norm_topk_prob", default=True)),
           "router_scale": float(f.get("routed_scaling_factor", default=2.5)),
           "d_expert": f.int("moe_intermediate_size"), "shared_experts": f.count("n_shared_experts", 1),
           "layers": [LayerSpec(experts=i >= dense) for i in range(n)], **rope}
    return cfg, weights


def weights(c, w):
    D, H, Dh, R = c.d_model, c.n_heads, c.head_dim, c.rope_dims
    yield "tok.weight", w.take("model.embed_tokens.weight", (c.vocab_size, D))
    for i in range(c.n_layers):
        h, b = f"model.layers.{i}.self_attn.", f"blocks.{i}.attn."
        if c.mla_q_rank:
            yield b + "q_down.weight", w.take(h + "q_a_proj.weight", (c.mla_q_rank, D))
            if c.qkv_bias:
                yield b + "q_down.bias", w.take(h + "q_a_proj.bias", (c.mla_q_rank,))
            yield b + "q_latent_norm.weight", w.take(h + "q_a_layernorm.weight", (c.mla_q_rank,))
            yield b + "q_up.weight", w.take(h + "q_b_proj.weight", (H * Dh, c.mla_q_rank))
        else:
            yield b + "q_up.weight", w.take(h + "q_proj.weight", (H * Dh, D))
        yield b + "kv_down.weight", w.take(h + "kv_a_proj_with_mqa.weight", (c.mla_kv_rank + R, D))
        if c.qkv_bias:
            yield b + "kv_down.bias", w.take(h + "kv_a_proj_with_mqa.bias", (c.mla_kv_rank + R,))
        yield b + "kv_norm.weight", w.take(h + "kv_a_layernorm.weight", (c.mla_kv_rank,))
        yield b + "kv_up.weight", w.take(h + "kv_b_proj.weight", (H * (Dh - R + c.v_head_dim), c.mla_kv_rank))
        yield b + "out.weight", w.take(h + "o_proj.weight", (D, H * c.v_head_dim))
        if c.out_bias:
            yield b + "out.bias", w.take(h + "o_proj.bias", (D,))
        yield from mlp(c, w, f"model.layers.{i}.", f"blocks.{i}.", i)
        for theirs, ours in (("input_layernorm", "ln1"), ("post_attention_layernorm", "ln2")):
            yield f"blocks.{i}.{ours}.weight", w.take(f"model.layers.{i}.{theirs}.weight", (D,))
    yield from final_norm_and_head(c, w, "model.norm")


def mlp(c, w, h: str, b: str, layer: int):
    D, E, F = c.d_model, c.n_experts, c.d_expert
    shapes = {"gate": (F, D), "up": (F, D), "down": (D, F)}
    if not c.layer(layer).experts:
        for name in shapes:
            shape = (c.d_mlp, D) if name != "down" else (D, c.d_mlp)
            yield f"{b}mlp.{name}.weight", w.take(f"{h}mlp.{name}_proj.weight", shape)
        return
    yield b + "mlp.router.weight", w.take(h + "mlp.gate.weight", (E, D))
    yield b + "mlp.choice_bias", w.take(h + "mlp.gate.e_score_correction_bias", (E,))
    for name, shape in shapes.items():  # posenc's experts apply x @ W (experts, in, out): the Linear's W^T
        stacked = [w.take(f"{h}mlp.experts.{j}.{name}_proj.weight", shape).t() for j in range(E)]
        yield f"{b}mlp.{name}.weight", torch.stack(stacked)
        width = (c.shared_experts * F, D) if name != "down" else (D, c.shared_experts * F)
        if c.shared_experts:
            yield f"{b}mlp.shared.{name}.weight", w.take(f"{h}mlp.shared_experts.{name}_proj.weight", width)
