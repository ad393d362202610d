"""KERPLE (Chi, Fan, Ramadge, Rudnicky 2022, "KERPLE: Kernelized Relative Positional Embedding for Length
Extrapolation", arXiv 2205.09921): a conditionally positive definite kernel of the distance, added to the scaled
scores q.k/sqrt(Dh) as a per-head bias (softmax absorbs the kernel's constant offset).

  kerple_log:   b_h(i, j) = -r1_h * log(1 + r2_h * (i - j))
  kerple_power: b_h(i, j) = -r1_h * (i - j)^r2_h,  0 < r2_h <= 2

r1 and r2 are learned, one pair per head, shared by every layer, initialised as the authors' code does (chijames/KERPLE
`ParallelKerpleLog`, `ParallelKerplePower`): the log kernel's r1 ~ U(0, 2) and r2 ~ U(0, 1), the power kernel's
r1 ~ U(0, 1) and r2 ~ U(0, 2); both are kept >= 0.01 (and the power's exponent <= 2) as that code clamps them.
The clamp is applied to the values each forward, with the gradient passed straight through in training (the
reference clamps the stored values in place, which likewise lets a parameter at the floor grow again).  The
distance is clamped at 0 before the log and the power: a future key's masked entry would otherwise be
log of a negative or a fractional power of one (NaN, which the mask cannot hide).  Query-free: one bias per
forward for every layer, relative by construction, so cached keys need nothing besides their positions.
"""

from __future__ import annotations

import torch
from torch import nn

from model.variants.base import PositionalVariant, distance

FLOOR = 0.01  # the reference's eps: every kernel parameter stays at least this
MAX_POWER = 2.0  # the power kernel is conditionally positive definite for exponents in (0, 2]


def bounded(p: torch.Tensor, low: float, high: float | None, training: bool) -> torch.Tensor:
    """p clamped to [low, high]; in training the gradient passes through the clamp unchanged."""
    clamped = p.clamp(min=low, max=high)
    return p + (clamped - p).detach() if training else clamped


class _Kerple(PositionalVariant):
    query_dependent_bias = False
    R1_INIT, R2_INIT = 1.0, 1.0  # each parameter ~ U(0, init)
    R2_MAX: float | None = None

    def __init__(self, cfg):
        super().__init__(cfg)
        self.r1 = nn.Parameter(torch.rand(cfg.n_heads) * self.R1_INIT)
        self.r2 = nn.Parameter(torch.rand(cfg.n_heads) * self.R2_INIT)

    def params(self) -> tuple[torch.Tensor, torch.Tensor]:
        """r1, r2 (H,) as the kernel uses them (clamped)."""
        return bounded(self.r1, FLOOR, None, self.training), bounded(self.r2, FLOOR, self.R2_MAX, self.training)

    def operands(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The distance (B, 1, T, S), >= 0 on masked keys too, and r1, r2 shaped (1, H, 1, 1)."""
        r1, r2 = (p[None, :, None, None] for p in self.params())
        return distance(q_pos, k_pos).clamp(min=0).to(r1.dtype), r1, r2


class KerpleLog(_Kerple):
    name = "kerple_log"
    R1_INIT, R2_INIT = 2.0, 1.0

    def score_bias(self, q, q_pos, k_pos, *, k=None, layer=0):
        dist, r1, r2 = self.operands(q_pos, k_pos)
        return -r1 * torch.log1p(r2 * dist)  # (B, H, T, S)


class KerplePower(_Kerple):
    name = "kerple_power"
    R1_INIT, R2_INIT = 1.0, 2.0
    R2_MAX = MAX_POWER

    def score_bias(self, q, q_pos, k_pos, *, k=None, layer=0):
        dist, r1, r2 = self.operands(q_pos, k_pos)
        return -r1 * torch.pow(dist, r2)  # (B, H, T, S)
