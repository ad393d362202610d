"""Sandwich (Chi, Fan, Rudnicky, Ramadge 2023, "Dissecting Transformer Length Extrapolation via the Lens of
Receptive Field Analysis", ACL 2023, arXiv 2212.10356): the inner product of two sinusoidal position embeddings as
a parameter-free bias on the scaled scores q.k/sqrt(Dh).

With p_m = [sin(m w_k), cos(m w_k)]_{k=1..d'/2} and w_k = 10000^(-2k/d'),

  p_i . p_j = sum_k cos((i - j) w_k),   b_h(i, j) = (p_i . p_j - d'/2) / (8h / H),  h = 1 .. H

so the bias is 0 on the diagonal, negative elsewhere, decays roughly logarithmically with the distance (the
pattern the paper shares with KERPLE and T5), and is compressed per head by ALiBi's head layout (the paper's
h = n * 8/H).  d' is the head dimension and the frequencies start at k = 1, as NVIDIA NeMo's implementation of the
paper has them (`SandwichRelativePositionEmbedding`, which passes each head's size as d').

Computed from the distance i - j (so exactly relative) one frequency at a time: (B, 1, T, S) per term rather than
a (B, 1, T, S, d'/2) tensor of cosines; d'/2 is a model constant, unrolled in an exported graph.  The distance is
clamped at 0 on the masked future keys.  Query-free: one bias per forward for every layer.
"""

from __future__ import annotations

import torch

from model.errors import ConfigError
from model.variants.base import PositionalVariant, distance

BASE = 10000.0  # the sinusoidal embedding's base
HEAD_SPAN = 8.0  # ALiBi's: head h of H divides its bias by 8h/H


def sandwich_frequencies(dims: int) -> list[float]:
    """w_k = 10000^(-2k/d') for k = 1 .. d'/2."""
    return [BASE ** (-2.0 * k / dims) for k in range(1, dims // 2 + 1)]


class Sandwich(PositionalVariant):
    name = "sandwich"
    query_dependent_bias = False

    @classmethod
    def check_config(cls, cfg):
        super().check_config(cfg)
        if cfg.head_dim % 2:
            raise ConfigError(f"sandwich needs an even head_dim (d' of its sinusoidal pairs), got {cfg.head_dim}")

    def __init__(self, cfg):
        super().__init__(cfg)
        self.omegas = sandwich_frequencies(cfg.head_dim)  # model constants
        H = cfg.n_heads
        # (H,) non-persistent: a model constant, not a learned weight
        self.register_buffer("head_scale", torch.tensor([H / (HEAD_SPAN * h) for h in range(1, H + 1)]),
                             persistent=False)

    def score_bias(self, q, q_pos, k_pos, *, k=None, layer=0):
        dist = distance(q_pos, k_pos).clamp(min=0).to(torch.float32)  # (B, 1, T, S)
        inner = torch.zeros_like(dist)
        for w in self.omegas:
            inner = inner + torch.cos(dist * w)
        return (inner - len(self.omegas)) * self.head_scale[None, :, None, None]  # (B, H, T, S)
