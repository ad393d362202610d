"""CodeGen: GPT-J's block (the parallel x + attn(ln_1(x)) + mlp(ln_1(x)) on one LayerNorm, bias-free attention
projections, an MLP fc_in/fc_out with biases, an untied head with a bias) and its RoPE (base 10000 whatever the
config says, interleaved pairs (2k, 2k+1) on the first rotary_dim dims of each head), with queries, keys and values
fused in qkv_proj as CodeGen was trained on 4 model-parallel shards: the output rows are 4 shards of hidden/4 rows,
each shard [its queries | its values | its keys], and the heads are cut from the 4 shards' queries (keys, values)
laid end to end.  transformers fixes the shard count at 4 (mp_num), so hidden_size must divide by 4."""

from __future__ import annotations

from typing import Any

import torch

from model.hf.families.base import Fields, Mapping, prefixed

MODEL_TYPE = "codegen"
SHARDS = 4  # CodeGenAttention.mp_num


def family(f: Fields) -> tuple[dict[str, Any], Mapping]:
    # a tied head would share the embedding but keep lm_head's bias: posenc's head is tied or biased, not both
    f.refuse_present({"tie_word_embeddings": False})
    d, heads = f.int("n_embd", "hidden_size"), f.int("n_head", "num_attention_heads")
    if d % SHARDS or d % heads:
        f.refuse("n_embd", d, f"a multiple of {SHARDS} (qkv_proj's {SHARDS} shards) and of n_head ({heads})")
    rotary = f.rotary_dim(d // heads)
    cfg = {"variant": "rope", "vocab_size": f.int("vocab_size"), "d_model": d,
           "n_layers": f.int("n_layer", "num_hidden_layers"), "n_heads": heads,
           "d_mlp": f.int("n_inner", default=4 * d),
           "context": f.int("n_positions", "max_position_embeddings", default=2048),
           "layer_norm_eps": float(f.get("layer_norm_epsilon", default=1e-5)),
           "activation": f.activation("activation_function", default="gelu_new"),
           "parallel_residual": True, "shared_norm": True, "qkv_bias": False, "out_bias": False,
           "tie_head": False, "head_bias": True,
           "rope_base": 10000.0, "rope_fraction": rotary / (d // heads), "rope_pairing": "interleaved"}

    def weights(c, w):
        p = prefixed(w, ("transformer.", "wte.weight"), ("", "wte.weight"))
        D, F = c.d_model, c.d_mlp
        yield "tok.weight", w.take(p + "wte.weight", (c.vocab_size, D))
        for i in range(c.n_layers):
            h, b = f"{p}h.{i}.", f"blocks.{i}."
            shards = w.take(h + "attn.qkv_proj.weight", (3 * D, D)).reshape(SHARDS, 3, D // SHARDS, D)
            q, v, k = (shards[:, j].reshape(D, D) for j in range(3))  # each shard holds [q | v | k]
            yield b + "attn.qkv.weight", torch.cat([q, k, v])
            yield b + "attn.out.weight", w.take(h + "attn.out_proj.weight", (D, D))
            yield b + "mlp.0.weight", w.take(h + "mlp.fc_in.weight", (F, D))
            yield b + "mlp.0.bias", w.take(h + "mlp.fc_in.bias", (F,))
            yield b + "mlp.2.weight", w.take(h + "mlp.fc_out.weight", (D, F))
            yield b + "mlp.2.bias", w.take(h + "mlp.fc_out.bias", (D,))
            yield b + "ln1.weight", w.take(h + "ln_1.weight", (D,))
            yield b + "ln1.bias", w.take(h + "ln_1.bias", (D,))
        yield "ln_f.weight", w.take(p + "ln_f.weight", (D,))
        yield "ln_f.bias", w.take(p + "ln_f.bias", (D,))
        yield "head.weight", w.take("lm_head.weight", (c.vocab_size, D))
        yield "head.bias", w.take("lm_head.bias", (c.vocab_size,))

    return cfg, weights
