"""What a RoPE scaling type is (one `RopeScaling` subclass) and the factory that finds one by its name.

Callers never test a type's name: they ask `get(cfg.rope_scaling)` for its frequencies, its attention factor, the
length it serves, whether its frequencies follow the length, how it reads transformers' rope_parameters.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from model.errors import ConfigError

NONE = "none"  # ModelConfig.rope_scaling's default: the unscaled rotation


class ScalingError(ConfigError):
    """A rope_scaling / rope_parameters object posenc cannot reproduce exactly (the message names the field)."""


def original_context(cfg) -> int:
    """L0: the length the weights were trained at (rope_original_context; 0 = the config's context)."""
    return cfg.rope_original_context or cfg.context


def default_inv_freq(base, dim: int, device=None) -> torch.Tensor:
    """theta_i = 1 / base^(2i/d), float32, written as HF LLaMA and GPT-NeoX write it (base^(-2i/d) rounds
    differently in the last bit, which position x angle carries into scores at long lengths)."""
    exponent = torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim
    if not isinstance(base, torch.Tensor):
        base = torch.tensor(float(base), dtype=torch.float32, device=device)
    return 1.0 / torch.pow(base[..., None] if base.dim() else base, exponent)


class RopeScaling:
    """One RoPE scaling type.  A subclass sets the attributes that differ from these defaults, overrides
    `inv_freq` (and whatever else differs), and is registered with `@register`; nothing else names it.

    name                 ModelConfig.rope_scaling's value
    rope_type            transformers' rope_type for it (what rope_parameters says and to_hf writes)
    keys                 the rope_parameters keys it reads beside rope_type / type, rope_theta and
                         partial_rotary_factor, each to the ModelConfig field it sets ("": read and ignored)
    own                  posenc's own type: accepted where posenc picks the scaling (rope-scale, --rope-scaling),
                         never from a model folder
    by_factor            the factor alone defines it, its other parameters defaulted (rope-scale --method)
    length_dependent     its frequencies follow the length each row's call sees (its last position + 1): a prompt
                         then runs whole, and a graph that does not see a row's positions cannot compute it
    extends_length       its factor extends the length served beyond the one the model names (vLLM's max_model_len)
    needs_original       it reads the length the weights were trained at (rope_original_context)
    factor_from_lengths  a missing factor is max_position_embeddings / original (transformers' fallback)
    whole_head           its pairs span the whole head whatever rope_fraction says (d_rot = head_dim); rope_fraction
                         is then the share of pairs that turn, the others keep frequency 0 (proportional)
    """

    name = ""
    rope_type = ""
    keys: dict[str, str] = {}
    own = False
    by_factor = True
    length_dependent = False
    extends_length = False
    needs_original = True
    factor_from_lengths = False
    whole_head = False

    def inv_freq(self, cfg, lengths: torch.Tensor | None = None, device=None) -> torch.Tensor:
        """The frequencies after scaling, float32: (d_rot/2,), or (B, d_rot/2) for a length-dependent type given
        `lengths` (B,) int64 (the length each row's call sees), its value at length <= L0 without."""
        raise NotImplementedError

    def attention_factor(self, cfg) -> float:
        """What cos and sin are multiplied by when the config sets no rope_attention_factor."""
        return 1.0

    def check(self, cfg) -> None:
        """ConfigError, one line naming the field, for a config whose parameters this type cannot use."""

    def served_length(self, cfg) -> int:
        """The positions an imported model is served by default (vLLM's max_model_len): the original length x
        factor for a type that extends it, the context the model names for the others."""
        if not self.extends_length:
            return cfg.context
        return int((cfg.rope_original_context or cfg.context) * float(cfg.rope_factor))

    # --- transformers' rope_parameters ----------------------------------------------------------------------

    def original(self, params: dict[str, Any], max_positions: int | None, top_original: int | None):
        """The L0 transformers uses: a top-level original_max_position_embeddings (Phi-3), the object's own, or
        max_position_embeddings."""
        return top_original or params.get("original_max_position_embeddings") or max_positions

    def read_factor(self, factor):
        return factor

    def check_parameters(self, fields: dict[str, Any]) -> None:
        """ScalingError for read parameters transformers would accept but that do not define this type."""

    def to_hf(self, cfg) -> dict[str, Any]:
        """The config's scaling as transformers' rope_parameters keys (model.json's summary, docs)."""
        out: dict[str, Any] = {"rope_type": self.rope_type, "rope_theta": cfg.rope_base}
        for key, field in self.keys.items():
            if field and getattr(cfg, field) != FIELDS[field]:
                value = getattr(cfg, field)
                out[key] = list(value) if isinstance(value, tuple) else value
        if self.needs_original:
            out["original_max_position_embeddings"] = original_context(cfg)
        return out

    def describe(self, cfg) -> str:
        """One line for people: the scaling, its factor and original length, and the attention factor."""
        text = f"rope {self.name} x{cfg.rope_factor:g} of {original_context(cfg)} positions, base {cfg.rope_base:g}"
        if self.length_dependent:
            text += " (frequencies switch with the length: shown at the length asked for)"
        factor = attention_factor(cfg)
        return text + (f", attention factor {factor:.4f}" if factor != 1.0 else "")


# ModelConfig fields that hold scaling parameters, with their defaults (what the unscaled rotation resets them to)
FIELDS: dict[str, Any] = {"rope_scaling": NONE, "rope_factor": 1.0, "rope_original_context": 0,
                          "rope_attention_factor": 0.0, "rope_beta_fast": 32.0, "rope_beta_slow": 1.0,
                          "rope_mscale": 0.0, "rope_mscale_all_dim": 0.0, "rope_truncate": True,
                          "rope_low_freq_factor": 1.0, "rope_high_freq_factor": 4.0, "rope_short_factor": (),
                          "rope_long_factor": ()}

# The factory: each registered type by its name, in registration order (the order help texts and errors list).
TYPES: dict[str, RopeScaling] = {}


def register(cls: type[RopeScaling]) -> type[RopeScaling]:
    """Class decorator: the factory finds `cls` by its name from now on."""
    if not cls.name or not cls.rope_type:
        raise ValueError(f"{cls.__name__} needs a name and a rope_type")
    TYPES[cls.name] = cls()
    return cls


def get(name: str) -> RopeScaling:
    """The registered type called `name`; ConfigError listing the registered ones otherwise."""
    scaling = TYPES.get(name) if isinstance(name, str) else None
    if scaling is None:
        raise ConfigError(f"rope_scaling must be one of {', '.join(TYPES)}, got {name!r}")
    return scaling


def attention_factor(cfg) -> float:
    """What cos and sin are multiplied by: the config's rope_attention_factor, else the type's rule."""
    if cfg.rope_attention_factor:
        return float(cfg.rope_attention_factor)
    return get(cfg.rope_scaling).attention_factor(cfg)


def mscale(scale: float, k: float = 1.0) -> float:
    """YaRN's attention temperature 0.1 k ln s + 1 (1 when s <= 1)."""
    return 1.0 if scale <= 1 else 0.1 * k * math.log(scale) + 1.0
