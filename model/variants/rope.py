"""RoPE (Su et al., RoFormer): rotate q and k by position; never v.

Half-split pairs (k, k + Dh/2) as in HF LLaMA; theta_k = base^(-2k/Dh).  Angles are computed in fp32 from the
positions each call (no cos/sin table for one length), and keys are cached after rotation.
"""

from __future__ import annotations

import math

import torch

from model.variants.base import PositionalVariant

# YaRN's ramp bounds, in rotations per original context (Peng et al. 2023, section 3.2: alpha = 1, beta = 32).
YARN_ALPHA, YARN_BETA = 1.0, 32.0


def inv_freq(cfg, device=None) -> tuple[torch.Tensor, float]:
    """theta_k for k in [0, Dh/2) after the config's context-extension method, and the factor cos and sin are
    multiplied by (YaRN's attention temperature: sqrt(1/t) = 0.1 ln s + 1; 1 otherwise).  Computed with torch ops
    from the config's numbers, so the exported graph carries no per-length table."""
    dh, s = cfg.head_dim, float(cfg.rope_factor)
    k = torch.arange(0, dh, 2, device=device, dtype=torch.float32)  # (Dh/2,)
    base = float(cfg.rope_base)
    if cfg.rope_scaling == "ntk":  # stretch the base so the lowest frequency slows by s, the highest barely
        base = base * s ** (dh / (dh - 2))
    theta = torch.pow(torch.tensor(base, dtype=torch.float32), -k / dh)
    if cfg.rope_scaling == "linear":  # position interpolation: every frequency slows by s
        return theta / s, 1.0
    if cfg.rope_scaling == "yarn":  # interpolate only the slow dimensions, keep the fast ones, temper attention
        original = float(cfg.rope_original_context or cfg.context)
        rotations = original * theta / (2 * math.pi)  # full turns of each pair over the original context
        keep = ((rotations - YARN_ALPHA) / (YARN_BETA - YARN_ALPHA)).clamp(0.0, 1.0)  # 1 = unchanged
        return (1 - keep) * theta / s + keep * theta, 0.1 * math.log(s) + 1.0
    return theta, 1.0


def rope_angles(positions: torch.Tensor, cfg) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape (B, 1, T, Dh) for positions (B, T), computed in fp32."""
    theta, scale = inv_freq(cfg, positions.device)
    angles = positions.to(torch.float32)[..., None] * theta  # (B, T, Dh/2)
    angles = torch.cat((angles, angles), dim=-1)[:, None]  # (B, 1, T, Dh)
    if scale == 1.0:
        return angles.cos(), angles.sin()
    return angles.cos() * scale, angles.sin() * scale


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2  # slices, not chunk: chunk exports as a sequence of tensors
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + rotate_half(x) * sin


class Rope(PositionalVariant):
    name = "rope"

    def rotate(self, q, k, positions):
        if self.onnx_ops:  # export option: ONNX RotaryEmbedding-23 with cos/sin computed here from the positions
            c, s = self._half_angles(positions)
            heads = self.cfg.n_heads if q.dim() == 3 else 0  # (B, T, H * Dh) input: the op splits the heads
            return (torch.onnx.ops.rotary_embedding(q, c, s, interleaved=False, num_heads=heads),
                    torch.onnx.ops.rotary_embedding(k, c, s, interleaved=False, num_heads=heads))
        c, s = rope_angles(positions, self.cfg)  # queries and new keys share positions: one set of angles
        return apply_rope(q, c, s), apply_rope(k, c, s)

    def _half_angles(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin (B, T, Dh/2) for RotaryEmbedding-23 (half-split pairs: interleaved=0), which takes them per
        row and position when no position_ids are given: computed from the positions, nothing tabled."""
        theta, scale = inv_freq(self.cfg, positions.device)
        angles = positions.to(torch.float32)[..., None] * theta
        if scale == 1.0:
            return angles.cos(), angles.sin()
        return angles.cos() * scale, angles.sin() * scale
