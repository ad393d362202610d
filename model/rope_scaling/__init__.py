"""RoPE context extension: one class per scaling type (model/rope_scaling/types.py) behind one factory keyed by the
type's name (`get`), shared by the rope variant (own models and imported ones), the `rope-scale` command, the
importer and the exporter.

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
  proportional  p-RoPE over the whole head d: pairs i < int(p d / 2) turn at theta_i / s, the others at 0
            (unrotated); p = rope_fraction, transformers' partial_rotary_factor       (Barbero et al. 2024)

s = rope_factor, L0 = rope_original_context (0: the trained context).  dynamic and longrope depend on the length
the call sees (`RopeScaling.length_dependent`), n = the last position of the row + 1 (past + new on a cached step),
computed per row in the graph; the others are constants of the config.  A new type is one registered class
(ARCHITECTURE.md section 9).
"""

from __future__ import annotations

from typing import Any

import torch

from model.rope_scaling import types  # noqa: F401  (registers the built-in types)
from model.rope_scaling.base import (
    FIELDS,
    NONE,
    TYPES,
    RopeScaling,
    ScalingError,
    attention_factor,
    default_inv_freq,
    get,
    original_context,
    register,
)
from model.rope_scaling.hf import COMMON_KEYS, from_hf, parse_override, readable


def inv_freq(cfg, lengths: torch.Tensor | None = None, device=None) -> torch.Tensor:
    """The config's frequencies after scaling, float32: (d_rot/2,), or (B, d_rot/2) for a length-dependent type
    given `lengths` (B,) (int64: the length each row's call sees), its value at length <= L0 without."""
    return get(cfg.rope_scaling).inv_freq(cfg, lengths, device)


def row_lengths(positions: torch.Tensor) -> torch.Tensor:
    """The length each row's call sees: its last position + 1 (past + new on a cached step; pads sit at 0)."""
    return positions.max(dim=-1).values + 1


def angles(positions: torch.Tensor, cfg) -> tuple[torch.Tensor, float]:
    """positions (B, T) -> each pair's angle (B, T, d_rot/2) float32, and the attention factor."""
    scaling = get(cfg.rope_scaling)
    if scaling.length_dependent:
        theta = scaling.inv_freq(cfg, row_lengths(positions), positions.device)[:, None, :]  # (B, 1, d/2)
    else:
        theta = scaling.inv_freq(cfg, device=positions.device)
    return positions.to(torch.float32)[..., None] * theta, attention_factor(cfg)


def served_length(cfg) -> int:
    """The positions an imported model is served by default (vLLM's max_model_len, `RopeScaling.served_length`).
    The context itself stays the length the model names (the lab's studies count from it)."""
    return get(cfg.rope_scaling).served_length(cfg)


def to_hf(cfg) -> dict[str, Any]:
    """The config's scaling written back as transformers' rope_parameters keys (model.json's summary, docs)."""
    return get(cfg.rope_scaling).to_hf(cfg)


def describe(cfg) -> str:
    """One line for people: the scaling, its factor and original length, and the attention factor."""
    return get(cfg.rope_scaling).describe(cfg)


__all__ = ["COMMON_KEYS", "FIELDS", "NONE", "TYPES", "RopeScaling", "ScalingError", "angles", "attention_factor",
           "default_inv_freq", "describe", "from_hf", "get", "inv_freq", "original_context", "parse_override",
           "readable", "register", "row_lengths", "served_length", "to_hf"]
