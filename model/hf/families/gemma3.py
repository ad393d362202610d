"""Gemma 3's text model (model_type gemma3_text): Gemma 2's block with a (1 + weight) RMSNorm over each head's
queries and keys before RoPE, and RoPE per layer type: rope_parameters holds one entry per type, the global
(full_attention) layers' base and scaling and the local (sliding_attention) layers' base, unscaled (older configs:
rope_theta and rope_scaling for the global layers, rope_local_base_freq for the local ones).  layer_types, when
absent, is Gemma3TextConfig's: every sliding_window_pattern-th layer global (6), the rest sliding."""

from __future__ import annotations

from typing import Any

from model.hf.families.base import Fields, Mapping
from model.hf.families.gemma2 import gemma2_shaped

MODEL_TYPE = "gemma3_text"
THETA = {"full_attention": 1_000_000.0, "sliding_attention": 10_000.0}  # Gemma3TextConfig.default_theta


def family(f: Fields) -> tuple[dict[str, Any], Mapping]:
    n = f.int("num_hidden_layers")
    pattern = f.int("sliding_window_pattern", default=6)
    types = f.layer_types(n, ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)])
    params = f.data.get("rope_parameters") or {}
    if not isinstance(params, dict):
        f.refuse("rope_parameters", params, "a JSON object")
    per_type = set(params) & set(THETA)
    if per_type and not set(params) <= set(THETA):
        f.refuse("rope_parameters", params, "one entry per layer type, full_attention and sliding_attention")
    glob = params.get("full_attention") if per_type else params or None
    local = dict(params.get("sliding_attention") or {}) if per_type else {}
    local.setdefault("rope_theta", f.get("rope_local_base_freq", default=THETA["sliding_attention"]))
    if local.get("rope_type", "default") != "default" or set(local) - {"rope_type", "rope_theta"}:
        f.refuse("rope_parameters.sliding_attention", local, "the local layers' RoPE unscaled (rope_type default)")
    rope = Fields({**f.data, "rope_parameters": glob}, f.path, f.rope_override).rope(THETA["full_attention"])
    return gemma2_shaped(f, types, ["local" if t == "sliding_attention" else "model" for t in types], qk_norm="rmsnorm",
                         local_rope_base=float(local["rope_theta"]), **rope)
