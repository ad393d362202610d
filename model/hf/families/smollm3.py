"""SmolLM3: LLaMA's layout with NoPE layers: no_rope_layers[i] is 1 where layer i rotates (the name reads backwards),
derived by SmolLM3Config as every no_rope_layer_interval-th layer without RoPE when absent; a sliding window only
with use_sliding_window, on the layers layer_types marks (derived: the NoPE layers)."""

from __future__ import annotations

from typing import Any

from model.hf.families.base import Fields, Mapping
from model.hf.families.llama import llama_shaped

MODEL_TYPE = "smollm3"
DEFAULT_THETA = 2_000_000.0  # SmolLM3Config.default_theta


def family(f: Fields) -> tuple[dict[str, Any], Mapping]:
    n = f.int("num_hidden_layers")
    rotates = f.rotating(n)
    sliding = bool(f.get("use_sliding_window", default=False)) and f.data.get("sliding_window") is not None
    types = f.layer_types(n, ["sliding_attention" if sliding and not r else "full_attention" for r in rotates])
    if "sliding_attention" in types and not sliding:
        f.refuse("layer_types", types, "sliding_attention layers need use_sliding_window and a sliding_window")
    return llama_shaped(f, tie_head=bool(f.get("tie_word_embeddings", default=True)),
                        **f.rope(default_theta=DEFAULT_THETA),
                        **f.layers(types, encoding=["model" if r else "none" for r in rotates]))
