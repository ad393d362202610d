"""Granite 4.0-H (granitemoehybrid): Mamba-2 layers beside grouped-query attention layers that have no positional
encoding (position_embedding_type null; "rope" gives them RoPE).  layer_types names each layer linear_attention /
mamba (a Mamba-2 layer, model/ssm.py) or full_attention / attention.  Every layer's MLP is the shared gated MLP
(shared_mlp: input_linear halves gate and up), beside top-k softmax experts where num_local_experts > 0; the branches'
outputs are scaled by residual_multiplier, the embeddings by embedding_multiplier, the scores by
attention_multiplier (instead of 1/sqrt(head_dim)), the logits divided by logits_scaling."""

from __future__ import annotations

from typing import Any

from model.config import LayerSpec
from model.hf.families.base import Fields, Mapping, final_norm_and_head, separate_attention

MODEL_TYPE = "granitemoehybrid"
KINDS = {"linear_attention": "mamba2", "mamba": "mamba2", "full_attention": "attention", "attention": "attention"}


def family(f: Fields) -> tuple[dict[str, Any], Mapping]:
    n, heads, hidden = f.int("num_hidden_layers"), f.int("num_attention_heads"), f.int("hidden_size")
    types = f.layer_types(n, ["linear_attention"] * n, kinds=tuple(KINDS))
    f.refuse_present({"mamba_proj_bias": False, "hidden_act": "silu"})
    f.unclamped_time_steps()
    experts, top_k = (f.experts(("num_local_experts",), 0, 2) if f.get("num_local_experts", default=0) else (0, 0))
    expert_width, shared = f.int("intermediate_size"), f.int("shared_intermediate_size")
    if experts and shared % expert_width:
        f.refuse("shared_intermediate_size", shared, f"a multiple of intermediate_size ({expert_width}) where there "
                 "are experts (posenc's shared experts are whole experts)")
    ssm_heads, inner = f.ssm_heads("mamba_n_heads", heads=heads), f.int("mamba_expand") * hidden
    head_dim = f.get("mamba_d_head", default="auto")
    head_dim = inner // ssm_heads if head_dim == "auto" else head_dim
    rope = f.get("position_embedding_type", default=None)
    if rope not in (None, "nope", "rope"):
        f.refuse("position_embedding_type", rope, "null or nope (no positional encoding) or rope")
    cfg = {"variant": "rope" if rope == "rope" else "none", "vocab_size": f.int("vocab_size"), "d_model": hidden,
           "n_layers": n, "n_heads": heads, "n_kv_heads": f.int("num_key_value_heads", default=heads),
           "d_head": f.int("head_dim", default=hidden // heads), "context": f.int("max_position_embeddings"),
           "norm": "rmsnorm", "layer_norm_eps": f.number("rms_norm_eps", 1e-6), "mlp": "gated", "activation": "silu",
           "qkv_bias": bool(f.get("attention_bias", default=False)), "mlp_bias": False,
           "out_bias": bool(f.get("attention_bias", default=False)),
           "tie_head": bool(f.get("tie_word_embeddings", default=False)),
           "embed_scale": f.number("embedding_multiplier", 1.0), "residual_scale": f.number("residual_multiplier", 1.0),
           "attn_scale_dim": f.number("attention_multiplier", 1.0) ** -2,
           "logit_scale": 1.0 / f.number("logits_scaling", 1.0),
           "d_mlp": shared if not experts else expert_width, "n_experts": experts, "experts_top_k": top_k,
           "shared_experts": shared // expert_width if experts else 0,
           "conv_kernel": f.int("mamba_d_conv", default=4), "conv_bias": bool(f.get("mamba_conv_bias", default=True)),
           "ssm_heads": ssm_heads, "ssm_head_dim": head_dim, "ssm_state": f.int("mamba_d_state"),
           "ssm_groups": f.int("mamba_n_groups", default=1),
           "layers": [LayerSpec(mixer=KINDS[t]) for t in types], **(f.rope() if rope == "rope" else {})}
    if head_dim * ssm_heads != inner:
        f.refuse("mamba_d_head", head_dim, f"mamba_n_heads x mamba_d_head = mamba_expand x hidden_size ({inner})")

    def weights(c, w):
        D = c.d_model
        yield "tok.weight", w.take("model.embed_tokens.weight", (c.vocab_size, D))
        for i in range(c.n_layers):
            h, b = f"model.layers.{i}.", f"blocks.{i}."
            if c.attends(i):
                yield from separate_attention(c, w, h, b)
            else:
                yield from mamba(c, w, f"{h}mamba.", b + "attn.")
            yield from mlp(c, w, h, b)
            yield b + "ln1.weight", w.take(h + "input_layernorm.weight", (D,))
            yield b + "ln2.weight", w.take(h + "post_attention_layernorm.weight", (D,))
        yield from final_norm_and_head(c, w, "model.norm")

    return cfg, weights


def mamba(c, w, h: str, b: str):
    H, P, N, G, K = c.ssm_heads, c.ssm_head_dim, c.ssm_state, c.ssm_groups, c.conv_kernel
    width = H * P + 2 * G * N
    yield b + "in_proj.weight", w.take(h + "in_proj.weight", (H * P + width + H, c.d_model))
    yield b + "conv.weight", w.take(h + "conv1d.weight", (width, 1, K))
    if c.conv_bias:
        yield b + "conv.bias", w.take(h + "conv1d.bias", (width,))
    for name in ("dt_bias", "A_log", "D"):
        yield b + name, w.take(h + name, (H,))
    if c.ssm_norm != "none":  # Falcon-H1 without mamba_rms_norm has no norm
        yield b + "norm_weight", w.take(h + "norm.weight", (H * P,))
    yield b + "out.weight", w.take(h + "out_proj.weight", (c.d_model, H * P))


def mlp(c, w, h: str, b: str):
    """The shared MLP (posenc's dense MLP, or its MoE's shared experts) and the experts, (E, 2F, D) gate_up and
    (E, D, F) down, as posenc's (E, D, F) and (E, F, D)."""
    D = c.d_model
    F = c.d_mlp * (c.shared_experts or 1)
    gate_up = w.take(h + "shared_mlp.input_linear.weight", (2 * F, D))
    down = w.take(h + "shared_mlp.output_linear.weight", (D, F))
    at = b + ("mlp.shared." if c.n_experts else "mlp.")
    yield at + "gate.weight", gate_up[:F]
    yield at + "up.weight", gate_up[F:]
    yield at + "down.weight", down
    if c.n_experts:
        E, Fe = c.n_experts, c.d_mlp
        moe = h + "block_sparse_moe."  # the files' names (router.layer, input_linear, output_linear), or the module's
        old = w.has(moe + "router.layer.weight")
        yield b + "mlp.router.weight", w.take(moe + ("router.layer.weight" if old else "router.weight"), (E, D))
        experts = w.take(moe + ("input_linear.weight" if old else "experts.gate_up_proj"), (E, 2 * Fe, D))
        yield b + "mlp.gate.weight", experts[:, :Fe].transpose(1, 2)
        yield b + "mlp.up.weight", experts[:, Fe:].transpose(1, 2)
        down = w.take(moe + ("output_linear.weight" if old else "experts.down_proj"), (E, D, Fe))
        yield b + "mlp.down.weight", down.transpose(1, 2)
