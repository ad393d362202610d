"""Qwen3: LLaMA's layout with an RMSNorm over each head's queries and keys before RoPE (q_norm, k_norm: one weight
over head_dim shared by the heads), attention_bias on q/k/v and the output; Qwen2's optional sliding window."""

from __future__ import annotations

from typing import Any

from model.hf.families.base import Fields, Mapping
from model.hf.families.llama import llama_shaped

MODEL_TYPE = "qwen3"


def family(f: Fields) -> tuple[dict[str, Any], Mapping]:
    window = f.window(f.int("num_hidden_layers"), switch="use_sliding_window", per_layer=True)
    return llama_shaped(f, qk_norm="rmsnorm", **window)
