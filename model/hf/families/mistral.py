"""Mistral: LLaMA's layout with a sliding window over every layer (sliding_window; null = none)."""

from __future__ import annotations

from typing import Any

from model.hf.families.base import Fields, Mapping
from model.hf.families.llama import llama_shaped

MODEL_TYPE = "mistral"


def family(f: Fields) -> tuple[dict[str, Any], Mapping]:
    return llama_shaped(f, **f.window(f.int("num_hidden_layers")))
