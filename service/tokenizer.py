"""The artifact's own tokenizer in the worker: posenc's byte-level UTF-8 one, or a Hugging Face tokenizer.json
(the `tokenizers` library: Rust, no torch, no transformers).  Every front takes ids, pieces and text from here, so
a model's answers always use the tokenizer it was trained with.

model.json's "tokenizer" says which: {"type": "bytes-utf8", "vocab_size": 256} or
{"type": "huggingface-tokenizers", "file": "tokenizer.json", "vocab_size": N, ...}.  The model's vocabulary is its
embedding rows, which may exceed the tokenizer's (ids past it are valid, and decode to nothing).
"""

from __future__ import annotations

import codecs
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from model import tokenizer as byte_tokenizer
from service.errors import ArtifactRejected

BYTES, HF = "bytes-utf8", "huggingface-tokenizers"


class ByteTokenizer:
    kind = BYTES
    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return byte_tokenizer.encode(text)

    def decode(self, ids: Sequence[int]) -> str:
        return byte_tokenizer.decode(ids)

    def pieces(self, ids: Sequence[int]) -> list[str]:
        return byte_tokenizer.pieces(ids)

    def display(self, token: int) -> str:
        return byte_tokenizer.display(token)

    def text_bytes(self, ids: Sequence[int]) -> int:
        return len(ids)  # one byte per token

    def stream(self) -> Callable[[int], str]:
        """Generate's text so far, one token at a time: complete UTF-8 characters accumulate; an unfinished one at
        the end shows as U+FFFD until its last byte arrives (as decoding everything with errors="replace" would)."""
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        done = [""]

        def push(token: int) -> str:
            done[0] += decoder.decode(bytes((token,)))
            pending = decoder.getstate()[0]
            return done[0] + pending.decode("utf-8", errors="replace") if pending else done[0]

        return push


class HFTokenizer:
    kind = HF

    def __init__(self, path: Path):
        from tokenizers import Tokenizer  # lazy: byte-level models need no tokenizers (it adds 5.8 MB RSS, measured)

        try:
            self.tok = Tokenizer.from_file(str(path))
        except Exception as err:  # the library's own parse error: the file is not a tokenizer.json
            raise ArtifactRejected(f"{path} is not a tokenizer.json the tokenizers library can read: {err}") from None
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text).ids  # the tokenizer's own special tokens, as Hugging Face's call adds them

    def decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode([i for i in ids if i < self.vocab_size], skip_special_tokens=False)

    def display(self, token: int) -> str:
        """The token's text when it is text by itself, else its vocabulary entry (a byte of a split character)."""
        if token >= self.vocab_size:
            return f"<id {token}>"
        text = self.tok.decode([token], skip_special_tokens=False)
        return text if text and "\ufffd" not in text else (self.tok.id_to_token(token) or f"<id {token}>")

    def pieces(self, ids: Sequence[int]) -> list[str]:
        return [self.display(t) for t in ids]

    def text_bytes(self, ids: Sequence[int]) -> int:
        return len(self.decode(ids).encode("utf-8"))

    def stream(self) -> Callable[[int], str]:
        """Generate's text so far: the library's decode of every token so far (in Rust, microseconds for a
        stream's length), so the text always equals decoding the whole output, bytes that are not UTF-8 included
        (its DecodeStream holds such bytes back and can end on a different text)."""
        ids: list[int] = []

        def push(token: int) -> str:
            ids.append(token)
            return self.decode(ids)

        return push


def for_artifact(folder: Path, meta: dict[str, Any]) -> ByteTokenizer | HFTokenizer:
    spec = meta.get("tokenizer") or {"type": BYTES}
    kind = spec.get("type", BYTES)
    if kind == BYTES:
        return ByteTokenizer()
    if kind == HF:
        name = spec.get("file")
        if not name or Path(name).name != name or not (folder / name).is_file():
            raise ArtifactRejected(f"model.json names tokenizer file {name!r}, which {folder} does not hold")
        tok = HFTokenizer(folder / name)
        rows = int(meta["sizes"]["vocab_size"])
        if tok.vocab_size > rows:
            raise ArtifactRejected(f"{folder / name} has {tok.vocab_size} tokens, more than the model's {rows} "
                                   "embedding rows")
        return tok
    raise ArtifactRejected(f"model.json's tokenizer type {kind!r} is not one the worker knows ({BYTES}, {HF})")
