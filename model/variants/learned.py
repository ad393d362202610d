"""Learned absolute positions (GPT-2 `wpe`): a table with one row per position, `context` rows.

Longer input is a SequenceTooLongError naming the limit, never an IndexError or a silent clamp.
"""

from __future__ import annotations

import torch
from torch import nn

from model.errors import SequenceTooLongError
from model.variants.base import PositionalVariant


class Learned(PositionalVariant):
    name = "learned"

    def __init__(self, cfg):
        super().__init__(cfg)
        self.table = nn.Embedding(cfg.context, cfg.d_model)
        nn.init.normal_(self.table.weight, std=0.02)

    @classmethod
    def max_positions(cls, cfg):
        return cfg.context  # one table row per position

    def check_length(self, total: int) -> None:
        if total > self.cfg.context:
            raise SequenceTooLongError(total, self.cfg.context, self.name)

    def embed(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return x + self.table(positions)
