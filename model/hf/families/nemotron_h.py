"""Nemotron-H: a stack of one-part blocks, each a norm and one mixer with a residual add: Mamba-2 (M), attention with
no positional encoding at all (*), a squared-ReLU MLP (-) or a mixture of squared-ReLU experts (E), as
hybrid_override_pattern spells them or layers_block_type / layer_types names them (linear_attention, full_attention,
mlp, moe).  Each block is a posenc layer with the other branch left out (a Mamba-2 or attention layer without MLP, an
MLP or experts layer that mixes no tokens).  The Mamba-2 time steps are clamped below at time_step_min.  The experts
are ungated up/down MLPs (posenc's plain experts) routed as DeepSeek-V3's are (sigmoid scores, a choice-only bias,
n_group groups of which topk_group are kept, norm_topk_prob, routed_scaling_factor), beside a shared up/down MLP of
moe_shared_expert_intermediate_size; a latent projection around the experts (moe_latent_size) is refused."""

from __future__ import annotations

from typing import Any

import torch

from model.config import LayerSpec
from model.hf.families.base import Fields, Mapping, final_norm_and_head, separate_attention
from model.hf.families.granitemoehybrid import mamba

MODEL_TYPE = "nemotron_h"
PATTERN = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}
SPECS = {"linear_attention": LayerSpec(mixer="mamba2", mlp=False), "full_attention": LayerSpec(mlp=False),
         "mlp": LayerSpec(mixer="none", experts=False), "moe": LayerSpec(mixer="none")}


def family(f: Fields) -> tuple[dict[str, Any], Mapping]:
    pattern = f.get("hybrid_override_pattern", default=None)
    if pattern is not None and (not isinstance(pattern, str) or not set(pattern) <= set(PATTERN)):
        f.refuse("hybrid_override_pattern", pattern, f"a string of {', '.join(PATTERN)}")
    derived = [PATTERN[c] for c in pattern] if pattern is not None else ["linear_attention", "moe",
                                                                          "full_attention", "mlp"]
    explicit = f.get("layers_block_type", "layer_types", default=None)
    n = len(explicit) if isinstance(explicit, list) else len(derived)
    types = f.layer_types(n, derived, kinds=tuple(PATTERN.values())) if explicit is None else explicit
    if not isinstance(types, list) or not set(types) <= set(PATTERN.values()):
        f.refuse("layers_block_type", types, "linear_attention, full_attention, mlp or moe blocks")
    f.refuse_present({"use_bias": False, "mamba_hidden_act": "silu", "sliding_window": (), "moe_latent_size": ()})
    experts = experts_config(f) if "moe" in types else {}
    heads = f.int("num_attention_heads")
    cfg = {"variant": "none", "vocab_size": f.int("vocab_size"), "d_model": f.int("hidden_size"), "n_layers": n,
           "n_heads": heads, "n_kv_heads": f.int("num_key_value_heads", default=heads),
           "d_head": f.int("head_dim", default=f.int("hidden_size") // heads), "d_mlp": f.int("intermediate_size"),
           "context": f.int("max_position_embeddings", default=4096), "norm": "rmsnorm",
           "layer_norm_eps": f.number("layer_norm_epsilon", 1e-5), "mlp": "plain",
           "activation": f.activation("mlp_hidden_act", default="relu2"), "qkv_bias": False, "out_bias": False,
           "mlp_bias": bool(f.get("mlp_bias", default=False)),
           "tie_head": bool(f.get("tie_word_embeddings", default=False)),
           # transformers' NemotronHConfig takes the older mamba_* names over the newer ones where both are given
           "conv_kernel": f.int("mamba_d_conv", "conv_kernel", default=4),
           "conv_bias": bool(f.get("mamba_conv_bias", "use_conv_bias", default=True)),
           "ssm_heads": f.ssm_heads("mamba_num_heads", heads=heads), "ssm_head_dim": f.int("mamba_head_dim"),
           "ssm_state": f.int("ssm_state_size"), "ssm_groups": f.int("mamba_n_groups", "n_groups", default=8),
           "ssm_dt_min": f.number("mamba_dt_min" if f.get("mamba_dt_min", default=None) is not None
                                  else "time_step_min", 0.001, zero=True), **experts,
           "layers": [SPECS[t] if experts or t != "mlp" else LayerSpec(mixer="none") for t in types]}

    def weights(c, w):
        D = c.d_model
        yield "tok.weight", w.take("backbone.embeddings.weight", (c.vocab_size, D))
        for i, kind in enumerate(types):
            h, b = f"backbone.layers.{i}.", f"blocks.{i}."
            norm = w.take(h + "norm.weight", (D,))
            if kind == "linear_attention":
                yield from mamba(c, w, h + "mixer.", b + "attn.")
            elif kind == "full_attention":
                yield from separate_attention(c, w, h, b, module="mixer")
            elif kind == "moe":
                yield from moe(c, w, h + "mixer.", b + "mlp.")
            else:
                yield b + "mlp.0.weight", w.take(h + "mixer.up_proj.weight", (c.d_mlp, D))
                yield b + "mlp.2.weight", w.take(h + "mixer.down_proj.weight", (D, c.d_mlp))
                if c.mlp_bias:
                    yield b + "mlp.0.bias", w.take(h + "mixer.up_proj.bias", (c.d_mlp,))
                    yield b + "mlp.2.bias", w.take(h + "mixer.down_proj.bias", (D,))
            yield b + ("ln2.weight" if kind in ("mlp", "moe") else "ln1.weight"), norm
        yield from final_norm_and_head(c, w, "backbone.norm_f")

    return cfg, weights


def experts_config(f: Fields) -> dict[str, Any]:
    """The moe blocks' experts as posenc's plain experts with DeepSeek-V3's sigmoid router."""
    experts, width = f.int("n_routed_experts", "num_local_experts"), f.int("moe_intermediate_size")
    shared = f.int("moe_shared_expert_intermediate_size", default=width)
    if shared % width:
        f.refuse("moe_shared_expert_intermediate_size", shared, f"a multiple of moe_intermediate_size ({width}) "
                 "(posenc's shared experts are whole experts)")
    if f.get("mlp_bias", default=False):
        f.refuse("mlp_bias", True, "false where there are moe blocks (their experts and router have no bias)")
    top_k, groups = f.int("num_experts_per_tok", default=2), f.int("n_group", default=1)
    return {"n_experts": experts, "experts_top_k": top_k, "d_expert": width, "shared_experts": shared // width,
            "router": "sigmoid", "expert_groups": groups if groups > 1 else 0,
            "expert_groups_top_k": f.int("topk_group", default=1) if groups > 1 else 0,
            "router_norm": bool(f.get("norm_topk_prob", default=True)),
            "router_scale": f.number("routed_scaling_factor", 1.0)}


def moe(c, w, h: str, b: str):
    """The router, its choice-only bias, the experts' up_proj (E, F, D) and down_proj (E, D, F) (or each expert's, as
    the files hold them) as posenc's (E, D, F) and (E, F, D), and the shared up/down MLP."""
    D, E, F, S = c.d_model, c.n_experts, c.d_expert, c.d_expert * c.shared_experts
    yield b + "router.weight", w.take(h + "gate.weight", (E, D))
    yield b + "choice_bias", w.take(h + "gate.e_score_correction_bias", (E,))
    for name, shape in (("up", (F, D)), ("down", (D, F))):
        fused = h + f"experts.{name}_proj"
        stacked = w.take(fused, (E, *shape)) if w.has(fused) else \
            torch.stack([w.take(f"{h}experts.{e}.{name}_proj.weight", shape) for e in range(E)])
        yield f"{b}{name}.weight", stacked.transpose(1, 2)
    yield b + "shared.0.weight", w.take(h + "shared_experts.up_proj.weight", (S, D))
    yield b + "shared.2.weight", w.take(h + "shared_experts.down_proj.weight", (D, S))
