"""One layer's record (ModelConfig.layers): what mixes its tokens, what kind of attention it has and which positional
encoding it applies, as kinds; and the reading of older configs' per-layer lists into records.  Stdlib only, beside
model/config.py in the worker's image.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

ATTENTIONS = ("full", "sliding", "chunked")
ENCODINGS = ("model", "local", "none")
# what mixes a layer's tokens: attention, LFM2's gated short convolution, a Mamba-2 state-space layer (SSD), or
# nothing (a block that is its MLP alone: Nemotron-H's)
MIXERS = ("attention", "short_conv", "mamba2", "none")
# the per-layer lists older configs carry (checkpoints, model.json): ModelConfig.from_dict reads them into layers
OLD_LAYER_LISTS = ("window_layers", "chunk_layers", "nope_layers", "qk_norm_layers", "expert_layers", "dense_layers")


@dataclass(frozen=True)
class LayerSpec:
    """One layer as kinds (ModelConfig.layers); the sizes, bases and weights they use are the model's own values."""
    attention: str = "full"  # "full", "sliding" (keys < sliding_window back) or "chunked" (blocks of attention_chunk)
    # "model": the variant's (RoPE at rope_base, scaled); "local": RoPE at local_rope_base, unscaled (Gemma 3's
    # sliding layers); "none": no positional encoding (NoPE: SmolLM3, Llama 4, Cohere2)
    encoding: str = "model"
    qk_norm: bool = True  # the model's q/k norm (qk_norm) in this layer; false: none here (Llama 4's NoPE layers)
    experts: bool = True  # the model's experts (n_experts) in this layer; false: one dense d_mlp MLP here
    temperature: bool = False  # queries scaled by the position's temperature (temperature_floor, temperature_scale)
    # "short_conv": no attention in this layer but a gated causal convolution over conv_kernel tokens (LFM2's conv
    # layers); "mamba2": a Mamba-2 layer (Granite 4.0-H); either is where the layer's order comes from (model/mixers.py,
    # model/ssm.py); "none": no token mixing at all (its maps are the identity)
    mixer: str = "attention"
    mlp: bool = True  # false: the layer is its mixer alone, no MLP branch (Nemotron-H's blocks)


def legacy_layers(values: dict[str, Any], old: dict[str, Any]) -> list[LayerSpec]:
    """Each layer's record from an older config's lists as they were read: window_layers, chunk_layers, qk_norm_layers
    (empty = every layer), nope_layers (tempered with temperature_floor), expert_layers (empty = from dense_layers)."""
    specs = []
    for i in range(values["n_layers"]):
        windowed = values["sliding_window"] > 0 and i in (old.get("window_layers") or [i])
        chunked = values["attention_chunk"] > 0 and i in (old.get("chunk_layers") or [i])
        nope = i in (old.get("nope_layers") or ())
        experts = i in old["expert_layers"] if old.get("expert_layers") else i >= (old.get("dense_layers") or 0)
        specs.append(LayerSpec("sliding" if windowed else "chunked" if chunked else "full",
                               "none" if nope else "local" if windowed and values["local_rope_base"] else "model",
                               i in (old.get("qk_norm_layers") or [i]) or values["qk_norm"] == "none",
                               experts or not values["n_experts"], nope and values["temperature_floor"] > 0))
    return specs
