"""CoPE, contextual position encoding (Golovneva, Wang, Weston, Sukhbaatar 2024, "Contextual Position Encoding:
Learning to Count What's Important", arXiv 2405.18719, section 3).

A query decides which keys count as a step: each key j it sees gets a gate g_ij = sigmoid(q_i . k_j / sqrt(d)),
and the position of key j relative to query i is the sum of the gates from j up to i, both ends included,

  p_ij = sum_{t = j}^{i} g_it,

a real number in (0, i - j + 1], clamped to npos - 1.  Each layer has a table E of npos position vectors (d x npos,
shared by the layer's heads, zero at the start as in the authors' code, facebookresearch/RAM
projects/cope/src/cope/context_position.py).  The bias is q_i . e[p_ij], the embedding of a fractional position
interpolated between its neighbours: with z_i = q_i E (npos values, one product per query instead of one per pair),
(1 - w) z_i[floor p] + w z_i[ceil p], w = p - floor p.  The authors' code divides (q.k + bias) by sqrt(d); the
score_bias hook adds to q.k / sqrt(d), so the bias is divided by sqrt(d) here.  npos is the trained context + 1
(the code's block_size + 1: position 0 aside, a count of at most the context).

Which keys count: a gate is 0 on a key the query may not see (a future slot, a pad).  The hook reads slots and
positions, not the attention mask, so it tells them apart from the positions the model derives from the mask
(cumsum - 1, model.attention.positions_from_mask): a real token's position is above the slot before it (one more),
a pad's is not (a pad repeats its predecessor's count; the intervention graph's feeds give pads 0).  That test fails
for the first real token of a left-padded row (position 0 after pads at 0), but the sum for a key j runs over
slots j .. i only: slot j itself is the key (counted whenever the pair is visible; masked pairs get a finite bias
the mask hides), and every later slot comes after a real token, where the test is exact.  Left pads thus never
enter a count, and pads in the middle of a row are skipped.  Future slots are told by slot index (query t of T
sits at slot S - T + t), so a cached step recomputes its query's gates over every cached key: nothing extra to
cache, and cached keys do not change.

Positions are counts, not an index: index_positions = False (no randomized positions, no positions given by an
intervention).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from model.variants.base import PositionalVariant, token_slots


class CoPE(PositionalVariant):
    name = "cope"
    index_positions = False  # counts of gated keys: a position index given from outside has no meaning here

    def __init__(self, cfg):
        super().__init__(cfg)
        self.npos = cfg.context + 1  # the authors' block_size + 1: counts 0 .. context
        self.tables = nn.ParameterList(nn.Parameter(torch.zeros(cfg.head_dim, self.npos))
                                       for _ in range(cfg.n_layers))  # E per layer, shared by its heads
        self.scale = math.sqrt(cfg.attn_scale_dim or cfg.head_dim)  # the attention's own sqrt(d)

    def counted(self, k_pos: torch.Tensor, T: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Which slots a query counts (B, 1, 1, S): 1 where the position steps up from the slot before (a real
        token after the first), and which keys each query may see by slot (1, 1, T, S): those not after it."""
        S = k_pos.shape[1]
        step = token_slots(k_pos)
        slot = torch.arange(S, device=k_pos.device)
        causal = slot[None, :] <= (slot[-T:])[:, None]  # (T, S)
        return step[:, None, None, :], causal[None, None]

    def positions(self, gates: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        """p_ij = sum of the counted gates g_it over slots t = j .. i, slot j always counted: (B, H, T, S)."""
        T = gates.shape[2]
        step, causal = self.counted(k_pos, T)
        own = torch.where(causal, gates, torch.zeros_like(gates))  # g_ij, 0 on future keys
        kept = own * step.to(gates.dtype)  # g_it on the slots that count
        # sum over t = j .. S-1 (t > i is 0 already), in float64: a float32 sum of a few hundred gates is off by
        # about 1e-5 in an order-dependent way, and PyTorch and onnxruntime add in different orders
        total = kept.double().flip(-1).cumsum(-1).flip(-1)
        after = torch.cat((total[..., 1:], torch.zeros_like(total[..., :1])), dim=-1)  # over t = j+1 .. i
        return (own.double() + after).to(gates.dtype).clamp(max=self.npos - 1)

    def score_bias(self, q, q_pos, k_pos, *, k=None, layer=0):
        gates = torch.sigmoid(q @ k.transpose(-1, -2) / self.scale)  # (B, H, T, S)
        p = self.positions(gates, k_pos)
        z = q @ self.tables[layer].to(q.dtype)  # (B, H, T, npos): q_i . e[n] for every whole position n
        low, high = p.floor(), p.ceil()
        w = p - low  # the gradient reaches p through w; the indices carry none
        below = torch.gather(z, -1, low.to(torch.int64))
        above = torch.gather(z, -1, high.to(torch.int64))
        return (below * (1 - w) + above * w) / self.scale
