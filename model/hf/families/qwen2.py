"""Qwen2: LLaMA's layout with q/k/v biases (never on the output) and a large rope theta; a sliding window when
use_sliding_window is true, in the layers layer_types names (or from max_window_layers on)."""

from __future__ import annotations

from typing import Any

from model.hf.families.base import Fields, Mapping
from model.hf.families.llama import llama_shaped

MODEL_TYPE = "qwen2"


def family(f: Fields) -> tuple[dict[str, Any], Mapping]:
    window = f.window(f.int("num_hidden_layers"), switch="use_sliding_window", per_layer=True)
    return llama_shaped(f, qkv_bias=True, out_bias=False, **window)
