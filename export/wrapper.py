"""The exported module: flat named tensors in, flat named tensors out, in export.signature's order."""

from __future__ import annotations

import torch
from torch import nn

from export.signature import flatten_past, spec_of, split_past
from model.transformer import Transformer


class GraphModule(nn.Module):
    """Wraps the reference model so the exported graph takes and returns flat tensors."""

    def __init__(self, model: Transformer):
        super().__init__()
        self.model = model.eval()

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                past: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        pairs, state = split_past(past, self.model.cfg)
        out = self.model(input_ids, attention_mask, pairs, state=state or None)
        return (out.logits, out.attentions, *flatten_past(out.presents, out.state, self.model.cfg))


def example_inputs(model: Transformer, batch: int = 2, new: int = 7, past: int = 6,
                   seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """Inputs with batch >= 2, new >= 2 and past >= 2 so no dimension is specialised during capture."""
    cfg = model.cfg
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (batch, new), generator=g)
    mask = torch.ones(batch, past + new, dtype=torch.int64)
    mask[0, :1] = 0  # one left-padded row
    carried = [torch.randn(batch, cfg.kv_heads, past, cfg.head_dim, generator=g) if s["sequence_axis"] is not None
               else torch.randn(batch, *s["shape"][1:], generator=g) for s in spec_of(model)["state"]]
    return ids, mask, carried
