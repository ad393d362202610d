"""Transformer-XL relative attention (Dai et al. 2019, arXiv 1901.02860, section 3.3).

The score of query i and key j is q_i.k_j + q_i.W_R R_{i-j} + u.k_j + v.W_R R_{i-j}: R is the sinusoidal
encoding of the distance i - j (no learned table), W_R a per-layer projection of it, and u, v two learned vectors
per head shared by all layers ("global" content and position biases).  The first term is the attention's own; this
variant adds the other three, divided by sqrt(Dh) like the first.  Distances run over 0..S-1 (S = keys seen), so
the projected encodings are computed per call for exactly the keys present, never as a table of fixed length.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from model.variants.base import PositionalVariant, distance
from model.variants.sinusoidal import sinusoidal_table


class TransformerXL(PositionalVariant):
    name = "xl"

    def __init__(self, cfg):
        super().__init__(cfg)
        self.w_r = nn.ModuleList(nn.Linear(cfg.d_model, cfg.d_model, bias=False) for _ in range(cfg.n_layers))
        self.u = nn.Parameter(torch.zeros(cfg.n_heads, cfg.head_dim))
        self.v = nn.Parameter(torch.zeros(cfg.n_heads, cfg.head_dim))
        for w in self.w_r:
            nn.init.normal_(w.weight, std=0.02)

    def score_bias(self, q, q_pos, k_pos, *, k=None, layer=0):
        B, H, T, Dh = q.shape
        S = k.shape[2]
        offsets = torch.arange(S, device=q.device)  # every distance a query can have to a key it sees
        table = sinusoidal_table(offsets, self.cfg.d_model).to(q.dtype)  # float32 angles, the model's dtype after
        r = self.w_r[layer](table).view(S, H, Dh).transpose(0, 1)  # (H, S, Dh)
        per_offset = (q + self.v[None, :, None, :]) @ r.transpose(-1, -2)  # (B, H, T, S): by distance, not key
        dist = distance(q_pos, k_pos).clamp(min=0)  # (B, 1, T, S); future keys are masked anyway
        dist = torch.minimum(dist, torch.full_like(dist, S - 1))
        position = torch.gather(per_offset, -1, dist.expand(B, H, T, S))
        content = (self.u[None, :, None, :] @ k.transpose(-1, -2))  # (B, H, 1, S): u.k_j, the same for every query
        return (position + content) / math.sqrt(Dh)
