"""RoPE context extension: the frequencies and attention factor of every scaling type, one implementation shared by
the rope variant (own models and imported ones), the `rope-scale` command and the importer.

Types (the names transformers uses where it has them; ntk is posenc's own static NTK-aware base):

  none      theta_i = base^(-2i/d)                                        (Su et al., RoFormer)
  linear    theta_i / s                                                   (position interpolation, Chen et al. 2023)
  ntk       base' = base * s^(d/(d-2)), the slowest pair slows by s       (NTK-aware scaling, bloc97 2023)
  dynamic   ntk's base stretched by (s*n/L0 - (s-1)) once the length n passes L0, recomputed from n every call
  yarn      per pair a blend of theta_i / s and theta_i, ramped over pair indices set by beta_fast / beta_slow
            rotations over L0, and cos/sin multiplied by 0.1 ln s + 1 (or mscale's ratio)   (Peng et al. 2023)
  llama3    by wavelength: slow pairs / s, fast pairs kept, a smooth blend between        (Meta, Llama 3.1)
  longrope  theta_i / f_i with f = long_factor once the length passes L0, short_factor before, and cos/sin
            multiplied by sqrt(1 + ln s / ln L0)                                          (Ding et al. 2024)

s = rope_factor, L0 = rope_original_context (0: the trained context).  dynamic and longrope depend on the length
the call sees, n = the last position of the row + 1 (past + new on a cached step), computed per row in the graph;
the others are constants of the config.  Everything is float32 torch arithmetic in the order transformers'
modeling_rope_utils writes it, so imported models match it to the last bits that matter.
"""

from __future__ import annotations

import json
import math
from typing import Any

import torch

from model.config import ROPE_SCALINGS as TYPES  # noqa: F401  (the config validates names against it)
from model.errors import ConfigError

LENGTH_DEPENDENT = ("dynamic", "longrope")

# rope_parameters keys each type reads (beside rope_type / type, rope_theta, partial_rotary_factor); the value is
# the ModelConfig field it sets.  transformers' own names, so a --rope-scaling override reads like a config.json.
HF_KEYS: dict[str, dict[str, str]] = {
    "default": {},
    "linear": {"factor": "rope_factor"},
    # transformers' dynamic reads max_position_embeddings as L0; an original_max_position_embeddings beside it is
    # ignored there and here
    "dynamic": {"factor": "rope_factor", "original_max_position_embeddings": ""},
    "yarn": {"factor": "rope_factor", "original_max_position_embeddings": "rope_original_context",
             "attention_factor": "rope_attention_factor", "beta_fast": "rope_beta_fast",
             "beta_slow": "rope_beta_slow", "mscale": "rope_mscale", "mscale_all_dim": "rope_mscale_all_dim",
             "truncate": "rope_truncate"},
    "llama3": {"factor": "rope_factor", "original_max_position_embeddings": "rope_original_context",
               "low_freq_factor": "rope_low_freq_factor", "high_freq_factor": "rope_high_freq_factor"},
    "longrope": {"factor": "rope_factor", "original_max_position_embeddings": "rope_original_context",
                 "attention_factor": "rope_attention_factor", "short_factor": "rope_short_factor",
                 "long_factor": "rope_long_factor"},
}
# posenc's own types, accepted where posenc picks the scaling (rope-scale, --rope-scaling), never from a folder
OWN_KEYS: dict[str, dict[str, str]] = {"ntk": {"factor": "rope_factor"}}
COMMON_KEYS = ("rope_type", "type", "rope_theta", "partial_rotary_factor")
# ModelConfig fields that hold scaling parameters, with their defaults (what "none" resets them to)
FIELDS: dict[str, Any] = {"rope_scaling": "none", "rope_factor": 1.0, "rope_original_context": 0,
                          "rope_attention_factor": 0.0, "rope_beta_fast": 32.0, "rope_beta_slow": 1.0,
                          "rope_mscale": 0.0, "rope_mscale_all_dim": 0.0, "rope_truncate": True,
                          "rope_low_freq_factor": 1.0, "rope_high_freq_factor": 4.0, "rope_short_factor": (),
                          "rope_long_factor": ()}


class ScalingError(ConfigError):
    """A rope_scaling / rope_parameters object posenc cannot reproduce exactly (the message names the field)."""


def original_context(cfg) -> int:
    return cfg.rope_original_context or cfg.context


def default_inv_freq(base, dim: int, device=None) -> torch.Tensor:
    """theta_i = 1 / base^(2i/d), float32, written as HF LLaMA and GPT-NeoX write it (base^(-2i/d) rounds
    differently in the last bit, which position x angle carries into scores at long lengths)."""
    exponent = torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim
    if not isinstance(base, torch.Tensor):
        base = torch.tensor(float(base), dtype=torch.float32, device=device)
    return 1.0 / torch.pow(base[..., None] if base.dim() else base, exponent)


def attention_factor(cfg) -> float:
    """What cos and sin are multiplied by (YaRN's and LongRoPE's attention temperature; 1 for the others)."""
    if cfg.rope_attention_factor:
        return float(cfg.rope_attention_factor)
    s = float(cfg.rope_factor)
    if cfg.rope_scaling == "yarn":
        def m(scale: float, k: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * k * math.log(scale) + 1.0
        if cfg.rope_mscale and cfg.rope_mscale_all_dim:
            return float(m(s, cfg.rope_mscale) / m(s, cfg.rope_mscale_all_dim))
        return m(s)
    if cfg.rope_scaling == "longrope":
        return 1.0 if s <= 1 else math.sqrt(1 + math.log(s) / math.log(original_context(cfg)))
    return 1.0


def _yarn(cfg, dim: int, device) -> torch.Tensor:
    base, s, L0 = float(cfg.rope_base), float(cfg.rope_factor), original_context(cfg)

    def pair_index(rotations: float) -> float:  # the pair that turns `rotations` times over L0
        return dim * math.log(L0 / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = pair_index(cfg.rope_beta_fast), pair_index(cfg.rope_beta_slow)
    if cfg.rope_truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device=device) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: the pair keeps its frequency (extrapolates); 0: it is interpolated by s
    powers = base ** (torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim)
    return 1.0 / (s * powers) * (1 - keep) + 1.0 / powers * keep


def _llama3(cfg, dim: int, device) -> torch.Tensor:
    theta = default_inv_freq(cfg.rope_base, dim, device)
    s, L0 = float(cfg.rope_factor), original_context(cfg)
    low, high = float(cfg.rope_low_freq_factor), float(cfg.rope_high_freq_factor)
    wavelength = 2 * math.pi / theta
    slowed = torch.where(wavelength > L0 / low, theta / s, theta)
    t = (L0 / wavelength - low) / (high - low)
    blend = (1 - t) * slowed / s + t * slowed
    middle = ~(wavelength < L0 / high) * ~(wavelength > L0 / low)
    return torch.where(middle, blend, slowed)


def inv_freq(cfg, lengths: torch.Tensor | None = None, device=None) -> torch.Tensor:
    """The frequencies after scaling, float32: (d_rot/2,) for the constant types; (B, d_rot/2) for dynamic and
    longrope given `lengths` (B,) (int64: the length each row's call sees), their value at length <= L0 without."""
    dim, kind, s = cfg.rope_dim, cfg.rope_scaling, float(cfg.rope_factor)
    if kind == "none" or (kind == "dynamic" and lengths is None):
        return default_inv_freq(cfg.rope_base, dim, device)
    if kind == "linear":
        return default_inv_freq(cfg.rope_base, dim, device) / s
    if kind == "ntk":  # the base stretched so the slowest pair slows by s and the fastest barely moves
        return default_inv_freq(float(cfg.rope_base) * s ** (dim / (dim - 2)), dim, device)
    if kind == "yarn":
        return _yarn(cfg, dim, device)
    if kind == "llama3":
        return _llama3(cfg, dim, device)
    L0 = original_context(cfg)
    if kind == "dynamic":  # transformers: n = max(n, L0); base * ((s * n / L0) - (s - 1)) ** (d / (d - 2))
        n = torch.clamp(lengths, min=L0)
        stretch = (s * n / L0 - (s - 1)) ** (dim / (dim - 2))  # float32 like transformers' tensor arithmetic
        return default_inv_freq(float(cfg.rope_base) * stretch, dim, device)
    if kind == "longrope":
        short = torch.tensor(cfg.rope_short_factor, dtype=torch.float32, device=device)
        powers = float(cfg.rope_base) ** (torch.arange(0, dim, 2, device=device, dtype=torch.int64).float() / dim)
        if lengths is None:
            return 1.0 / (short * powers)
        long = torch.tensor(cfg.rope_long_factor, dtype=torch.float32, device=device)
        factors = torch.where((lengths > L0)[:, None], long[None], short[None])  # (B, d/2)
        return 1.0 / (factors * powers)
    raise ValueError(f"unknown rope_scaling {kind!r}")


def row_lengths(positions: torch.Tensor) -> torch.Tensor:
    """The length each row's call sees: its last position + 1 (past + new on a cached step; pads sit at 0)."""
    return positions.max(dim=-1).values + 1


def angles(positions: torch.Tensor, cfg) -> tuple[torch.Tensor, float]:
    """positions (B, T) -> each pair's angle (B, T, d_rot/2) float32, and the attention factor."""
    if cfg.rope_scaling in LENGTH_DEPENDENT:
        theta = inv_freq(cfg, row_lengths(positions), positions.device)[:, None, :]  # (B, 1, d/2)
    else:
        theta = inv_freq(cfg, device=positions.device)
    return positions.to(torch.float32)[..., None] * theta, attention_factor(cfg)


# --- reading transformers' rope_scaling / rope_parameters -------------------------------------------------------

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


def from_hf(params: dict[str, Any], *, max_positions: int | None, top_original: int | None = None,
            own: bool = False) -> dict[str, Any]:
    """ModelConfig fields for one transformers rope_scaling / rope_parameters object (rope_theta and
    partial_rotary_factor are the caller's).  max_positions: config.json's max_position_embeddings; top_original:
    a top-level original_max_position_embeddings (Phi-3 keeps it there; transformers then prefers it); own: also
    posenc's own types (ntk).  Raises ScalingError naming the field for a type or field posenc does not implement."""
    if not isinstance(params, dict):
        raise ScalingError(f"rope_parameters = {params!r} must be a JSON object")
    known = {**HF_KEYS, **(OWN_KEYS if own else {})}
    kind = params.get("rope_type", params.get("type", "default"))
    if not isinstance(kind, str) or kind not in known:
        raise ScalingError(f"rope_type = {kind!r} is not supported (supported: {', '.join(known)})")
    keys = known[kind]
    for key in params:
        if key not in keys and key not in COMMON_KEYS:
            used = [t for t, k in known.items() if key in k]
            why = f"used by {', '.join(used)}" if used else "not a rope parameter posenc implements"
            raise ScalingError(f"rope_parameters.{key} is not supported with rope_type {kind!r} ({why})")
    out: dict[str, Any] = dict(FIELDS)
    if kind == "default":
        return out
    out["rope_scaling"] = kind
    original = top_original or params.get("original_max_position_embeddings") or max_positions
    if kind == "dynamic":
        original = max_positions  # transformers' dynamic divides by max_position_embeddings
    if kind not in ("linear", "ntk"):
        if isinstance(original, bool) or not isinstance(original, int) or original <= 1:
            raise ScalingError(f"original_max_position_embeddings = {original!r} must be an integer > 1 ({kind}"
                               " needs the length the model was trained at)")
        out["rope_original_context"] = original
    factor = params.get("factor")
    if factor is None and kind in ("yarn", "longrope") and max_positions:
        factor = max_positions / original  # transformers' fallback: the ratio of the two lengths
    if kind == "longrope" and isinstance(factor, (int, float)) and not isinstance(factor, bool):
        factor = max(float(factor), 1.0)  # a ratio <= 1 means no attention factor, as in transformers
    out["rope_factor"] = _number(kind, "factor", factor, 1.0)
    for key, field in keys.items():
        if key in ("factor", "original_max_position_embeddings") or params.get(key) is None:
            continue
        value = params[key]
        if field == "rope_truncate":
            if not isinstance(value, bool):
                raise ScalingError(f"rope_parameters.truncate = {value!r} must be true or false")
            out[field] = value
        elif field in ("rope_short_factor", "rope_long_factor"):
            if not isinstance(value, list) or not value:
                raise ScalingError(f"rope_parameters.{key} must be a list of numbers, got {value!r}")
            out[field] = tuple(_number(kind, key, v) for v in value)
        else:
            out[field] = _number(kind, key, value, 0.0)
    if kind == "longrope" and not (out["rope_short_factor"] and out["rope_long_factor"]):
        raise ScalingError("longrope needs rope_parameters.short_factor and long_factor")
    if kind == "llama3" and out["rope_high_freq_factor"] <= out["rope_low_freq_factor"]:
        raise ScalingError("rope_parameters.high_freq_factor must exceed low_freq_factor (llama3)")
    return out


# The types whose factor extends the length the model serves beyond the one it names: vLLM's
# _get_and_verify_max_len multiplies max_position_embeddings by the factor (yarn: original_max_position_embeddings),
# while llama3's and longrope's max_position_embeddings already is the extended length.
EXTENDING = ("linear", "dynamic", "yarn")


def served_length(cfg) -> int:
    """The positions an imported model is served by default (vLLM's max_model_len): its context (config.json's
    max_position_embeddings) x factor for linear and dynamic, the original length x factor for yarn, the context
    for every other type.  The context itself stays the length the model names (the lab's studies count from it)."""
    if cfg.rope_scaling not in EXTENDING:
        return cfg.context
    return int((cfg.rope_original_context or cfg.context) * float(cfg.rope_factor))


def to_hf(cfg) -> dict[str, Any]:
    """The config's scaling written back as transformers' rope_parameters keys (model.json's summary, docs)."""
    kind = cfg.rope_scaling
    if kind in ("none", "ntk"):
        return {"rope_type": "default" if kind == "none" else "ntk", "rope_theta": cfg.rope_base,
                **({"factor": cfg.rope_factor} if kind == "ntk" else {})}
    out: dict[str, Any] = {"rope_type": kind, "rope_theta": cfg.rope_base}
    for key, field in HF_KEYS[kind].items():
        if field and getattr(cfg, field) != FIELDS[field]:
            value = getattr(cfg, field)
            out[key] = list(value) if isinstance(value, tuple) else value
    if kind != "linear":
        out["original_max_position_embeddings"] = original_context(cfg)
    return out


def describe(cfg) -> str:
    """One line for people: the scaling, its factor and original length, and the attention factor."""
    kind = cfg.rope_scaling
    if kind == "none":
        return f"rope, base {cfg.rope_base:g}, {cfg.rope_dim} rotated dims per head, no scaling"
    text = f"rope {kind} x{cfg.rope_factor:g} of {original_context(cfg)} positions, base {cfg.rope_base:g}"
    if kind in LENGTH_DEPENDENT:
        text += " (frequencies switch with the length: shown at the length asked for)"
    factor = attention_factor(cfg)
    return text + (f", attention factor {factor:.4f}" if factor != 1.0 else "")
