"""What every family module shares: config.json fields read under their current or older names (refusals name the
file and the field), key prefixes, fused-projection layouts and the final norm and head.  The model core never sees a
family: a family only translates its config fields into architecture values and its tensor names into posenc's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from model import rope_scaling
from model.config import LayerSpec
from model.errors import ImportRefusedError

MISSING = object()
Mapping = Callable[[Any, Any], Iterator[tuple[str, torch.Tensor]]]  # (ModelConfig, Weights) -> (name, tensor)
ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "silu": "silu",
               "swish": "silu", "relu": "relu", "relu2": "relu2"}
# transformers' layer_types -> a layer record's attention
ATTENTION = {"full_attention": "full", "sliding_attention": "sliding", "chunked_attention": "chunked"}
# old causal-mask and rotary buffers some files carry: recomputed by posenc, never weights
IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias", ".attention.bias", ".attention.masked_bias",
                    ".rotary_emb.inv_freq")


class Fields:
    """config.json's values, each read under its current or older name; refusals name the file and the field."""

    def __init__(self, data: dict[str, Any], path: Path, rope_override: dict[str, Any] | None = None):
        self.data, self.path, self.rope_override = data, path, rope_override

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

    def count(self, name: str, default: Any, least: int = 0) -> int:
        """An integer >= least (null = default)."""
        value = self.get(name, default=default)
        if not isinstance(value, int) or isinstance(value, bool) or value < least:
            self.refuse(name, value, f"an integer >= {least}")
        return value

    def number(self, name: str, default: float, zero: bool = False) -> float:
        """A number > 0, or >= 0 where zero is allowed (null = default)."""
        value = self.get(name, default=default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not (value >= 0 if zero else value > 0):
            self.refuse(name, value, f"a number {'>=' if zero else '>'} 0")
        return float(value)

    def experts(self, names: tuple[str, ...], default: Any, top_k_default: int) -> tuple[int, int]:
        """The number of experts (under any of names) and num_experts_per_tok, at most that many."""
        experts, top_k = self.int(*names, default=default), self.int("num_experts_per_tok", default=top_k_default)
        if top_k > experts:
            self.refuse("num_experts_per_tok", top_k, f"at most {names[0]} ({experts})")
        return experts, top_k

    def rotating(self, n_layers: int, exact: bool = True) -> list[int]:
        """no_rope_layers (1 = the layer rotates; the name reads backwards), derived as every
        no_rope_layer_interval-th layer without RoPE when absent; exact: n_layers entries (SmolLM3Config), else an
        empty list is absent too and a longer one is cut (Llama4TextConfig)."""
        rotates = self.data.get("no_rope_layers") if exact else self.data.get("no_rope_layers") or None
        if rotates is None:
            interval = self.int("no_rope_layer_interval", default=4)
            rotates = [int((i + 1) % interval != 0) for i in range(n_layers)]
        if not isinstance(rotates, list) or not (len(rotates) == n_layers if exact else len(rotates) >= n_layers) or \
                not all(r in (0, 1) for r in rotates):
            self.refuse("no_rope_layers", rotates, f"{'' if exact else 'at least '}{n_layers} entries, each 1 (RoPE) "
                        "or 0 (NoPE)")
        return rotates[:n_layers]

    def rotary_dim(self, head_dim: int) -> int:
        """GPT-J's and CodeGen's rotary_dim: the even number of dims of each head RoPE rotates (64 when absent)."""
        rotary = self.data.get("rotary_dim", 64)
        if not isinstance(rotary, int) or isinstance(rotary, bool) or rotary <= 0 or rotary % 2 or rotary > head_dim:
            self.refuse("rotary_dim", rotary, f"an even number of dims up to the head size {head_dim}")
        return rotary

    def ssm_heads(self, *names: str, heads: int) -> int:
        """A Mamba-2 layer's head count: a multiple of the attention heads (posenc's maps average its heads in as many
        groups as the attention layers have heads)."""
        value = self.int(*names)
        if value % heads:
            self.refuse(names[0], value, f"a multiple of num_attention_heads ({heads}), whose groups the maps show")
        return value

    def refuse(self, field: str, value: Any, supported: str) -> None:
        raise ImportRefusedError(f"{self.path}: {field} = {value!r} is not supported ({supported})")

    def refuse_quantized(self, advice: str = "dequantize first") -> None:
        """config.json's quantization_config (FP8, MXFP4, ...) is refused, named by its method."""
        quantized = self.data.get("quantization_config")
        if quantized is not None:
            method = quantized.get("quant_method", quantized) if isinstance(quantized, dict) else quantized
            self.refuse("quantization_config", method, f"posenc imports float weights only: {advice}")

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
        rotary_pct / rotary_emb_base keys; every scaling type is read by model/rope_scaling.py.  A folder with both
        takes rope_scaling whole, as transformers' config does (its rope_theta then from the top-level key or the
        default).  An override (posenc-export --rope-scaling) replaces the folder's scaling and keeps its base and
        rotated fraction."""
        params = self.data.get("rope_parameters") or {}
        scaling = self.data.get("rope_scaling") or {}
        if not isinstance(params, dict) or not isinstance(scaling, dict):
            self.refuse("rope_parameters", params or scaling, "a JSON object")
        merged = dict(scaling or params)
        theta = merged.get("rope_theta", self.get("rope_theta", "rotary_emb_base", default=default_theta))
        fraction = merged.get("partial_rotary_factor", self.get("partial_rotary_factor", *fraction_names,
                                                                default=1.0))
        top_original = self.data.get("original_max_position_embeddings")
        if self.rope_override is not None:
            merged, top_original = self.rope_override, None
            theta = merged.get("rope_theta", theta)
            fraction = merged.get("partial_rotary_factor", fraction)
        try:
            fields = rope_scaling.from_hf(merged, max_positions=self.data.get("max_position_embeddings"),
                                          top_original=top_original)
        except rope_scaling.ScalingError as err:
            raise ImportRefusedError(f"{self.path}: {err}") from None
        return {"rope_base": float(theta), "rope_fraction": float(fraction), **fields}

    def window(self, n_layers: int, switch: str | None = None, per_layer: bool = False) -> dict[str, Any]:
        """Sliding-window attention: sliding_window (null = none), enabled by the boolean field `switch` where the
        family has one (Qwen's use_sliding_window); per_layer families name the windowed layers in layer_types
        or window the layers from max_window_layers on (transformers' rule when layer_types is absent)."""
        size = self.data.get("sliding_window")
        if size is None or (switch is not None and not self.data.get(switch, False)):
            return {}
        if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
            self.refuse("sliding_window", size, "a positive integer or null")
        layers = list(range(n_layers))
        if per_layer and self.data.get("layer_types") is not None:
            types = self.data["layer_types"]
            if not isinstance(types, list) or len(types) != n_layers or not set(types) <= {
                    "full_attention", "sliding_attention"}:
                self.refuse("layer_types", types, f"{n_layers} entries, each full_attention or sliding_attention")
            layers = [i for i, kind in enumerate(types) if kind == "sliding_attention"]
        elif per_layer:
            first = self.get("max_window_layers", default=0)
            if not isinstance(first, int) or isinstance(first, bool) or first < 0:
                self.refuse("max_window_layers", first, "a non-negative integer")
            layers = layers[first:]
        if not layers:
            return {}
        return {"sliding_window": size, "layers": [LayerSpec("sliding" if i in layers else "full")
                                                   for i in range(n_layers)]}

    def layer_types(self, n_layers: int, derived: list[str],
                    kinds: tuple[str, ...] = ("full_attention", "sliding_attention")) -> list[str]:
        """config.json's layer_types, or `derived` (what the family's config class builds when it is absent)."""
        types = self.data.get("layer_types")
        types = derived if types is None else types
        if not isinstance(types, list) or len(types) != n_layers or not set(types) <= set(kinds):
            self.refuse("layer_types", types, f"{n_layers} entries, each {' or '.join(kinds)}")
        return types

    def layers(self, types: list[str], window: int | None = None, **per_layer: list[Any]) -> dict[str, Any]:
        """Each layer's record (config value layers): its attention from its type (transformers masks each layer by
        its type), the rest from per_layer's lists (encoding=[...], qk_norm=[...], ...); and sliding_window (`window`
        when the key is absent) where `types` marks sliding_attention layers."""
        records = [LayerSpec(ATTENTION[kind], **{k: v[i] for k, v in per_layer.items()})
                   for i, kind in enumerate(types)]
        if "sliding_attention" not in types:
            return {"layers": records}
        size = self.data.get("sliding_window", window)
        if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
            self.refuse("sliding_window", size, "a positive integer where layer_types has sliding_attention layers")
        return {"sliding_window": size, "layers": records}

    def unclamped_time_steps(self) -> None:
        """Refuse a Mamba-2 time_step_limit other than [0, inf] (transformers writes infinity as
        {"__float__": "Infinity"}): its chunked scan clamps there, its one-token step does not."""
        limit = self.data.get("time_step_limit")
        bounds = [float(v["__float__"]) if isinstance(v, dict) and "__float__" in v else v for v in limit or ()]
        if limit is not None and bounds != [0.0, float("inf")]:
            self.refuse("time_step_limit", limit, "posenc implements the unclamped time step, [0, inf]")

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

def separate_attention(c, w, h: str, b: str, module: str = "self_attn", out: str = "o_proj"):
    """Attention kept as separate q_proj, k_proj, v_proj and an output projection (`out`) under `h` + `module` (LLaMA's
    names, and many families'; LFM2's output is out_proj, Nemotron-H's module is mixer): q, k and v fused into
    posenc's qkv (and their biases where the config has them), and the output."""
    D, H, KVH, Dh = c.d_model, c.n_heads, c.kv_heads, c.head_dim
    sizes = (("q_proj", H * Dh), ("k_proj", KVH * Dh), ("v_proj", KVH * Dh))
    yield b + "attn.qkv.weight", torch.cat([w.take(f"{h}{module}.{n}.weight", (s, D)) for n, s in sizes])
    if c.qkv_bias:
        yield b + "attn.qkv.bias", torch.cat([w.take(f"{h}{module}.{n}.bias", (s,)) for n, s in sizes])
    yield b + "attn.out.weight", w.take(f"{h}{module}.{out}.weight", (D, H * Dh))
    if c.out_bias:
        yield b + "attn.out.bias", w.take(f"{h}{module}.{out}.bias", (D,))


def final_norm_and_head(c, w, norm: str, head: str = "lm_head.weight"):
    """The final norm (its bias only for LayerNorm) and, for an untied model, the output head."""
    yield "ln_f.weight", w.take(norm + ".weight", (c.d_model,))
    if c.norm == "layernorm" and c.norm_bias:
        yield "ln_f.bias", w.take(norm + ".bias", (c.d_model,))
    if not c.tie_head:
        yield "head.weight", w.take(head, (c.vocab_size, c.d_model))
