"""ALiBi (Press, Smith, Lewis 2022): bias -m_h (i - j) on the attention logits, after the 1/sqrt(d) scaling.

Slopes follow the paper's rule (fairseq `get_slopes`), including head counts that are not a power of two.  The
bias is built in the relative form from explicit query and key positions over every key (past + new), in fp32:
built over the query window alone, a decode step would get a (1, 1) zero bias and silently lose ALiBi.
"""

from __future__ import annotations

import math

import torch

from model.variants.base import PositionalVariant, distance


def alibi_slopes(n_heads: int, bias_max: float = 8.0) -> list[float]:
    """2^(-bias_max * h / n) for heads h = 1..n (the paper's 8; MPT's alibi_bias_max may differ)."""
    def geometric(n: int) -> list[float]:
        return [2.0 ** (-bias_max * h / n) for h in range(1, n + 1)]

    if n_heads & (n_heads - 1) == 0:
        return geometric(n_heads)
    closest = 2 ** math.floor(math.log2(n_heads))
    return geometric(closest) + geometric(2 * closest)[0::2][: n_heads - closest]


class Alibi(PositionalVariant):
    name = "alibi"
    query_dependent_bias = False

    def __init__(self, cfg):
        super().__init__(cfg)
        # (H,) model constant, not length-specific; non-persistent so checkpoints carry only learned weights.
        slopes = torch.tensor(alibi_slopes(cfg.n_heads, cfg.alibi_bias_max), dtype=torch.float32) * cfg.alibi_scale
        self.register_buffer("slopes", slopes, persistent=False)

    def score_bias(self, q, q_pos, k_pos, *, k=None, layer=0):
        dist = distance(q_pos, k_pos).to(torch.float32)  # (B, 1, T, S)
        return -self.slopes[None, :, None, None] * dist  # (B, H, T, S)
