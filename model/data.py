"""Training text: the documentation that ships inside every CPython (`pydoc_data.topics`), or a given file.

The text is split by bytes into a train part and a held-out part (the last `holdout` fraction), so held-out
loss is measured on text the model never saw.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from model.errors import CorpusError
from model.tokenizer import encode

BUILTIN = "pydoc_data.topics"


def builtin_text() -> str:
    from pydoc_data.topics import topics  # ships with CPython's standard library

    return "\n\n".join(topics[key] for key in sorted(topics))


def load_text(corpus: str | Path | None) -> str:
    if corpus is None or str(corpus) == BUILTIN:
        return builtin_text()
    path = Path(corpus)
    if not path.is_file():
        raise CorpusError(f"corpus {path} does not exist or is not a file")
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise CorpusError(f"corpus {path} is not UTF-8 text (invalid byte at offset {err.start})") from None
    if not text.strip():
        raise CorpusError(f"corpus {path} is empty")
    return text


@dataclass(frozen=True)
class Splits:
    train: torch.Tensor  # int64 byte ids
    heldout: torch.Tensor


def split(text: str, context: int, holdout: float = 0.1) -> Splits:
    data = torch.tensor(encode(text), dtype=torch.int64)
    cut = int(len(data) * (1 - holdout))
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
