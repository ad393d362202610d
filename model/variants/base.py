"""The three hooks every positional variant plugs into (DESIGN.md section 2), with no-op defaults.

Shapes: x (B, T, D); q, k (B, H, T, Dh); q_pos (B, T) and k_pos (B, S) are int64 positions derived from the
attention mask (cumsum - 1), where S = past + new.  A bias is (B, H, T, S) or broadcastable to it.
One instance is shared by all layers (T5 does the same with its bucket table).

Rule for every hook: compute from the positions at run time.  No tables sized for one length, no buffers cached
behind Python shape checks: the exporter would bake them into the graph.
"""

from __future__ import annotations

import torch
from torch import nn

from model.config import ModelConfig


class PositionalVariant(nn.Module):
    name = "none"
    # False when score_bias ignores q: the model then computes the bias once per forward for all layers.
    query_dependent_bias = True

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg

    def check_length(self, total: int) -> None:
        """Raise SequenceTooLongError when past + new positions exceed what the variant supports."""

    def embed(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return x

    def score_bias(self, q: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor | None:
        return None

    def rotate(self, q: torch.Tensor, k: torch.Tensor, q_pos: torch.Tensor,
               k_pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return q, k


def distance(q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
    """i - j for every query/key pair: (B, 1, T, S) int64, >= 0 on every key a causal query may see."""
    return (q_pos[:, :, None] - k_pos[:, None, :])[:, None]
