"""Hugging Face model_type -> the module that reads it.  Each family is one module here with MODEL_TYPE and
family(fields) -> (posenc config values, weight mapping); adding a family is its module and one registry line."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from model.hf.families import (
    bloom,
    codegen,
    cohere2,
    deepseek_v3,
    falcon,
    falcon_h1,
    gemma,
    gemma2,
    gemma3,
    gemma4,
    gpt2,
    gpt_bigcode,
    gpt_neox,
    gpt_oss,
    gptj,
    granitemoehybrid,
    lfm2,
    llama,
    llama4,
    ministral,
    mistral,
    mpt,
    nemotron_h,
    olmo2,
    opt,
    phi,
    phi3,
    qwen2,
    qwen3,
    qwen3_next,
    smollm3,
    stablelm,
    starcoder2,
)
from model.hf.families.base import IGNORED_SUFFIXES, Fields, Mapping

# one entry per family
REGISTRY = (gpt2, gpt_neox, llama, bloom, qwen2, mistral, qwen3, gemma, stablelm, gptj, mpt, falcon, phi3, opt,
            smollm3, ministral, gemma2, gemma3, cohere2, olmo2,
            starcoder2, phi, codegen, gpt_bigcode, gpt_oss, deepseek_v3, llama4, gemma4, lfm2,
            granitemoehybrid, nemotron_h, falcon_h1, qwen3_next)

FAMILIES: dict[str, Callable[[Fields], tuple[dict[str, Any], Mapping]]] = {m.MODEL_TYPE: m.family for m in REGISTRY}

__all__ = ["FAMILIES", "IGNORED_SUFFIXES", "Fields", "Mapping"]
