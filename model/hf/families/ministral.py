"""Ministral: LLaMA's layout without biases and a sliding window per layer: the layers layer_types marks
sliding_attention (MinistralConfig: every layer when layer_types is absent and sliding_window is set)."""

from __future__ import annotations

from typing import Any

from model.hf.families.base import Fields, Mapping
from model.hf.families.llama import llama_shaped

MODEL_TYPE = "ministral"
DEFAULT_WINDOW = 4096


def family(f: Fields) -> tuple[dict[str, Any], Mapping]:
    n = f.int("num_hidden_layers")
    size = f.data.get("sliding_window", DEFAULT_WINDOW)  # MinistralConfig's default when the key is absent
    kind = "sliding_attention" if size is not None else "full_attention"
    return llama_shaped(f, qkv_bias=False, out_bias=False, mlp_bias=False,
                        **f.layers(f.layer_types(n, [kind] * n), window=DEFAULT_WINDOW))
