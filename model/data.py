"""Training text: the documentation that ships inside every CPython (`pydoc_data.topics`), or a given file.

The text is split by bytes into a train part and a held-out part (the last `holdout` fraction), so held-out
loss is measured on text the model never saw.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from model.corpus import BUILTIN, builtin_text, heldout_cut, load_text  # noqa: F401 (re-exported)
from model.errors import CorpusError
from model.tokenizer import encode


@dataclass(frozen=True)
class Splits:
    train: torch.Tensor  # int64 byte ids
    heldout: torch.Tensor


def split(text: str, context: int, holdout: float = 0.1) -> Splits:
    data = torch.tensor(encode(text), dtype=torch.int64)
    cut = heldout_cut(len(data), holdout)
    train, heldout = data[:cut], data[cut:]
    if len(train) < context + 1 or len(heldout) < 2:
        raise CorpusError(f"corpus too small: {len(data)} bytes; need more than {int((context + 1) / (1 - holdout))} "
                          f"for a context of {context}")
    return Splits(train, heldout)


def random_batch(data: torch.Tensor, batch: int, context: int, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    """`batch` random windows: inputs (B, T) and next-byte targets (B, T)."""
    starts = torch.randint(0, len(data) - context, (batch,), generator=gen)
    windows = torch.stack([data[s:s + context + 1] for s in starts.tolist()])
    return windows[:, :-1], windows[:, 1:]


def eval_windows(data: torch.Tensor, context: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Non-overlapping windows covering the held-out text (the tail that does not fill a window is dropped)."""
    n = (len(data) - 1) // context
    if n == 0:
        context, n = len(data) - 1, 1
    x = data[: n * context].view(n, context)
    y = data[1: n * context + 1].view(n, context)
    return x, y
