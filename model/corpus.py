"""The text posenc trains on, torch-free: the built-in corpus, a UTF-8 file, and where the held-out part begins.

The held-out part is the last `holdout` fraction of the bytes; model.data splits tensors with the same cut, and
the lab (lab/) evaluates on exactly those bytes without importing torch.
"""

from __future__ import annotations

from pathlib import Path

from model.errors import CorpusError
from model.tokenizer import encode

BUILTIN = "pydoc_data.topics"
HOLDOUT = 0.1


def builtin_text() -> str:
    # lazy: the 1.3 MB of text (RSS 12.1 MB against a bare interpreter's 10.8, measured) is loaded only when
    # the built-in corpus is asked for; the worker and the lab import this module for other things
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


def heldout_cut(n_bytes: int, holdout: float = HOLDOUT) -> int:
    """Index of the first held-out byte."""
    return int(n_bytes * (1 - holdout))


def train_text(corpus: str | Path | None = None, holdout: float = HOLDOUT) -> str:
    """The training split (everything before the held-out tail) as text, for training a tokenizer or a model on
    exactly the bytes the held-out figures exclude (a character cut at the split is dropped)."""
    data = load_text(corpus).encode("utf-8")
    return data[:heldout_cut(len(data), holdout)].decode("utf-8", errors="ignore")


def heldout_bytes(corpus: str | Path | None = None, holdout: float = HOLDOUT) -> list[int]:
    """The held-out byte ids of a corpus: text no model was trained on."""
    data = encode(load_text(corpus))
    return data[heldout_cut(len(data), holdout):]
