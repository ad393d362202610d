"""Shaw, Uszkoreit, Vaswani 2018: clipped relative key embeddings, e_ij += q_i . a_clip(j - i, k) / sqrt(Dh).

2k+1 vectors of size Dh shared across heads and layers (a causal model only reaches the k+1 for j <= i).  Keys
only: the value-side term does not fit the score-bias hook and is left out (as HF BERT's relative_key does).
Queries are aligned to the last keys through their absolute positions, so a one-token decode query sees the
same distances as in the full forward.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from model.variants.base import PositionalVariant, distance


class Shaw(PositionalVariant):
    name = "shaw"

    def __init__(self, cfg):
        super().__init__(cfg)
        self.rel_keys = nn.Embedding(2 * cfg.shaw_clip + 1, cfg.head_dim)
        nn.init.normal_(self.rel_keys.weight, std=0.02)

    def relative_index(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        """clip(j - i, -k, k) + k, an index into the 2k+1 embeddings: (B, 1, T, S)."""
        k = self.cfg.shaw_clip
        return (-distance(q_pos, k_pos)).clamp(-k, k) + k

    def score_bias(self, q, q_pos, k_pos, *, k=None, layer=0):
        # q . a for each of the 2k+1 embeddings, then pick per (i, j): cheaper than materialising a_ij.
        per_offset = q @ self.rel_keys.weight.t() / math.sqrt(self.cfg.head_dim)  # (B, H, T, 2k+1)
        index = self.relative_index(q_pos, k_pos).expand(-1, q.shape[1], -1, -1)  # (B, H, T, S)
        return torch.gather(per_offset, -1, index)
