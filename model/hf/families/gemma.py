"""Gemma: LLaMA's layout with the token embeddings multiplied by sqrt(hidden_size) (the tied head reads the unscaled
table), RMSNorms that multiply by (1 + weight) (read here as weight + 1) and GeGLU (the tanh GELU; Gemma's legacy
hidden_act "gelu" means it too)."""

from __future__ import annotations

from typing import Any

from model.hf.families.base import ACTIVATIONS, Fields, Mapping
from model.hf.families.llama import llama_shaped

MODEL_TYPE = "gemma"
NORMS = ("ln1.weight", "ln2.weight", "ln_f.weight")


def family(f: Fields) -> tuple[dict[str, Any], Mapping]:
    f.refuse_present({"use_bidirectional_attention": False})
    act = f.get("hidden_act", "hidden_activation", default="gelu_pytorch_tanh")
    if act == "gelu":  # transformers' GemmaConfig turns the released configs' "gelu" into the tanh form
        act = "gelu_pytorch_tanh"
    if act not in ACTIVATIONS:
        f.refuse("hidden_act", act, f"supported: {', '.join(ACTIVATIONS)}")
    cfg, weights = llama_shaped(f, activation=ACTIVATIONS[act],
                                embed_scale=float(f.int("hidden_size")) ** 0.5,
                                tie_head=bool(f.get("tie_word_embeddings", default=True)))

    def gemma_weights(c, w):
        for name, tensor in weights(c, w):
            yield name, tensor + 1 if name.endswith(NORMS) else tensor

    return cfg, gemma_weights
