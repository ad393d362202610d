"""Byte-level UTF-8 tokenizer: token id = byte value, vocabulary 256, no unknown tokens.

Imports nothing but the standard library so the worker (no torch) can share the same contract.
A multi-byte character becomes several tokens; `display` names each such byte readably, so an attention map
over Chinese text shows "<E4 1/3>" rather than a replacement character.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

VOCAB_SIZE = 256
NAME = "bytes-utf8"

_ESCAPES = {0x09: "\\t", 0x0A: "\\n", 0x0D: "\\r", 0x20: "␠"}


def encode(text: str) -> list[int]:
    """UTF-8 bytes of `text` as token ids."""
    if not isinstance(text, str):
        raise TypeError(f"encode expects str, got {type(text).__name__}")
    return list(text.encode("utf-8"))


def check_ids(ids: Iterable[int]) -> list[int]:
    out = []
    for i in ids:
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < VOCAB_SIZE:
            raise ValueError(f"token id {i!r} is outside the byte vocabulary [0, {VOCAB_SIZE})")
        out.append(i)
    return out


def decode(ids: Iterable[int]) -> str:
    """Text of the ids; an incomplete or invalid UTF-8 sequence becomes U+FFFD, never an exception."""
    return bytes(check_ids(ids)).decode("utf-8", errors="replace")


def _utf8_role(byte: int) -> tuple[str, int]:
    """('lead', total length) for a lead byte, ('cont', 0) for a continuation byte, ('bad', 0) otherwise."""
    if 0xC2 <= byte <= 0xDF:
        return "lead", 2
    if 0xE0 <= byte <= 0xEF:
        return "lead", 3
    if 0xF0 <= byte <= 0xF4:
        return "lead", 4
    if 0x80 <= byte <= 0xBF:
        return "cont", 0
    return "bad", 0


def display(token: int) -> str:
    """A readable form of one token on its own: ASCII as itself, whitespace escaped, other bytes as hex."""
    (token,) = check_ids([token])
    if token in _ESCAPES:
        return _ESCAPES[token]
    if 0x21 <= token <= 0x7E:
        return chr(token)
    if token < 0x80:
        return f"<{token:02X}>"
    role, length = _utf8_role(token)
    if role == "lead":
        return f"<{token:02X} 1/{length}>"
    if role == "cont":
        return f"<{token:02X} cont>"
    return f"<{token:02X}>"


_DISPLAY = [display(t) for t in range(VOCAB_SIZE)]


def pieces(ids: Sequence[int]) -> list[str]:
    """Display form of each token in context: the bytes of a complete multi-byte character are shown as
    '<E4 1/3 中>', '<B8 2/3 中>', '<AD 3/3 中>' so every token stays visible and the character is readable."""
    ids = check_ids(ids)
    out = [_DISPLAY[t] for t in ids]
    if max(ids, default=0) < 0x80:  # ASCII: every token is its own character
        return out
    i = 0
    while i < len(ids):
        role, length = _utf8_role(ids[i])
        chunk = bytes(ids[i:i + length])
        try:
            char = chunk.decode("utf-8") if role == "lead" and len(chunk) == length else None
        except UnicodeDecodeError:
            char = None
        if char is None:
            i += 1
            continue
        for k in range(length):
            out[i + k] = f"<{ids[i + k]:02X} {k + 1}/{length} {char}>"
        i += length
    return out
