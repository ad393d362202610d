"""Sinusoidal absolute positions (Vaswani et al. 2017), interleaved layout, computed on the fly.

PE(p, 2k) = sin(p w_k), PE(p, 2k+1) = cos(p w_k), w_k = 10000^(-2k/d).  Angles in fp32 from the positions, so
any length works and nothing length-specific lands in an exported graph.

The encoding is multiplied by one learned scalar (init d^-0.5, as x-transformers' ScaledSinusoidalEmbedding):
unscaled, its unit-size entries swamp 0.02-std token embeddings and training stalls near the unigram loss.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from model.errors import ConfigError
from model.variants.base import PositionalVariant


def sinusoidal_table(positions: torch.Tensor, d_model: int) -> torch.Tensor:
    """(..., d_model) encodings for integer positions of any shape."""
    k = torch.arange(0, d_model, 2, device=positions.device, dtype=torch.float32)  # (d/2,)
    omega = torch.exp(k * (-math.log(10000.0) / d_model))
    angles = positions.to(torch.float32)[..., None] * omega  # (..., d/2)
    # stack then flatten interleaves: [sin w0, cos w0, sin w1, cos w1, ...]
    return torch.stack((angles.sin(), angles.cos()), dim=-1).flatten(-2)


class Sinusoidal(PositionalVariant):
    name = "sinusoidal"

    @classmethod
    def check_config(cls, cfg):
        super().check_config(cfg)
        if cfg.d_model % 2:
            raise ConfigError(f"sinusoidal needs an even d_model, got {cfg.d_model}")

    def __init__(self, cfg):
        super().__init__(cfg)
        self.scale = nn.Parameter(torch.tensor(cfg.d_model ** -0.5))

    def embed(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return x + self.scale * sinusoidal_table(positions, self.cfg.d_model)
