"""Reading transformers' rope_scaling / rope_parameters objects into ModelConfig fields, through the factory."""

from __future__ import annotations

import json
import math
from typing import Any

from model.rope_scaling.base import FIELDS, TYPES, RopeScaling, ScalingError

COMMON_KEYS = ("rope_type", "type", "rope_theta", "partial_rotary_factor")


def _number(kind: str, key: str, value: Any, least: float | None = None) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ScalingError(f"rope_parameters.{key} = {value!r} must be a number ({kind})")
    if least is not None and value < least:
        raise ScalingError(f"rope_parameters.{key} = {value!r} must be >= {least:g} ({kind})")
    return float(value)


def parse_override(text: str) -> dict[str, Any]:
    """--rope-scaling's value: a JSON object of rope_parameters keys, or `none` for the unscaled rotation."""
    if text.strip().lower() in ("none", "default"):
        return {"rope_type": "default"}
    try:
        value = json.loads(text)
    except ValueError as err:
        raise ScalingError(f"--rope-scaling is not JSON ({err}); e.g. '{{\"rope_type\": \"yarn\", "
                           f"\"factor\": 4}}' or none") from None
    if not isinstance(value, dict):
        raise ScalingError(f"--rope-scaling must be a JSON object, got {text!r}")
    return value


def readable(own: bool = False) -> dict[str, RopeScaling]:
    """The registered types by transformers' rope_type: those a model folder may name, and posenc's own with own."""
    return {t.rope_type: t for t in TYPES.values() if own or not t.own}


def from_hf(params: dict[str, Any], *, max_positions: int | None, top_original: int | None = None,
            own: bool = False) -> dict[str, Any]:
    """ModelConfig fields for one transformers rope_scaling / rope_parameters object (rope_theta and
    partial_rotary_factor are the caller's).  max_positions: config.json's max_position_embeddings; top_original:
    a top-level original_max_position_embeddings (Phi-3 keeps it there; transformers then prefers it); own: also
    posenc's own types (ntk).  Raises ScalingError naming the field for a type or field posenc does not implement."""
    if not isinstance(params, dict):
        raise ScalingError(f"rope_parameters = {params!r} must be a JSON object")
    known = readable(own)
    kind = params.get("rope_type", params.get("type", "default"))
    if not isinstance(kind, str) or kind not in known:
        raise ScalingError(f"rope_type = {kind!r} is not supported (supported: {', '.join(known)})")
    scaling = known[kind]
    for key in params:
        if key not in scaling.keys and key not in COMMON_KEYS:
            used = [t for t, s in known.items() if key in s.keys]
            why = f"used by {', '.join(used)}" if used else "not a rope parameter posenc implements"
            raise ScalingError(f"rope_parameters.{key} is not supported with rope_type {kind!r} ({why})")
    out: dict[str, Any] = dict(FIELDS)
    out["rope_scaling"] = scaling.name
    original = scaling.original(params, max_positions, top_original)
    if scaling.needs_original:
        if isinstance(original, bool) or not isinstance(original, int) or original <= 1:
            raise ScalingError(f"original_max_position_embeddings = {original!r} must be an integer > 1 ({kind}"
                               " needs the length the model was trained at)")
        out["rope_original_context"] = original
    if "factor" in scaling.keys:
        factor = params.get("factor")
        if factor is None and scaling.factor_from_lengths and max_positions:
            factor = max_positions / original  # transformers' fallback: the ratio of the two lengths
        out["rope_factor"] = _number(kind, "factor", scaling.read_factor(factor), 1.0)
    for key, field in scaling.keys.items():
        if key in ("factor", "original_max_position_embeddings") or params.get(key) is None:
            continue
        value = params[key]
        if isinstance(FIELDS[field], bool):
            if not isinstance(value, bool):
                raise ScalingError(f"rope_parameters.{key} = {value!r} must be true or false")
            out[field] = value
        elif isinstance(FIELDS[field], tuple):
            if not isinstance(value, list) or not value:
                raise ScalingError(f"rope_parameters.{key} must be a list of numbers, got {value!r}")
            out[field] = tuple(_number(kind, key, v) for v in value)
        else:
            out[field] = _number(kind, key, value, 0.0)
    scaling.check_parameters(out)
    return out
