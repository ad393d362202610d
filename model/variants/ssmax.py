"""Scalable-Softmax (Nakanishi 2025, "Scalable-Softmax Is Superior for Attention", arXiv 2501.19399): the softmax
input z of each attention row (the scaled scores q.k / sqrt(d), plus any bias) multiplied by s log n,

  a_j = exp(s log(n) z_j) / sum_j' exp(s log(n) z_j') = n^(s z_j) / sum_j' n^(s z_j'),

n the number of keys the row's query sees and s a learnable scalar per layer and head.  The paper's argument: a
plain softmax over n keys flattens as n grows ("attention fading": its largest output goes to 0 with n for fixed
scores), while n^(s z) keeps the largest output near 1 when one score stands s-independent margins above the rest,
so attention can stay focused past the trained length.  Its claims: faster pretraining loss, better long-context
loss and key-information retrieval (needle in a haystack), most when used from the start of pretraining.

Here n is counted from the position index: a causal query at 0-based position t sees the t + 1 real tokens up to
itself, so n = t + 1 and the factor is s log(t + 1), computed in float32 from the positions each call (a padded
row's positions count its real tokens only; a cached step's query takes its own position).  The factor multiplies
the query before q.k (the paper's own implementation of it: softmax((s log n) q K^T / sqrt(d))), which is exact
for the content score and keeps the masking safe: the mask's most negative value is added after, never multiplied.
At n = 1 (the first token) log 1 = 0: the query is zeroed and the row attends uniformly to the one key it sees.
A model without score biases (both variants here) has z = q.k / sqrt(d), so scaling q is scaling z.

The paper's initial value of s: the text reachable here does not state it (its Figure 1 illustrates SSMax with
s = 0.43, the value the unofficial gdevos010/Scalable-Softmax port takes as its default).  posenc starts s at
`S_INIT` = 0.43: s log n is then 1.19 at the tiny preset's 16 positions and 2.09 at the default 128, so training
starts near a plain softmax at the trained length and sharpens it further out, and s learns from there (not
weight-decayed, as every variant parameter).

Positions as an index: n comes from the positions the model is given, so randomized positions in training and an
intervention's positions (export/intervene.py) change n as they change any index encoding.  An intervention's
positional_off for a layer removes its length scaling (a plain softmax there, the factor 1; with ssmax_rope the
rotation goes too).  Neither variant takes the compact fast graph (compact_layout False): its GroupQueryAttention
rewrite, and its rotary folding, are proven for attention that reads q as the rotation left it.

`ssmax`: SSMax alone, no other positional encoding (NoPE otherwise: order otherwise reaches it through the causal
mask).  `ssmax_rope`: SSMax on top of RoPE (model.variants.rope: the config's base, pairing, fraction and RoPE
scaling), q rotated first and then scaled.
"""

from __future__ import annotations

import torch
from torch import nn

from model.errors import ConfigError
from model.variants.base import PositionalVariant
from model.variants.rope import Rope

S_INIT = 0.43  # s at initialisation, every layer and head (see the docstring: the paper's Figure 1 value)


def log_keys(positions: torch.Tensor) -> torch.Tensor:
    """log n for each query, n = position + 1 the keys it sees: (B, T) float32 (a negative position counts as 0)."""
    return torch.log1p(positions.clamp(min=0).to(torch.float32))


def scale_queries(q: torch.Tensor, positions: torch.Tensor, s: torch.Tensor, head_dim: int) -> torch.Tensor:
    """q multiplied by s_h log n per head h and query: q (B, H, T, Dh), or (B, T, H * Dh) as the export's
    Attention-23 graph passes it; positions (B, T); s (H,)."""
    factor = log_keys(positions)  # (B, T)
    if q.dim() == 4:
        return q * (s[None, :, None] * factor[:, None, :])[..., None]
    B, T, _ = q.shape
    heads = q.reshape(B, T, -1, head_dim)  # (B, T, H, Dh)
    return (heads * (factor[:, :, None] * s)[..., None]).reshape(B, T, -1)


class LengthScaled(PositionalVariant):
    """Each block's queries scaled by s log n after the rotation of the next base class (none for ssmax, RoPE's for
    ssmax_rope), s learnable per layer and head."""

    def __init__(self, cfg):
        super().__init__(cfg)
        self.s = nn.Parameter(torch.full((cfg.n_layers, cfg.n_heads), S_INIT))

    def rotate_layer(self, q, k, positions, layer, rope=None):
        """Block `layer`'s rotation (an intervention's RoPE frequencies included), then its queries scaled."""
        q, k = super().rotate_layer(q, k, positions, layer, rope)
        return scale_queries(q, positions, self.s[layer], self.cfg.head_dim), k

    def query_scale(self, positions: torch.Tensor) -> torch.Tensor:
        """The factor s log n on each query (layers, heads, N) for positions (N,): the encoding's picture."""
        return self.s[:, :, None] * log_keys(positions)[None, None]

    def note(self) -> str:
        """The encoding's note (export/encoding.py): what the pictures cannot show."""
        first = ", ".join(f"{v:.3g}" for v in self.s[0].tolist())
        return (f"Scalable-Softmax: each query scaled by s log n, n = its position + 1 (the keys it sees), s learned "
                f"per layer and head (layer 0: {first})")


class SSMax(LengthScaled):
    name = "ssmax"


class SSMaxRope(LengthScaled, Rope):
    name = "ssmax_rope"
    compact_layout = False  # the scaled queries leave RoPE's compact rewrite: see the docstring

    @classmethod
    def check_config(cls, cfg):
        super().check_config(cfg)
        if cfg.local_rope_base or any(cfg.layer(i).encoding != "model" for i in range(cfg.n_layers)):
            # model.json's layer plan names each layer's RoPE for the rope variant alone
            raise ConfigError("ssmax_rope rotates every layer by the model's RoPE: local_rope_base and per-layer "
                              "encodings apply to the rope variant only")
