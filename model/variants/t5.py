"""T5 relative position bias (Raffel et al.; HF `T5Attention._relative_position_bucket`), causal buckets.

n = max(i - j, 0); buckets 0 .. nb/2 - 1 are exact, then logarithmic up to max_distance, saturating at nb - 1.
bias[h, i, j] = table[bucket(n), h].  One table shared by all layers, as T5 does.  Positions are absolute per
row, so cached decoding looks up the true distance to every cached key.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from model.variants.base import PositionalVariant, distance


def causal_bucket(n: torch.Tensor, num_buckets: int, max_distance: int) -> torch.Tensor:
    n = n.clamp(min=0)
    max_exact = num_buckets // 2
    # clamp before the log so n < max_exact never produces log(0); those entries take the exact branch anyway
    scaled = torch.log(n.to(torch.float32).clamp(min=max_exact) / max_exact) / math.log(max_distance / max_exact)
    large = max_exact + (scaled * (num_buckets - max_exact)).to(torch.int64)
    large = large.clamp(max=num_buckets - 1)
    return torch.where(n < max_exact, n, large)


class T5Bias(PositionalVariant):
    name = "t5"
    query_dependent_bias = False

    def __init__(self, cfg):
        super().__init__(cfg)
        self.table = nn.Embedding(cfg.t5_buckets, cfg.n_heads)
        nn.init.normal_(self.table.weight, std=0.02)

    def score_bias(self, q, q_pos, k_pos, *, k=None, layer=0):
        buckets = causal_bucket(distance(q_pos, k_pos)[:, 0], self.cfg.t5_buckets, self.cfg.t5_max_distance)
        return self.table(buckets).permute(0, 3, 1, 2)  # (B, T, S, H) -> (B, H, T, S)
