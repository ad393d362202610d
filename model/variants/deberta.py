"""DeBERTa disentangled attention (He et al. 2021, arXiv 2006.03654, section 3.1), in causal form.

The score of query i and key j is (q_i.k_j + q_i.K_r[d(i, j)] + k_j.Q_r[d(i, j)]) / sqrt(3 Dh): content-to-
content, content-to-position and position-to-content.  d(i, j) buckets the distance i - j (>= 0 for every key a
causal query sees) with T5's causal log buckets; the relative embeddings P (buckets x d_model) are shared by all
layers, and each layer projects them with its own W_{q,r}, W_{k,r} (DeBERTa v1's separate position projections).
The attention scales its content term by content_scale = 1/sqrt(3) on top of 1/sqrt(Dh); this bias adds the other
two terms with the same 1/sqrt(3 Dh).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from model.variants.base import PositionalVariant, distance
from model.variants.t5 import causal_bucket


class DeBERTa(PositionalVariant):
    name = "deberta"
    content_scale = 1 / math.sqrt(3)

    def __init__(self, cfg):
        super().__init__(cfg)
        self.rel = nn.Embedding(cfg.deberta_buckets, cfg.d_model)
        nn.init.normal_(self.rel.weight, std=0.02)
        self.w_qr = nn.ModuleList(nn.Linear(cfg.d_model, cfg.d_model, bias=False) for _ in range(cfg.n_layers))
        self.w_kr = nn.ModuleList(nn.Linear(cfg.d_model, cfg.d_model, bias=False) for _ in range(cfg.n_layers))
        for w in (*self.w_qr, *self.w_kr):
            nn.init.normal_(w.weight, std=0.02)

    def buckets(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        """d(i, j) for every query/key pair: (B, 1, T, S) int64 in [0, buckets)."""
        return causal_bucket(distance(q_pos, k_pos), self.cfg.deberta_buckets, self.cfg.deberta_max_distance)

    def score_bias(self, q, q_pos, k_pos, *, k=None, layer=0):
        B, H, T, Dh = q.shape
        S = k.shape[2]
        n = self.cfg.deberta_buckets
        k_r = self.w_kr[layer](self.rel.weight).view(n, H, Dh).transpose(0, 1)  # (H, buckets, Dh)
        q_r = self.w_qr[layer](self.rel.weight).view(n, H, Dh).transpose(0, 1)
        index = self.buckets(q_pos, k_pos).expand(B, H, T, S)
        c2p = torch.gather(q @ k_r.transpose(-1, -2), -1, index)  # (B, H, T, S): q_i . K_r[d(i, j)]
        p2c = torch.gather(k @ q_r.transpose(-1, -2), -1, index.transpose(-1, -2)).transpose(-1, -2)  # k_j . Q_r
        return (c2p + p2c) / math.sqrt(3 * Dh)
