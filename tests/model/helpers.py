"""Shared helpers for model tests: tiny models with weights large enough that positions matter."""

from __future__ import annotations

import torch

from model.config import preset
from model.transformer import Transformer


def tiny_model(variant: str, seed: int = 0, **overrides) -> Transformer:
    """A tiny model whose random weights are scaled up, so attention is far from uniform and every positional
    term moves the output (default 0.02-std weights would let a broken bias pass unnoticed)."""
    torch.manual_seed(seed)
    model = Transformer(preset("tiny", variant, **overrides))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "ln" in name:
                continue
            p.add_(torch.randn_like(p) * 0.3)
    return model.eval()


def left_pad(rows: list[list[int]], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.int64)
    mask = torch.zeros((len(rows), width), dtype=torch.int64)
    for i, r in enumerate(rows):
        ids[i, width - len(r):] = torch.tensor(r)
        mask[i, width - len(r):] = 1
    return ids, mask


def check_cached_decode(model: Transformer, length: int, start: int, seed: int = 5) -> None:
    """`length` random tokens decoded one at a time after a prompt of `start`, against the full forward: each step's
    attention row and logits, then every layer's cached keys, which the steps appended and never changed."""
    ids = torch.randint(0, 256, (1, length), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        full = model(ids)
        out = model(ids[:, :start])
        for t in range(start, length):
            out = model(ids[:, t:t + 1], past_key_values=out.presents)
            torch.testing.assert_close(out.attentions[0, :, :, 0], full.attentions[0, :, :, t, :t + 1],
                                       atol=1e-5, rtol=0)
            torch.testing.assert_close(out.logits[0, -1], full.logits[0, t], atol=1e-4, rtol=0)
    for (k, _), (fk, _) in zip(out.presents, full.presents, strict=True):
        torch.testing.assert_close(k, fk, atol=1e-5, rtol=0)


def check_row_alone_in_padded_pieces(model: Transformer) -> None:
    """A row behind left pads, decoded in two pieces of which the second is left-padded too (pads in the middle of
    its cache), then a cached step: the logits and the real keys' maps of that row alone (a variant whose bias reads
    every cached key must let no pad count)."""
    row = torch.randint(0, 256, (14,), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        alone = model(row[None])
        ids1, mask1 = left_pad([row[:6].tolist(), list(range(1, 9))])  # 2 left pads in row 0
        first = model(ids1, mask1)
        ids2, mask2 = left_pad([row[6:13].tolist(), list(range(9, 19))])  # 3 pads in row 0's middle
        second = model(ids2, torch.cat((mask1, mask2), 1), past_key_values=first.presents)
        mask3 = torch.cat((mask1, mask2, torch.ones(2, 1, dtype=torch.int64)), 1)
        step = model(torch.stack((row[13:], torch.tensor([19]))), mask3, past_key_values=second.presents)
    real = mask3[0].bool()
    torch.testing.assert_close(second.logits[0, -7:], alone.logits[0, 6:13], atol=1e-4, rtol=0)
    torch.testing.assert_close(step.logits[0, -1], alone.logits[0, 13], atol=1e-4, rtol=0)
    torch.testing.assert_close(step.attentions[0, :, :, -1][..., real], alone.attentions[0, :, :, 13], atol=1e-5,
                               rtol=0)
