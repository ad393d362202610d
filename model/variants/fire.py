"""FIRE (Li et al. 2023, arXiv 2310.04418): b_h(i, j) = f( psi(i - j) / psi(max(L, i)) ), psi(x) = log(c x + 1).

f is an MLP 1 -> hidden -> H (ReLU); c (init 0.1) and L (init 512) are learnable.  The normalised distance stays
in [0, 1] at any length.  Not purely relative: once i > L the normaliser uses the absolute query position, which
is why positions come from the attention mask (left padding) and are absolute during cached decoding.
"""

from __future__ import annotations

import torch
from torch import nn

from model.variants.base import PositionalVariant, distance


class Fire(PositionalVariant):
    name = "fire"
    query_dependent_bias = False

    def __init__(self, cfg):
        super().__init__(cfg)
        self.mlp = nn.Sequential(nn.Linear(1, cfg.fire_hidden), nn.ReLU(), nn.Linear(cfg.fire_hidden, cfg.n_heads))
        self.c = nn.Parameter(torch.tensor(cfg.fire_c_init))
        self.L = nn.Parameter(torch.tensor(cfg.fire_L_init))

    def psi(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(self.c.abs() * x + 1.0)

    def normalised_distance(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        """(B, T, S) in [0, 1] for every key a causal query sees."""
        dtype = self.L.dtype  # the model's (float32; float64 in the tests that compare where rounding cannot decide)
        dist = distance(q_pos, k_pos)[:, 0].clamp(min=0).to(dtype)  # (B, T, S)
        floor = torch.maximum(self.L.abs(), q_pos.to(dtype))[:, :, None]  # (B, T, 1)
        return self.psi(dist) / self.psi(floor)

    def score_bias(self, q, q_pos, k_pos, *, k=None, layer=0):
        bias = self.mlp(self.normalised_distance(q_pos, k_pos)[..., None])  # (B, T, S, H)
        return bias.permute(0, 3, 1, 2)
