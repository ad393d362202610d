"""The artifact's own tokenizer in the worker: posenc's byte-level UTF-8 one, or a Hugging Face tokenizer.json
(the `tokenizers` library: Rust, no torch, no transformers).  Every front takes ids, pieces and text from here, so
a model's answers always use the tokenizer it was trained with.

model.json's "tokenizer" says which: {"type": "bytes-utf8", "vocab_size": 256} or
{"type": "huggingface-tokenizers", "file": "tokenizer.json", "vocab_size": N, ...}.  The model's vocabulary is its
embedding rows, which may exceed the tokenizer's (ids past it are valid, and decode to nothing).
"""

from __future__ import annotations

import codecs
import json
import re
from collections.abc import Callable, Sequence
from pathlib import Path

from model import tokenizer as byte_tokenizer
from service.errors import ArtifactRejected
from service.model_json import TokenizerEntry

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

    def token_bytes(self, token: int) -> bytes:
        return bytes((token,))

    def detokenizer(self, context: Sequence[int] = ()) -> Detokenizer:
        # ids from the model: no per-id check needed; a byte's text never depends on the bytes before it
        return Detokenizer(_utf8, self.token_bytes, context, alone=_BYTE_TOKENS.__getitem__)


class HFTokenizer:
    kind = HF

    def __init__(self, path: Path):
        from tokenizers import Tokenizer  # lazy: byte-level models need no tokenizers (it adds 5.8 MB RSS, measured)

        try:
            self.tok = Tokenizer.from_file(str(path))
        except Exception as err:  # the library's own parse error: the file is not a tokenizer.json
            raise ArtifactRejected(f"{path} is not a tokenizer.json the tokenizers library can read: {err}") from None
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)
        self._alone: dict[int, str] = {}  # alone()'s answers, each computed once
        self._kinds()

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text).ids  # the tokenizer's own special tokens, as Hugging Face's call adds them

    def decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode([i for i in ids if i < self.vocab_size], skip_special_tokens=False)

    def _kinds(self) -> None:
        """How this tokenizer.json writes a token's bytes (read from the file: model and decoder kinds)."""
        spec = json.loads(self.tok.to_str())
        decoders = [spec.get("decoder") or {}]
        while any(d.get("type") == "Sequence" for d in decoders):
            decoders = [x for d in decoders for x in (d.get("decoders") or [] if d.get("type") == "Sequence" else [d])]
        kinds = {d.get("type") for d in decoders}
        # ByteLevel alone joins the tokens' bytes and decodes them: after text that ends where a character ends, a
        # token adds what its own bytes decode to, whatever came before
        self.context_free = [d.get("type") for d in decoders] == ["ByteLevel"]
        self.byte_level = "ByteLevel" in kinds
        self.metaspace = "Metaspace" in kinds or any(d.get("type") == "Replace" and
                                                    (d.get("pattern") or {}).get("String") == "\u2581"
                                                    for d in decoders)
        self.byte_fallback = bool((spec.get("model") or {}).get("byte_fallback")) or "ByteFallback" in kinds
        self.wordpiece = "WordPiece" in kinds
        self.added: dict[int, str] = {t["id"]: t["content"] for t in spec.get("added_tokens") or []}
        self.special = frozenset(t["id"] for t in spec.get("added_tokens") or [] if t.get("special"))
        vocab = (spec.get("model") or {}).get("vocab")
        self.byte_pieces = frozenset(i for p, i in vocab.items() if _BYTE_PIECE.fullmatch(p)) \
            if self.byte_fallback and isinstance(vocab, dict) else frozenset()

    def token_bytes(self, token: int) -> bytes:
        """The bytes this token stands for, before a decoder joins them (a ByteLevel token's bytes, a
        byte-fallback token's one byte, a SentencePiece piece with its leading space)."""
        if token >= self.vocab_size:
            return b""
        if token in self.added:
            return self.added[token].encode()
        piece: str = self.tok.id_to_token(token) or ""
        if self.byte_fallback and (m := _BYTE_PIECE.fullmatch(piece)):
            return bytes((int(m.group(1), 16),))
        if self.byte_level:
            return bytes(_UNICODE_TO_BYTE.get(c, 0x3F) for c in piece)
        if self.metaspace:
            return piece.replace("\u2581", " ").encode()
        if self.wordpiece:
            return piece[2:].encode() if piece.startswith("##") else f" {piece}".encode()
        return self.tok.decode([token], skip_special_tokens=False).encode()

    def display(self, token: int) -> str:
        """The token as people read it: its text with a leading space shown as ␠, whitespace escaped, a byte that
        is not text by itself (part of a character, a control byte) named in hex."""
        if token >= self.vocab_size:
            return f"<id {token}>"
        return visible(self.token_bytes(token)) or f"<id {token}>"

    def pieces(self, ids: Sequence[int]) -> list[str]:
        return [self.display(t) for t in ids]

    def text_bytes(self, ids: Sequence[int]) -> int:
        return len(self.decode(ids).encode("utf-8"))

    def text(self, ids: Sequence[int]) -> str:
        """A completion's text: special tokens (<s>, <unk>, an end of sequence run past) are not text, as in
        transformers' and vLLM's skip_special_tokens."""
        return self.tok.decode([i for i in ids if i < self.vocab_size], skip_special_tokens=True)

    def alone(self, token: int) -> str:
        """A token as OpenAI's logprobs write it after text that ends cleanly, where no earlier token changes it
        (context_free): what Detokenizer.peek would decode, once per token."""
        piece = self._alone.get(token)
        if piece is None:
            text = self.text([token])
            piece = self._alone[token] = openai_token(self.token_bytes(token),
                                                      None if text.endswith("\ufffd") else text)
        return piece

    def detokenizer(self, context: Sequence[int] = ()) -> Detokenizer:
        return Detokenizer(self.text, self.token_bytes, context, self.byte_pieces, self.special, self.vocab_size,
                           self.alone if self.context_free else None)


_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_ESCAPES = {"\n": "\\n", "\t": "\\t", "\r": "\\r"}


def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's ByteLevel alphabet: printable Latin-1 bytes stand for themselves, the other 68 bytes for the code
    points from U+0100 on, in byte order."""
    keep = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(0x100 + extra)
            extra += 1
    return table


_UNICODE_TO_BYTE = {c: b for b, c in _byte_to_unicode().items()}


def visible(raw: bytes) -> str:
    """Bytes as a readable chip: valid UTF-8 text with its leading spaces as ␠ and whitespace escaped; anything
    else (part of a character, control bytes) as <XX> per byte."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return "".join(f"<{b:02X}>" for b in raw)
    out = []
    lead = True
    for ch in text:
        if ch == " " and lead:
            out.append("␠")
            continue
        lead = False
        if ch in _ESCAPES:
            out.append(_ESCAPES[ch])
        elif not ch.isprintable() and ch != " ":
            out.append("".join(f"<{b:02X}>" for b in ch.encode()))
        else:
            out.append(ch)
    return "".join(out)


def openai_token(raw: bytes, text: str | None = None) -> str:
    """A token as OpenAI's logprobs write it: `text`, what it adds in place when that is known (a first piece's
    space the decoder drops adds ""); else its own bytes as text when they are whole characters, `bytes:\\xNN...`
    when they are part of one."""
    if text is not None:
        return text
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


class Detokenizer:
    """The text a completion adds, one token at a time, right for any tokenizer (ByteLevel, SentencePiece with
    byte fallback, WordPiece): the concatenation of what push() returns, then flush(), equals
    decode(context + tokens)[len(decode(context)):].

    It decodes a window: the last tokens already turned into text (at first the prompt's last CONTEXT or more, from
    where a character starts) and the new ones, and emits the characters past those it has sent.  A decoder that
    joins tokens with context (a SentencePiece piece's space, a WordPiece continuation) treats the window's first
    token alike in every decode, so the difference is what the new tokens add.  While the text ends in U+FFFD (a
    character whose remaining bytes have not come yet) that last character waits; after HOLD such tokens the
    window slides anyway, so bytes that never make a character cost no more than any other token.  A byte-fallback
    decoder turns a whole run of byte pieces into text at once (U+FFFD for each byte when the run is not UTF-8), so
    a run is held undecoded, at no cost per piece, until it ends, or past RUN pieces until one ends a character of
    a run that is UTF-8 so far.  flush() gives the rest at the end."""

    CONTEXT = 6
    HOLD = 4  # a UTF-8 character has at most 4 bytes: the last 4 tokens hold any unfinished one
    RUN = 32  # byte-fallback pieces held back before a run's text goes out where a character ends

    def __init__(self, decode: Callable[[Sequence[int]], str], raw: Callable[[int], bytes],
                 context: Sequence[int] = (), byte_pieces: frozenset[int] = frozenset(),
                 special: frozenset[int] = frozenset(), size: int | None = None,
                 alone: Callable[[int], str] | None = None):
        self.decode, self.raw, self.byte_pieces, self.special, self.size = decode, raw, byte_pieces, special, size
        self.alone = alone  # peek's answer after a clean end, where it never depends on the window (a byte's)
        self.utf8 = codecs.getincrementaldecoder("utf-8")()  # the current byte-fallback run, checked as it grows
        self.bad = False  # the current run is not UTF-8: its text is a U+FFFD per byte, whatever follows
        ids = [i for i in context if not self._silent(i)]
        self.ids = ids[self._start(ids, max(len(ids) - self.CONTEXT, 0)):]
        self.read = len(self.ids)  # ids[read:] came after the last clean end (their text may still change)
        self.sent = len(self.decode(self.ids))  # characters of decode(ids) already given out (or the context's)
        self.owed = 0  # characters of the text still to skip: the context's decode counted them
        run = len(self.ids)
        while run and self.ids[run - 1] in self.byte_pieces:
            run -= 1
        for t in self.ids[run:]:  # the context ends in a run of byte pieces, which the completion may go on
            self._feed(t)
        if self.bad or self.utf8.getstate()[0]:  # a run not whole UTF-8: its text changes as it goes on (decoded
            # as a U+FFFD per byte, as many characters the completion's text skips): held from its start
            self.read, sent = run, len(self.decode(self.ids[:run]))
            self.sent, self.owed = sent, self.sent - sent
        elif not self.byte_pieces and self.ids and self.decode(self.ids).endswith("\ufffd"):
            self.read -= 1  # an unfinished character: the next token's text is not its own alone

    def _silent(self, token: int) -> bool:
        """No text (skip_special_tokens; ids past the tokenizer's vocabulary): never in the window."""
        return token in self.special or (self.size is not None and token >= self.size)

    def _start(self, ids: list[int], at: int) -> int:
        """Where a window over ids may start, at or before `at`: a token that starts a character, and in a
        byte-fallback run that is not whole UTF-8 (decoded as a U+FFFD per byte), the run's first piece."""
        while at and self._inside(ids[at]):
            at -= 1
        if at and ids[at] in self.byte_pieces and ids[at - 1] in self.byte_pieces:
            first = end = at
            while first and ids[first - 1] in self.byte_pieces:
                first -= 1
            while end < len(ids) and ids[end] in self.byte_pieces:
                end += 1
            try:
                b"".join(self.raw(t) for t in ids[first:end]).decode("utf-8")
            except UnicodeDecodeError:
                return first
        return at

    def _inside(self, token: int) -> bool:
        """Whether the token's bytes start inside a character (a UTF-8 continuation byte), or it has none."""
        raw = self.raw(token)
        return not raw or 0x80 <= raw[0] < 0xC0

    def _feed(self, token: int) -> bool:
        """Add a byte piece to the current run: whether the run is UTF-8 so far and ends where a character ends."""
        if not self.bad:
            try:
                self.utf8.decode(self.raw(token))
            except UnicodeDecodeError:
                self.bad = True
        return not self.bad and not self.utf8.getstate()[0]

    def _out(self, new: str) -> str:
        """The part of the window's new text that goes out (past what the context's decode counted)."""
        skip = min(self.owed, len(new))
        self.owed -= skip
        return new[skip:]

    def _clean(self, text: str) -> str:
        """The window's text ends cleanly: its new characters (what the last token adds in place, when the window
        was clean before it); the tokens since the last clean end start the next window."""
        new = text[self.sent:]
        self.ids = self.ids[self.read:]
        self.read, self.sent = len(self.ids), len(self.decode(self.ids))
        return new

    def push(self, token: int) -> tuple[str, str]:
        """(the text this token lets out, the token as OpenAI's logprobs write it: the same as peek(token))."""
        raw = self.raw(token)
        if self._silent(token):
            return "", raw.decode("utf-8", errors="replace")
        clean = self.read == len(self.ids)
        self.ids.append(token)
        if token in self.byte_pieces:
            if self._feed(token) and len(self.ids) - self.read > self.RUN:
                return self._out(self._clean(self.decode(self.ids))), openai_token(raw)
            return "", openai_token(raw)
        self.utf8.reset()
        self.bad = False
        text = self.decode(self.ids)
        if not text.endswith("\ufffd"):
            new = self._clean(text)
            return self._out(new), openai_token(raw, new if clean else None)
        if len(self.ids) - self.read > self.HOLD:  # only the last character may still change
            new = text[self.sent:-1]
            self.ids = self.ids[-self.HOLD:]
            self.read, self.sent = 0, len(self.decode(self.ids)) - 1
            return self._out(new), openai_token(raw)
        return "", openai_token(raw)

    def peek(self, token: int) -> str:
        """`token` as OpenAI's logprobs would write it if it came next (for top candidates)."""
        raw = self.raw(token)
        if self._silent(token):
            return raw.decode("utf-8", errors="replace")
        if token in self.byte_pieces or self.read < len(self.ids):
            return openai_token(raw)
        if self.alone is not None:
            return self.alone(token)
        text = self.decode(self.ids + [token])
        return openai_token(raw, None if text.endswith("\ufffd") else text[self.sent:])

    def flush(self) -> str:
        """The held-back rest (an unfinished character shows as U+FFFD, as decoding everything does)."""
        rest = self._out(self.decode(self.ids)[self.sent:])
        self.ids, self.read, self.sent, self.owed = [], 0, 0, 0
        self.utf8.reset()
        self.bad = False
        return rest


def _utf8(ids: Sequence[int]) -> str:
    return bytes(ids).decode("utf-8", errors="replace")


# each byte as peek() writes it after a clean end: ASCII is its character, any other byte part of one
_BYTE_TOKENS = [openai_token(bytes((b,)), None if _utf8([b]).endswith("\ufffd") else _utf8([b])) for b in range(256)]


Tokenizer = ByteTokenizer | HFTokenizer  # what an artifact's model.json names


def for_artifact(folder: Path, spec: TokenizerEntry, rows: int) -> Tokenizer:
    """The tokenizer model.json's entry names (`rows`: the model's embedding rows, its vocabulary size)."""
    if spec.type == BYTES:
        return ByteTokenizer()
    if spec.type == HF:
        name = spec.file
        if not name or Path(name).name != name or not (folder / name).is_file():
            raise ArtifactRejected(f"model.json names tokenizer file {name!r}, which {folder} does not hold")
        tok = HFTokenizer(folder / name)
        if tok.vocab_size > rows:
            raise ArtifactRejected(f"{folder / name} has {tok.vocab_size} tokens, more than the model's {rows} "
                                   "embedding rows")
        return tok
    raise ArtifactRejected(f"model.json's tokenizer type {spec.type!r} is not one the worker knows ({BYTES}, {HF})")
