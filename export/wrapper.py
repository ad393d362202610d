"""The graph's calling convention: flat named tensors in, flat named tensors out (DESIGN.md section 4).

input_ids [batch, new], attention_mask [batch, past + new], past_key_values.{i}.key/.value [batch, H, past, Dh]
(then past_{name} [batch, ...] for each entry of the variant's state_spec, e.g. past_conv_state)
-> logits [batch, new, V], attentions [batch, L, H, new, past + new], present.{i}.key/.value (then present_{name}).
"""

from __future__ import annotations

import torch
from torch import nn

from model.transformer import Transformer


def input_names(n_layers: int, states: list[str] = ()) -> list[str]:
    names = ["input_ids", "attention_mask"]
    for i in range(n_layers):
        names += [f"past_key_values.{i}.key", f"past_key_values.{i}.value"]
    return names + [f"past_{s}" for s in states]


def output_names(n_layers: int, states: list[str] = ()) -> list[str]:
    names = ["logits", "attentions"]
    for i in range(n_layers):
        names += [f"present.{i}.key", f"present.{i}.value"]
    return names + [f"present_{s}" for s in states]


def state_names(model: Transformer) -> list[str]:
    return [name for name, _ in model.pos.state_spec()]


class GraphModule(nn.Module):
    """Wraps the reference model so the exported graph takes and returns flat tensors."""

    def __init__(self, model: Transformer):
        super().__init__()
        self.model = model.eval()

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                past: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        n_kv = 2 * self.model.cfg.n_layers
        pairs = tuple((past[2 * i], past[2 * i + 1]) for i in range(n_kv // 2))
        state = tuple(past[n_kv:]) or None
        out = self.model(input_ids, attention_mask, pairs, state=state)
        flat = [t for kv in out.presents for t in kv]
        return (out.logits, out.attentions, *flat, *out.state)


def example_inputs(model: Transformer, batch: int = 2, new: int = 7, past: int = 6,
                   seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """Inputs with batch >= 2, new >= 2 and past >= 2 so no dimension is specialised during capture."""
    cfg = model.cfg
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (batch, new), generator=g)
    mask = torch.ones(batch, past + new, dtype=torch.int64)
    mask[0, :1] = 0  # one left-padded row
    kv = [torch.randn(batch, cfg.n_heads, past, cfg.head_dim, generator=g) for _ in range(2 * cfg.n_layers)]
    kv += [torch.randn(batch, *shape, generator=g) for _, shape in model.pos.state_spec()]
    return ids, mask, kv
