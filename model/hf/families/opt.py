"""OPT: learned absolute positions whose table is offset by 2 (row p + 2 holds position p; positions are counted from
the attention mask, as OPT does, so rows 0 and 1 are never read), ReLU MLP, biases (enable_bias), and LayerNorm
before each branch (do_layer_norm_before) or after each residual add with no final norm (OPT-350m's form)."""

from __future__ import annotations

from typing import Any

import torch

from model.hf.families.base import Fields, Mapping, final_norm_and_head

MODEL_TYPE = "opt"
OFFSET = 2


def family(f: Fields) -> tuple[dict[str, Any], Mapping]:
    f.refuse_present({"layer_norm_elementwise_affine": True, "_remove_final_layer_norm": False})
    d = f.int("hidden_size")
    if f.get("word_embed_proj_dim", default=d) != d:
        f.refuse("word_embed_proj_dim", f.data["word_embed_proj_dim"], f"posenc implements only hidden_size ({d}): "
                 "projected embeddings (project_in / project_out) are not implemented")
    bias = bool(f.get("enable_bias", default=True))
    cfg = {"variant": "learned", "vocab_size": f.int("vocab_size"), "d_model": d,
           "n_layers": f.int("num_hidden_layers"), "n_heads": f.int("num_attention_heads"),
           "d_mlp": f.int("ffn_dim"), "context": f.int("max_position_embeddings", default=2048),
           "activation": f.activation("activation_function", default="relu"), "qkv_bias": bias, "out_bias": bias,
           "mlp_bias": bias, "post_norm": not f.get("do_layer_norm_before", default=True),
           "tie_head": bool(f.get("tie_word_embeddings", default=True))}

    def weights(c, w):
        p = "model.decoder." if w.has("model.decoder.embed_tokens.weight") else "decoder."
        D, F = c.d_model, c.d_mlp
        yield "tok.weight", w.take(p + "embed_tokens.weight", (c.vocab_size, D))
        yield "pos.table.weight", w.take(p + "embed_positions.weight", (c.context + OFFSET, D))[OFFSET:]
        for i in range(c.n_layers):
            h, b = f"{p}layers.{i}.", f"blocks.{i}."
            names = ("q_proj", "k_proj", "v_proj")
            yield b + "attn.qkv.weight", torch.cat([w.take(f"{h}self_attn.{n}.weight", (D, D)) for n in names])
            yield b + "attn.out.weight", w.take(h + "self_attn.out_proj.weight", (D, D))
            yield b + "mlp.0.weight", w.take(h + "fc1.weight", (F, D))
            yield b + "mlp.2.weight", w.take(h + "fc2.weight", (D, F))
            if c.qkv_bias:
                yield b + "attn.qkv.bias", torch.cat([w.take(f"{h}self_attn.{n}.bias", (D,)) for n in names])
                yield b + "attn.out.bias", w.take(h + "self_attn.out_proj.bias", (D,))
                yield b + "mlp.0.bias", w.take(h + "fc1.bias", (F,))
                yield b + "mlp.2.bias", w.take(h + "fc2.bias", (D,))
            for theirs, ours in (("self_attn_layer_norm", "ln1"), ("final_layer_norm", "ln2")):
                yield f"{b}{ours}.weight", w.take(f"{h}{theirs}.weight", (D,))
                yield f"{b}{ours}.bias", w.take(f"{h}{theirs}.bias", (D,))
        if c.post_norm:  # the blocks end normed: no final norm
            if not c.tie_head:
                yield "head.weight", w.take("lm_head.weight", (c.vocab_size, D))
        else:
            yield from final_norm_and_head(c, w, p + "final_layer_norm")

    return cfg, weights
