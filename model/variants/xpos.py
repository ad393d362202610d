"""xPos (Sun et al. 2022, "A Length-Extrapolatable Transformer", arXiv 2212.10554): RoPE whose rotated pairs are
also scaled, the query at position n by zeta_i^(n/B) and the key at position m by zeta_i^(-m/B), so that pair i
of q.k gains zeta_i^((n - m)/B): a decay with the distance on top of the rotation, still a function of n - m only.

  zeta_i = (2i/d + gamma) / (1 + gamma),  i = 0 .. d/2 - 1,  gamma = 0.4,  B = scale_base = 512

(microsoft/torchscale's XPOS: zeta from about 0.29 on the fastest pair up to about 1 on the slowest).  The
rotation is RoPE's (model.variants.rope): theta_i = rope_base^(-2i/d) over the config's rotated dims and pairing.

Positions are not centred.  torchscale shifts the scale's positions by half the current length, which moves with
every new token, so it caches keys before xPos and scales the whole cache again each step; here every key is
scaled by its own position when it is new and cached after rotation and scaling, which stays right at any later
step because the centre never moves.  The price is range: the fastest pair's key factor 3.5^(m/512) reaches
float32's largest value near m = 36,000 (and float16's near 4,500), the query factor float32's smallest normal
value near n = 35,000; within that every factor is computed as exp((n/B) ln zeta) in float32 from the positions.
The paper's blockwise causal attention at inference is a mask, not part of the encoding, and is not applied.
A RoPE scaling (linear, ntk, ...) is refused: xpos is not `rope_scaled`.
"""

from __future__ import annotations

import torch

from model.variants.base import PositionalVariant
from model.variants.rope import apply_rope, check_pairs, rope_angles

GAMMA = 0.4
SCALE_BASE = 512.0


class XPos(PositionalVariant):
    name = "xpos"

    @classmethod
    def check_config(cls, cfg):
        super().check_config(cfg)
        check_pairs(cfg, "xpos")

    def scale_exponents(self, positions: torch.Tensor) -> torch.Tensor:
        """(n / B) ln zeta_i for each position n (B, T), laid out like the pairs: (B, 1, T, d_rot) float32, computed
        from the positions each call (zeta is a model constant; no table sized for one length)."""
        cfg = self.cfg
        i = torch.arange(cfg.rope_dim // 2, device=positions.device, dtype=torch.float32)
        log_zeta = torch.log((i / (cfg.rope_dim // 2) + GAMMA) / (1.0 + GAMMA)) / SCALE_BASE  # (d_rot/2,)
        exponents = positions.to(torch.float32)[..., None] * log_zeta  # (B, T, d_rot/2)
        if cfg.rope_pairing == "interleaved":  # pair i is dims (2i, 2i+1)
            exponents = torch.stack((exponents, exponents), dim=-1).flatten(-2)
        else:  # pair i is dims (i, i + d_rot/2)
            exponents = torch.cat((exponents, exponents), dim=-1)
        return exponents[:, None]

    def rotate(self, q, k, positions):
        cos, sin = rope_angles(positions, self.cfg)  # (B, 1, T, d_rot), float32
        exponents = self.scale_exponents(positions)
        up, down = torch.exp(exponents), torch.exp(-exponents)  # zeta^(n/B) for queries, zeta^(-m/B) for keys
        interleaved = self.cfg.rope_pairing == "interleaved"
        return self._turn(q, cos * up, sin * up, interleaved), self._turn(k, cos * down, sin * down, interleaved)

    def _turn(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
        """apply_rope on (B, heads, T, Dh), or on the (B, T, heads * Dh) the export's Attention-23 graph passes."""
        if x.dim() == 4:
            return apply_rope(x, cos, sin, interleaved)
        B, T, _ = x.shape
        heads = x.reshape(B, T, -1, self.cfg.head_dim)  # (B, T, heads, Dh)
        out = apply_rope(heads, cos.transpose(1, 2), sin.transpose(1, 2), interleaved)  # (B, T, 1, d_rot)
        return out.reshape(B, T, -1)
