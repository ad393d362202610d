"""The RoPE scaling types posenc implements, one class each (docs/rope-scaling.md has each formula and its source).

s = cfg.rope_factor, L0 = original_context(cfg), d = cfg.rope_dim.  Everything is float32 torch arithmetic in the
order transformers' modeling_rope_utils writes it, so imported models match it to the last bits that matter.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from model.errors import ConfigError
from model.rope_scaling.base import (
    NONE,
    RopeScaling,
    ScalingError,
    default_inv_freq,
    mscale,
    original_context,
    register,
)


@register
class Unscaled(RopeScaling):
    """theta_i = base^(-2i/d) (Su et al., RoFormer)."""

    name, rope_type = NONE, "default"
    needs_original = by_factor = False

    def inv_freq(self, cfg, lengths=None, device=None):
        return default_inv_freq(cfg.rope_base, cfg.rope_dim, device)

    def to_hf(self, cfg):
        return {"rope_type": self.rope_type, "rope_theta": cfg.rope_base}

    def describe(self, cfg):
        return f"rope, base {cfg.rope_base:g}, {cfg.rope_dim} rotated dims per head, no scaling"


@register
class Linear(RopeScaling):
    """theta_i / s (position interpolation, Chen et al. 2023)."""

    name = rope_type = "linear"
    keys = {"factor": "rope_factor"}
    needs_original = False
    extends_length = True

    def inv_freq(self, cfg, lengths=None, device=None):
        return default_inv_freq(cfg.rope_base, cfg.rope_dim, device) / float(cfg.rope_factor)


@register
class Ntk(RopeScaling):
    """base' = base * s^(d/(d-2)): the slowest pair slows by s, the fastest barely moves (NTK-aware, bloc97 2023).
    posenc's own static type."""

    name = rope_type = "ntk"
    keys = {"factor": "rope_factor"}
    own = True
    needs_original = False

    def inv_freq(self, cfg, lengths=None, device=None):
        dim = cfg.rope_dim
        return default_inv_freq(float(cfg.rope_base) * float(cfg.rope_factor) ** (dim / (dim - 2)), dim, device)

    def to_hf(self, cfg):
        return {"rope_type": self.rope_type, "rope_theta": cfg.rope_base, "factor": cfg.rope_factor}


@register
class Dynamic(RopeScaling):
    """ntk's base stretched by (s n / L0 - (s - 1)) once the length n passes L0, recomputed from n every call."""

    name = rope_type = "dynamic"
    # transformers' dynamic reads max_position_embeddings as L0; an original_max_position_embeddings beside it is
    # ignored there and here
    keys = {"factor": "rope_factor", "original_max_position_embeddings": ""}
    length_dependent = extends_length = True

    def inv_freq(self, cfg, lengths=None, device=None):
        dim, s, L0 = cfg.rope_dim, float(cfg.rope_factor), original_context(cfg)
        if lengths is None:
            return default_inv_freq(cfg.rope_base, dim, device)
        # transformers: n = max(n, L0); base * ((s * n / L0) - (s - 1)) ** (d / (d - 2))
        n = torch.clamp(lengths, min=L0)
        stretch = (s * n / L0 - (s - 1)) ** (dim / (dim - 2))  # float32 like transformers' tensor arithmetic
        return default_inv_freq(float(cfg.rope_base) * stretch, dim, device)

    def original(self, params, max_positions, top_original):
        return max_positions  # transformers' dynamic divides by max_position_embeddings


@register
class Yarn(RopeScaling):
    """Per pair a blend of theta_i / s and theta_i, ramped over the pairs set by beta_fast / beta_slow rotations
    over L0, and cos/sin multiplied by 0.1 ln s + 1 (or the ratio of two mscales) (Peng et al. 2023)."""

    name = rope_type = "yarn"
    keys = {"factor": "rope_factor", "original_max_position_embeddings": "rope_original_context",
            "attention_factor": "rope_attention_factor", "beta_fast": "rope_beta_fast",
            "beta_slow": "rope_beta_slow", "mscale": "rope_mscale", "mscale_all_dim": "rope_mscale_all_dim",
            "truncate": "rope_truncate"}
    extends_length = factor_from_lengths = True

    def inv_freq(self, cfg, lengths=None, device=None):
        dim, base, s, L0 = cfg.rope_dim, float(cfg.rope_base), float(cfg.rope_factor), original_context(cfg)

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

    def attention_factor(self, cfg):
        s = float(cfg.rope_factor)
        if cfg.rope_mscale and cfg.rope_mscale_all_dim:
            return float(mscale(s, cfg.rope_mscale) / mscale(s, cfg.rope_mscale_all_dim))
        return mscale(s)


@register
class Llama3(RopeScaling):
    """By wavelength: slow pairs / s, fast pairs kept, a smooth blend between (Meta, Llama 3.1)."""

    name = rope_type = "llama3"
    keys = {"factor": "rope_factor", "original_max_position_embeddings": "rope_original_context",
            "low_freq_factor": "rope_low_freq_factor", "high_freq_factor": "rope_high_freq_factor"}

    def inv_freq(self, cfg, lengths=None, device=None):
        theta = default_inv_freq(cfg.rope_base, cfg.rope_dim, device)
        s, L0 = float(cfg.rope_factor), original_context(cfg)
        low, high = float(cfg.rope_low_freq_factor), float(cfg.rope_high_freq_factor)
        wavelength = 2 * math.pi / theta
        slowed = torch.where(wavelength > L0 / low, theta / s, theta)
        t = (L0 / wavelength - low) / (high - low)
        blend = (1 - t) * slowed / s + t * slowed
        middle = ~(wavelength < L0 / high) * ~(wavelength > L0 / low)
        return torch.where(middle, blend, slowed)

    def check(self, cfg):
        if not cfg.rope_high_freq_factor > cfg.rope_low_freq_factor > 0:
            raise ConfigError("rope_high_freq_factor must exceed rope_low_freq_factor > 0 (llama3)")

    def check_parameters(self, fields):
        if fields["rope_high_freq_factor"] <= fields["rope_low_freq_factor"]:
            raise ScalingError("rope_parameters.high_freq_factor must exceed low_freq_factor (llama3)")


@register
class LongRope(RopeScaling):
    """theta_i / f_i with f = long_factor once the length passes L0, short_factor before, and cos/sin multiplied
    by sqrt(1 + ln s / ln L0) (Ding et al. 2024)."""

    name = rope_type = "longrope"
    keys = {"factor": "rope_factor", "original_max_position_embeddings": "rope_original_context",
            "attention_factor": "rope_attention_factor", "short_factor": "rope_short_factor",
            "long_factor": "rope_long_factor"}
    by_factor = False  # its per-pair factors have no default
    length_dependent = factor_from_lengths = True

    def inv_freq(self, cfg, lengths=None, device=None):
        dim, L0 = cfg.rope_dim, original_context(cfg)
        short = torch.tensor(cfg.rope_short_factor, dtype=torch.float32, device=device)
        powers = float(cfg.rope_base) ** (torch.arange(0, dim, 2, device=device, dtype=torch.int64).float() / dim)
        if lengths is None:
            return 1.0 / (short * powers)
        long = torch.tensor(cfg.rope_long_factor, dtype=torch.float32, device=device)
        factors = torch.where((lengths > L0)[:, None], long[None], short[None])  # (B, d/2)
        return 1.0 / (factors * powers)

    def attention_factor(self, cfg):
        s = float(cfg.rope_factor)
        return 1.0 if s <= 1 else math.sqrt(1 + math.log(s) / math.log(original_context(cfg)))

    def check(self, cfg):
        half = cfg.rope_dim // 2
        for name in ("rope_short_factor", "rope_long_factor"):
            if len(getattr(cfg, name)) != half:
                raise ConfigError(f"{name} must have one number per rotated pair ({half}), "
                                  f"got {len(getattr(cfg, name))}")

    def read_factor(self, factor: Any):
        if isinstance(factor, (int, float)) and not isinstance(factor, bool):
            return max(float(factor), 1.0)  # a ratio <= 1 means no attention factor, as in transformers
        return factor

    def check_parameters(self, fields):
        if not (fields["rope_short_factor"] and fields["rope_long_factor"]):
            raise ScalingError("longrope needs rope_parameters.short_factor and long_factor")


@register
class Proportional(RopeScaling):
    """p-RoPE (Barbero et al. 2024; Gemma 4's global layers): the first int(p d / 2) pairs turn at base^(-2i/d)
    over the whole head d, the rest keep frequency 0 (they pass unrotated), all divided by s; p = rope_fraction."""

    name = rope_type = "proportional"
    keys = {"factor": "rope_factor"}
    needs_original = by_factor = False
    whole_head = True

    def inv_freq(self, cfg, lengths=None, device=None):
        dim, s = cfg.head_dim, float(cfg.rope_factor)
        turning = int(float(cfg.rope_fraction) * dim // 2)  # transformers: int(partial_rotary_factor * head_dim // 2)
        exponent = torch.arange(0, 2 * turning, 2, dtype=torch.int64, device=device).to(torch.float32) / dim
        theta = 1.0 / (float(cfg.rope_base) ** exponent)
        still = torch.zeros(dim // 2 - turning, dtype=torch.float32, device=device)
        return torch.cat((theta, still)) / s

    def read_factor(self, factor):
        return 1.0 if factor is None else factor  # transformers: rope_parameters.get("factor", 1.0)

    def to_hf(self, cfg):
        out = {"rope_type": self.rope_type, "rope_theta": cfg.rope_base, "partial_rotary_factor": cfg.rope_fraction}
        return {**out, "factor": cfg.rope_factor} if cfg.rope_factor != 1.0 else out

    def describe(self, cfg):
        turning = int(float(cfg.rope_fraction) * cfg.head_dim // 2)
        return (f"rope proportional (p-RoPE): {turning} of {cfg.head_dim // 2} pairs turn, base {cfg.rope_base:g}"
                + (f", frequencies / {cfg.rope_factor:g}" if cfg.rope_factor != 1.0 else ""))
