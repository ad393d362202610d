"""Hugging Face model_type -> posenc config values and weight names.  The model core never sees a family: each
family here only translates its config fields into architecture values and its tensor names (and layouts) into
posenc's parameters.  Whatever posenc does not implement exactly is refused, naming the field and what is supported.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from model.errors import ImportRefusedError

MISSING = object()
Mapping = Callable[[Any, Any], Iterator[tuple[str, torch.Tensor]]]  # (ModelConfig, Weights) -> (name, tensor)
ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "silu": "silu",
               "swish": "silu"}
ROPE_TYPES = ("default", "linear")
# old causal-mask and rotary buffers some files carry: recomputed by posenc, never weights
IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias", ".attention.bias", ".attention.masked_bias",
                    ".rotary_emb.inv_freq")


class Fields:
    """config.json's values, each read under its current or older name; refusals name the file and the field."""

    def __init__(self, data: dict[str, Any], path: Path):
        self.data, self.path = data, path

    def get(self, *names: str, default: Any = MISSING) -> Any:
        for name in names:
            if self.data.get(name) is not None:
                return self.data[name]
        if default is MISSING:
            raise ImportRefusedError(f"{self.path}: no {' or '.join(names)}")
        return default

    def int(self, *names: str, default: Any = MISSING) -> int:
        value = self.get(*names, default=default)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ImportRefusedError(f"{self.path}: {names[0]} must be a positive integer, got {value!r}")
        return value

    def refuse(self, field: str, value: Any, supported: str) -> None:
        raise ImportRefusedError(f"{self.path}: {field} = {value!r} is not supported ({supported})")

    def require(self, field: str, allowed: tuple, default: Any, supported: str) -> Any:
        value = self.data.get(field, default)
        value = default if value is None else value
        if value not in allowed:
            self.refuse(field, value, supported)
        return value

    def activation(self, *names: str, default: str) -> str:
        value = self.get(*names, default=default)
        if value not in ACTIVATIONS:
            self.refuse(names[0], value, f"supported: {', '.join(ACTIVATIONS)}")
        return ACTIVATIONS[value]

    def rope(self, default_theta: float = 10000.0, fraction_names: tuple[str, ...] = ()) -> dict[str, Any]:
        """RoPE settings from transformers 5's rope_parameters or the older rope_theta / rope_scaling /
        rotary_pct / rotary_emb_base keys."""
        params = self.data.get("rope_parameters") or {}
        scaling = self.data.get("rope_scaling") or {}
        if not isinstance(params, dict) or not isinstance(scaling, dict):
            self.refuse("rope_parameters", params or scaling, "a JSON object")
        merged = {**scaling, **params}
        kind = merged.get("rope_type", merged.get("type", "default"))
        if kind not in ROPE_TYPES:
            self.refuse("rope_type", kind, f"supported: {', '.join(ROPE_TYPES)}; dynamic, yarn, llama3 and others "
                        "change the frequencies in ways posenc does not implement")
        theta = merged.get("rope_theta", self.get("rope_theta", "rotary_emb_base", default=default_theta))
        fraction = merged.get("partial_rotary_factor", self.get("partial_rotary_factor", *fraction_names,
                                                                default=1.0))
        out = {"rope_base": float(theta), "rope_fraction": float(fraction)}
        if kind == "linear":  # position interpolation: posenc's linear scaling, theta / factor
            factor = merged.get("factor")
            if not isinstance(factor, (int, float)) or factor < 1:
                self.refuse("rope_parameters.factor", factor, "linear scaling needs a factor >= 1")
            out.update(rope_scaling="linear", rope_factor=float(factor))
        return out

    def refuse_present(self, fields: dict[str, Any]) -> None:
        """Fields that change the model when set to anything but the given harmless value(s)."""
        for field, harmless in fields.items():
            value = self.data.get(field)
            ok = harmless if isinstance(harmless, tuple) else (harmless,)
            if value is not None and value not in ok:
                self.refuse(field, value, f"posenc implements only {' or '.join(map(repr, ok))}")


def prefixed(w, *candidates: str) -> str:
    """The key prefix a file uses ('transformer.' from *LMHeadModel, '' from bare base-model files)."""
    for prefix, probe in candidates:
        if w.has(prefix + probe):
            return prefix
    return candidates[0][0]


def per_head_qkv(t: torch.Tensor, heads: int) -> torch.Tensor:
    """(heads, 3, Dh, ...) interleaved per head (GPT-NeoX, BLOOM) -> posenc's [Q all heads | K | V]."""
    return t.reshape(heads, 3, -1, *t.shape[1:]).transpose(0, 1).reshape(t.shape)


# --- GPT-2 ------------------------------------------------------------------------------------------------------

def final_norm_and_head(c, w, norm: str, head: str = "lm_head.weight"):
    """The final norm (its bias only for LayerNorm) and, for an untied model, the output head."""
    yield "ln_f.weight", w.take(norm + ".weight", (c.d_model,))
    if c.norm == "layernorm":
        yield "ln_f.bias", w.take(norm + ".bias", (c.d_model,))
    if not c.tie_head:
        yield "head.weight", w.take(head, (c.vocab_size, c.d_model))


def gpt2(f: Fields) -> tuple[dict[str, Any], Mapping]:
    f.refuse_present({"scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False,
                      "add_cross_attention": False, "scale_attn_weights": True})
    d = f.int("n_embd", "hidden_size")
    cfg = {"variant": "learned", "vocab_size": f.int("vocab_size"), "d_model": d,
           "n_layers": f.int("n_layer", "num_hidden_layers"), "n_heads": f.int("n_head", "num_attention_heads"),
           "d_mlp": f.int("n_inner", default=4 * d), "context": f.int("n_positions", "max_position_embeddings"),
           "layer_norm_eps": float(f.get("layer_norm_epsilon", default=1e-5)),
           "activation": f.activation("activation_function", default="gelu_new"),
           "tie_head": bool(f.get("tie_word_embeddings", default=True))}

    def weights(c, w):
        p = prefixed(w, ("transformer.", "wte.weight"), ("", "wte.weight"))
        D, F = c.d_model, c.d_mlp
        yield "tok.weight", w.take(p + "wte.weight", (c.vocab_size, D))
        yield "pos.table.weight", w.take(p + "wpe.weight", (c.context, D))
        for i in range(c.n_layers):
            h, b = f"{p}h.{i}.", f"blocks.{i}."
            for name, shape in (("attn.c_attn", (D, 3 * D)), ("attn.c_proj", (D, D)), ("mlp.c_fc", (D, F)),
                                ("mlp.c_proj", (F, D))):
                ours = {"attn.c_attn": "attn.qkv", "attn.c_proj": "attn.out", "mlp.c_fc": "mlp.0",
                        "mlp.c_proj": "mlp.2"}[name]
                yield b + ours + ".weight", w.take(h + name + ".weight", shape).t()  # Conv1D stores (in, out)
                yield b + ours + ".bias", w.take(h + name + ".bias", (shape[1],))
            for ln, ours in (("ln_1", "ln1"), ("ln_2", "ln2")):
                yield b + ours + ".weight", w.take(h + ln + ".weight", (D,))
                yield b + ours + ".bias", w.take(h + ln + ".bias", (D,))
        yield from final_norm_and_head(c, w, p + "ln_f")

    return cfg, weights


# --- GPT-NeoX / Pythia -------------------------------------------------------------------------------------------

def gpt_neox(f: Fields) -> tuple[dict[str, Any], Mapping]:
    bias = bool(f.get("attention_bias", default=True))
    cfg = {"variant": "rope", "vocab_size": f.int("vocab_size"), "d_model": f.int("hidden_size"),
           "n_layers": f.int("num_hidden_layers"), "n_heads": f.int("num_attention_heads"),
           "d_mlp": f.int("intermediate_size"), "context": f.int("max_position_embeddings", default=2048),
           "layer_norm_eps": float(f.get("layer_norm_eps", default=1e-5)),
           "activation": f.activation("hidden_act", default="gelu"),
           "parallel_residual": bool(f.get("use_parallel_residual", default=True)),
           "qkv_bias": bias, "out_bias": bias, "tie_head": bool(f.get("tie_word_embeddings", default=False)),
           **f.rope(fraction_names=("rotary_pct",))}
    if "rotary_pct" not in f.data and "partial_rotary_factor" not in f.data and not (
            f.data.get("rope_parameters") or {}).get("partial_rotary_factor"):
        cfg["rope_fraction"] = 0.25  # GPTNeoXConfig's default

    def weights(c, w):
        D, F, H = c.d_model, c.d_mlp, c.n_heads
        yield "tok.weight", w.take("gpt_neox.embed_in.weight", (c.vocab_size, D))
        for i in range(c.n_layers):
            h, b = f"gpt_neox.layers.{i}.", f"blocks.{i}."
            yield b + "attn.qkv.weight", per_head_qkv(w.take(h + "attention.query_key_value.weight", (3 * D, D)), H)
            if c.qkv_bias:
                yield b + "attn.qkv.bias", per_head_qkv(w.take(h + "attention.query_key_value.bias", (3 * D,)), H)
            yield b + "attn.out.weight", w.take(h + "attention.dense.weight", (D, D))
            if c.out_bias:
                yield b + "attn.out.bias", w.take(h + "attention.dense.bias", (D,))
            yield b + "mlp.0.weight", w.take(h + "mlp.dense_h_to_4h.weight", (F, D))
            yield b + "mlp.0.bias", w.take(h + "mlp.dense_h_to_4h.bias", (F,))
            yield b + "mlp.2.weight", w.take(h + "mlp.dense_4h_to_h.weight", (D, F))
            yield b + "mlp.2.bias", w.take(h + "mlp.dense_4h_to_h.bias", (D,))
            for ln, ours in (("input_layernorm", "ln1"), ("post_attention_layernorm", "ln2")):
                yield b + ours + ".weight", w.take(h + ln + ".weight", (D,))
                yield b + ours + ".bias", w.take(h + ln + ".bias", (D,))
        # transformers 5 saves the untied head as embed_out.weight, its module is lm_head
        head = "embed_out.weight" if w.has("embed_out.weight") or not w.has("lm_head.weight") else "lm_head.weight"
        yield from final_norm_and_head(c, w, "gpt_neox.final_layer_norm", head)

    return cfg, weights


# --- LLaMA-shaped -----------------------------------------------------------------------------------------------

def llama(f: Fields) -> tuple[dict[str, Any], Mapping]:
    f.refuse_present({"sliding_window": (), "use_sliding_window": False})
    heads = f.int("num_attention_heads")
    bias = bool(f.get("attention_bias", default=False))
    cfg = {"variant": "rope", "vocab_size": f.int("vocab_size"), "d_model": f.int("hidden_size"),
           "n_layers": f.int("num_hidden_layers"), "n_heads": heads,
           "n_kv_heads": f.int("num_key_value_heads", default=heads),
           "d_head": f.int("head_dim", default=f.int("hidden_size") // heads),
           "d_mlp": f.int("intermediate_size"), "context": f.int("max_position_embeddings", default=2048),
           "norm": "rmsnorm", "layer_norm_eps": float(f.get("rms_norm_eps", default=1e-6)),
           "mlp": "gated", "activation": f.activation("hidden_act", default="silu"),
           "qkv_bias": bias, "out_bias": bias, "mlp_bias": bool(f.get("mlp_bias", default=False)),
           "tie_head": bool(f.get("tie_word_embeddings", default=False)), **f.rope()}

    def weights(c, w):
        D, F, H, KVH, Dh = c.d_model, c.d_mlp, c.n_heads, c.kv_heads, c.head_dim
        yield "tok.weight", w.take("model.embed_tokens.weight", (c.vocab_size, D))
        for i in range(c.n_layers):
            h, b = f"model.layers.{i}.", f"blocks.{i}."
            sizes = (("q_proj", H * Dh), ("k_proj", KVH * Dh), ("v_proj", KVH * Dh))
            yield b + "attn.qkv.weight", torch.cat([w.take(f"{h}self_attn.{n}.weight", (s, D)) for n, s in sizes])
            if c.qkv_bias:
                yield b + "attn.qkv.bias", torch.cat([w.take(f"{h}self_attn.{n}.bias", (s,)) for n, s in sizes])
            yield b + "attn.out.weight", w.take(h + "self_attn.o_proj.weight", (D, H * Dh))
            if c.out_bias:
                yield b + "attn.out.bias", w.take(h + "self_attn.o_proj.bias", (D,))
            for name, shape in (("gate", (F, D)), ("up", (F, D)), ("down", (D, F))):
                yield f"{b}mlp.{name}.weight", w.take(f"{h}mlp.{name}_proj.weight", shape)
                if c.mlp_bias:
                    yield f"{b}mlp.{name}.bias", w.take(f"{h}mlp.{name}_proj.bias", (shape[0],))
            yield b + "ln1.weight", w.take(h + "input_layernorm.weight", (D,))
            yield b + "ln2.weight", w.take(h + "post_attention_layernorm.weight", (D,))
        yield from final_norm_and_head(c, w, "model.norm")

    return cfg, weights


# --- BLOOM ------------------------------------------------------------------------------------------------------

def bloom(f: Fields) -> tuple[dict[str, Any], Mapping]:
    f.refuse_present({"apply_residual_connection_post_layernorm": False})
    d = f.int("hidden_size", "n_embed")
    cfg = {"variant": "alibi", "vocab_size": f.int("vocab_size"), "d_model": d, "n_layers": f.int("n_layer"),
           "n_heads": f.int("n_head", "num_attention_heads"), "d_mlp": 4 * d,
           "context": f.int("seq_length", default=2048),
           "layer_norm_eps": float(f.get("layer_norm_epsilon", default=1e-5)), "activation": "gelu_tanh",
           "embed_norm": True, "tie_head": bool(f.get("tie_word_embeddings", default=True))}

    def weights(c, w):
        p = prefixed(w, ("transformer.", "word_embeddings.weight"), ("", "word_embeddings.weight"))
        D, F, H = c.d_model, c.d_mlp, c.n_heads
        yield "tok.weight", w.take(p + "word_embeddings.weight", (c.vocab_size, D))
        yield "ln_emb.weight", w.take(p + "word_embeddings_layernorm.weight", (D,))
        yield "ln_emb.bias", w.take(p + "word_embeddings_layernorm.bias", (D,))
        for i in range(c.n_layers):
            h, b = f"{p}h.{i}.", f"blocks.{i}."
            yield b + "attn.qkv.weight", per_head_qkv(w.take(h + "self_attention.query_key_value.weight",
                                                               (3 * D, D)), H)
            yield b + "attn.qkv.bias", per_head_qkv(w.take(h + "self_attention.query_key_value.bias", (3 * D,)), H)
            yield b + "attn.out.weight", w.take(h + "self_attention.dense.weight", (D, D))
            yield b + "attn.out.bias", w.take(h + "self_attention.dense.bias", (D,))
            yield b + "mlp.0.weight", w.take(h + "mlp.dense_h_to_4h.weight", (F, D))
            yield b + "mlp.0.bias", w.take(h + "mlp.dense_h_to_4h.bias", (F,))
            yield b + "mlp.2.weight", w.take(h + "mlp.dense_4h_to_h.weight", (D, F))
            yield b + "mlp.2.bias", w.take(h + "mlp.dense_4h_to_h.bias", (D,))
            for ln, ours in (("input_layernorm", "ln1"), ("post_attention_layernorm", "ln2")):
                yield b + ours + ".weight", w.take(h + ln + ".weight", (D,))
                yield b + ours + ".bias", w.take(h + ln + ".bias", (D,))
        yield from final_norm_and_head(c, w, p + "ln_f")

    return cfg, weights


FAMILIES: dict[str, Callable[[Fields], tuple[dict[str, Any], Mapping]]] = {
    "gpt2": gpt2, "gpt_neox": gpt_neox, "llama": llama, "bloom": bloom,
}
