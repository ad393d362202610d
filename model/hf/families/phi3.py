"""Phi-3: LLaMA's values with fused projections (qkv_proj rows [Q | K | V], gate_up_proj rows [gate | up]), LongRoPE
scaling (short and long factors, switched at original_max_position_embeddings; Phi-3's older type names "su" and
"yarn" mean longrope, as transformers reads them) and an optional sliding window over every layer."""

from __future__ import annotations

from typing import Any

from model.hf.families.base import Fields, Mapping, final_norm_and_head
from model.hf.families.llama import llama_shaped

MODEL_TYPE = "phi3"


def family(f: Fields) -> tuple[dict[str, Any], Mapping]:
    data = dict(f.data)
    for key in ("rope_scaling", "rope_parameters"):
        params = data.get(key)
        if isinstance(params, dict) and params.get("rope_type", params.get("type")) in ("su", "yarn"):
            data[key] = {**{k: v for k, v in params.items() if k != "type"}, "rope_type": "longrope"}
    f = Fields(data, f.path, f.rope_override)
    cfg, _ = llama_shaped(f, qkv_bias=False, out_bias=False, mlp_bias=False,
                          **f.window(f.int("num_hidden_layers")))

    def weights(c, w):
        D, F, H, KVH, Dh = c.d_model, c.d_mlp, c.n_heads, c.kv_heads, c.head_dim
        yield "tok.weight", w.take("model.embed_tokens.weight", (c.vocab_size, D))
        for i in range(c.n_layers):
            h, b = f"model.layers.{i}.", f"blocks.{i}."
            yield b + "attn.qkv.weight", w.take(h + "self_attn.qkv_proj.weight", ((H + 2 * KVH) * Dh, D))
            yield b + "attn.out.weight", w.take(h + "self_attn.o_proj.weight", (D, H * Dh))
            gate_up = w.take(h + "mlp.gate_up_proj.weight", (2 * F, D))
            yield b + "mlp.gate.weight", gate_up[:F]
            yield b + "mlp.up.weight", gate_up[F:]
            yield b + "mlp.down.weight", w.take(h + "mlp.down_proj.weight", (D, F))
            yield b + "ln1.weight", w.take(h + "input_layernorm.weight", (D,))
            yield b + "ln2.weight", w.take(h + "post_attention_layernorm.weight", (D,))
        yield from final_norm_and_head(c, w, "model.norm")

    return cfg, weights
