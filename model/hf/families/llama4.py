"""Llama 4's text model (Llama4TextConfig, model_type llama4_text): LLaMA's pre-norm block with RMSNorms and iRoPE.
no_rope_layers[i] is 1 where layer i rotates (the name reads backwards; derived by Llama4TextConfig as every
no_rope_layer_interval-th layer without RoPE when absent), in interleaved pairs (transformers multiplies complex
numbers), by rope_parameters' base and scaling (llama3 in the Hub's files).  The rotating layers attend in chunks
of attention_chunk_size positions (layer_types: chunked_attention, derived from no_rope_layers when absent: a query
sees the keys of its own block) and L2-norm each head's queries and keys (use_qk_norm, no weight, eps
rms_norm_eps; after the rotation in transformers, which leaves a head's norm unchanged); the NoPE layers attend to
every key and, with attn_temperature_tuning, scale their queries by log1p(floor((pos + 1) / floor_scale)) *
attn_scale + 1.  The layers moe_layers lists (derived: every interleave_moe_layer_step-th) have a mixture of
num_local_experts experts intermediate_size wide, each reading the token times its router score (the top
num_experts_per_tok logits' sigmoids, 0 elsewhere), beside one shared expert; the others a dense SwiGLU MLP
intermediate_size_mlp wide.  Experts are stored as x @ W (gate_up_proj: (experts, hidden, 2 x width), gate then
up), as posenc's ExpertLinear keeps them.  Quantized files are refused."""

from __future__ import annotations

from typing import Any

from model.hf.families.base import Fields, Mapping, final_norm_and_head, separate_attention

MODEL_TYPE = "llama4_text"
DEFAULT_THETA = 500000.0  # Llama4TextConfig.default_theta
KINDS = ("full_attention", "chunked_attention")


def expert_layers(f: Fields, n: int) -> list[int]:
    """moe_layers, or every interleave_moe_layer_step-th layer from the step's first (Llama4TextConfig's rule)."""
    layers = f.data.get("moe_layers")
    if layers is None:
        step = f.int("interleave_moe_layer_step", default=1)
        return list(range(step - 1, n, step))
    if not isinstance(layers, list) or not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < n
                                               for i in layers):
        f.refuse("moe_layers", layers, f"a list of layer indices below num_hidden_layers ({n})")
    return sorted(set(layers))


def family(f: Fields) -> tuple[dict[str, Any], Mapping]:
    f.refuse_quantized()
    heads, n = f.int("num_attention_heads"), f.int("num_hidden_layers")
    rotates = f.rotating(n, exact=False)
    chunk = f.data.get("attention_chunk_size")
    types = f.layer_types(n, ["chunked_attention" if r and chunk is not None else "full_attention" for r in rotates],
                          KINDS)
    chunked = "chunked_attention" in types
    if chunked and (not isinstance(chunk, int) or isinstance(chunk, bool) or chunk <= 0):
        f.refuse("attention_chunk_size", chunk, "a positive integer where layer_types has chunked_attention layers")
    experts, top_k = f.experts(("num_local_experts",), 16, top_k_default=1)
    tempered = bool(f.get("attn_temperature_tuning", default=True)) and not all(rotates)  # on the NoPE layers
    qk_norm = bool(f.get("use_qk_norm", default=True)) and any(rotates)  # the L2 q/k norm of the RoPE layers
    moe = expert_layers(f, n)
    bias = bool(f.get("attention_bias", default=False))
    cfg = {"variant": "rope", "vocab_size": f.int("vocab_size"), "d_model": f.int("hidden_size"), "n_layers": n,
           "n_heads": heads, "n_kv_heads": f.int("num_key_value_heads", default=heads),
           "d_head": f.int("head_dim", default=f.int("hidden_size") // heads),
           "d_mlp": f.int("intermediate_size_mlp", default=16384),
           "context": f.int("max_position_embeddings", default=131072),
           "norm": "rmsnorm", "layer_norm_eps": float(f.get("rms_norm_eps", default=1e-5)), "mlp": "gated",
           "activation": f.activation("hidden_act", default="silu"), "qkv_bias": bias, "out_bias": bias,
           "mlp_bias": False, "tie_head": bool(f.get("tie_word_embeddings", default=False)),
           "rope_pairing": "interleaved", "attention_chunk": chunk if chunked else 0,
           "temperature_floor": f.number("floor_scale", 8192) if tempered else 0.0,
           "temperature_scale": f.number("attn_scale", 0.1, zero=True) if tempered else 0.0,
           "d_expert": f.int("intermediate_size", default=8192), "qk_norm": "l2" if qk_norm else "none",
           **f.layers(types, encoding=["model" if r else "none" for r in rotates],
                      qk_norm=[bool(r) or not qk_norm for r in rotates],
                      temperature=[tempered and not r for r in rotates],
                      experts=[i in moe or not moe for i in range(n)]),
           **f.rope(default_theta=DEFAULT_THETA)}
    if moe:
        cfg.update(n_experts=experts, experts_top_k=top_k, router="topk_sigmoid", router_scales_input=True,
                   shared_experts=1)
    return cfg, weights


def weights(c, w):
    D, F, E = c.d_model, c.d_expert, c.n_experts
    yield "tok.weight", w.take("model.embed_tokens.weight", (c.vocab_size, D))
    for i in range(c.n_layers):
        h, b = f"model.layers.{i}.", f"blocks.{i}."
        yield from separate_attention(c, w, h, b)
        ff = h + "feed_forward."
        if c.n_experts and c.layer(i).experts:
            yield b + "mlp.router.weight", w.take(ff + "router.weight", (E, D))
            gate_up = w.take(ff + "experts.gate_up_proj", (E, D, 2 * F))
            yield b + "mlp.gate.weight", gate_up[..., :F].contiguous()
            yield b + "mlp.up.weight", gate_up[..., F:].contiguous()
            yield b + "mlp.down.weight", w.take(ff + "experts.down_proj", (E, F, D))
            ff, b, width = ff + "shared_expert.", b + "mlp.shared.", F
        else:
            b, width = b + "mlp.", c.d_mlp
        for name, shape in (("gate", (width, D)), ("up", (width, D)), ("down", (D, width))):
            yield f"{b}{name}.weight", w.take(f"{ff}{name}_proj.weight", shape)
        for theirs, ours in (("input_layernorm", "ln1"), ("post_attention_layernorm", "ln2")):
            yield f"blocks.{i}.{ours}.weight", w.take(f"{h}{theirs}.weight", (D,))
    yield from final_norm_and_head(c, w, "model.norm")
