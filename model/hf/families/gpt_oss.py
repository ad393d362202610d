"""gpt-oss: LLaMA's pre-norm block with RMSNorms, biases on q/k/v/o (attention_bias), a learned sink logit per head in
every layer (self_attn.sinks), sliding-window layers as layer_types marks them (GptOssConfig: every other layer from
the first when absent, window 128), YaRN RoPE (GptOssConfig's default rope_parameters when the file has none: factor
32 over 4,096 positions, truncate false, base 150,000), and a mixture of experts in every layer: a biased router, the
top num_experts_per_tok logits softmaxed among themselves, experts whose gate_up_proj interleaves gate and up columns
(gate = [..., 0::2], up = [..., 1::2]) joined by the clamped SwiGLU (swiglu_alpha, swiglu_limit).  Experts are
stored as x @ W (experts, in, out), as posenc's ExpertLinear keeps them.  Quantized files (MXFP4) are refused."""

from __future__ import annotations

from typing import Any

from model.hf.families.base import MISSING, Fields, Mapping, final_norm_and_head, separate_attention

MODEL_TYPE = "gpt_oss"
# GptOssConfig's rope_parameters when config.json has neither rope_parameters nor rope_scaling
DEFAULT_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                "original_max_position_embeddings": 4096}


def family(f: Fields) -> tuple[dict[str, Any], Mapping]:
    f.refuse_quantized("dequantize the experts first")
    heads, hidden, n = f.int("num_attention_heads"), f.int("hidden_size"), f.int("num_hidden_layers")
    experts, top_k = f.experts(("num_local_experts", "num_experts"), MISSING, top_k_default=4)
    rope_source = f
    if f.data.get("rope_parameters") is None and f.data.get("rope_scaling") is None:
        rope_source = Fields({**f.data, "rope_parameters": DEFAULT_ROPE}, f.path, f.rope_override)
    bias = bool(f.get("attention_bias", default=True))
    types = f.layer_types(n, ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)])
    cfg = {"variant": "rope", "vocab_size": f.int("vocab_size"), "d_model": hidden, "n_layers": n, "n_heads": heads,
           "n_kv_heads": f.int("num_key_value_heads", default=heads), "d_head": f.int("head_dim", default=64),
           "d_mlp": f.int("intermediate_size"), "context": f.int("max_position_embeddings", default=131072),
           "norm": "rmsnorm", "layer_norm_eps": float(f.get("rms_norm_eps", default=1e-5)),
           "mlp": "clamped_swiglu", "swiglu_alpha": f.number("swiglu_alpha", 1.702),
           "swiglu_limit": f.number("swiglu_limit", 7.0), "n_experts": experts, "experts_top_k": top_k,
           "qkv_bias": bias, "out_bias": bias, "mlp_bias": True, "attn_sinks": True,
           "tie_head": bool(f.get("tie_word_embeddings", default=False)),
           **rope_source.rope(default_theta=150000.0), **f.layers(types, window=128)}

    def weights(c, w):
        D, F, E = c.d_model, c.d_mlp, c.n_experts
        yield "tok.weight", w.take("model.embed_tokens.weight", (c.vocab_size, D))
        for i in range(c.n_layers):
            h, b = f"model.layers.{i}.", f"blocks.{i}."
            yield from separate_attention(c, w, h, b)
            yield b + "attn.sinks", w.take(h + "self_attn.sinks", (c.n_heads,))
            yield b + "mlp.router.weight", w.take(h + "mlp.router.weight", (E, D))
            yield b + "mlp.router.bias", w.take(h + "mlp.router.bias", (E,))
            gate_up = w.take(h + "mlp.experts.gate_up_proj", (E, D, 2 * F))
            gate_up_bias = w.take(h + "mlp.experts.gate_up_proj_bias", (E, 2 * F))
            for ours, at in (("gate", 0), ("up", 1)):  # interleaved columns: gate, up, gate, up, ...
                yield f"{b}mlp.{ours}.weight", gate_up[..., at::2].contiguous()
                yield f"{b}mlp.{ours}.bias", gate_up_bias[..., at::2].contiguous()
            yield b + "mlp.down.weight", w.take(h + "mlp.experts.down_proj", (E, F, D))
            yield b + "mlp.down.bias", w.take(h + "mlp.experts.down_proj_bias", (E, D))
            for theirs, ours in (("input_layernorm", "ln1"), ("post_attention_layernorm", "ln2")):
                yield f"{b}{ours}.weight", w.take(f"{h}{theirs}.weight", (D,))
        yield from final_norm_and_head(c, w, "model.norm")

    return cfg, weights
