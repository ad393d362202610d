"""RoPE (Su et al., RoFormer): rotate q and k by position; never v.

Half-split pairs (k, k + Dh/2) as in HF LLaMA; theta_k = base^(-2k/Dh).  Angles are computed in fp32 from the
positions each call (no cos/sin table for one length), and keys are cached after rotation.
"""

from __future__ import annotations

import torch

from model.variants.base import PositionalVariant


def rope_angles(positions: torch.Tensor, head_dim: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape (B, 1, T, Dh) for positions (B, T), computed in fp32."""
    k = torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32)  # (Dh/2,)
    inv_freq = torch.pow(torch.tensor(base, dtype=torch.float32), -k / head_dim)
    angles = positions.to(torch.float32)[..., None] * inv_freq  # (B, T, Dh/2)
    angles = torch.cat((angles, angles), dim=-1)[:, None]  # (B, 1, T, Dh)
    return angles.cos(), angles.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + rotate_half(x) * sin


class Rope(PositionalVariant):
    name = "rope"

    def rotate(self, q, k, q_pos, k_pos):
        cq, sq = rope_angles(q_pos, self.cfg.head_dim, self.cfg.rope_base)
        # the new keys sit at the new queries' positions (the usual call): one set of angles serves both
        ck, sk = (cq, sq) if k_pos is q_pos else rope_angles(k_pos, self.cfg.head_dim, self.cfg.rope_base)
        return apply_rope(q, cq, sq), apply_rope(k, ck, sk)
