"""What OpenAI's completion logprobs should hold, from independent sources: log-probabilities from transformers'
own forward pass, and every token's text and offset from the `tokenizers` library's own decodes of each prefix
(never from posenc's incremental detokenizer). `keep` says whether the text keeps special tokens (the echo of token
ids) or skips them (a completion, a string prompt's echo)."""

from __future__ import annotations

import re

import torch

BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def forward_logprobs(model, ids: list[int]) -> torch.Tensor:
    """transformers' next-token log-probabilities at every position of ids (float64)."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0].double()
    return torch.log_softmax(logits, -1)


def greedy(model, ids: list[int], n: int) -> list[int]:
    """transformers' greedy continuation (no end of sequence)."""
    seq = list(ids)
    for _ in range(n):
        seq.append(int(forward_logprobs(model, seq)[-1].argmax()))
    return seq[len(ids):]


def special_ids(tok) -> set[int]:
    return {i for i, added in tok.get_added_tokens_decoder().items() if added.special}


def decode(tok, ids: list[int], keep: bool) -> str:
    return tok.decode(ids, skip_special_tokens=not keep)


def written(tok, prefix: list[int], token: int, keep: bool) -> str:
    """`token` as OpenAI's logprobs write it after `prefix`: the text it adds to the whole decode; a special token
    the text skips, its vocabulary entry; a byte piece where that is not text of its own (after part of a
    character, or part of one itself): its character when the byte is one (ASCII), else bytes:\\xNN."""
    if not keep and token in special_ids(tok):
        return tok.id_to_token(token)
    before, after = decode(tok, prefix, keep), decode(tok, prefix + [token], keep)
    if after.startswith(before) and "\ufffd" not in after[len(before):]:
        return after[len(before):]
    m = BYTE_PIECE.fullmatch(tok.id_to_token(token))
    assert m, f"{tok.id_to_token(token)!r} after {before!r} is neither text nor a byte"
    byte = int(m.group(1), 16)
    return chr(byte) if byte < 0x80 else f"bytes:\\x{byte:02x}"


def clean(tok, prefix: list[int], keep: bool) -> bool:
    """Whether the prefix decodes to whole characters (the next token's text is then its own)."""
    return not decode(tok, prefix, keep).endswith("\ufffd")


def top_written(tok, prefix: list[int], row: torch.Tensor, k: int, keep: bool) -> tuple[dict[str, float], bool]:
    """(OpenAI's top_logprobs for the k most likely tokens after prefix: one entry per text, the highest
    log-probability of the tokens that write it; whether two of the k write the same text)."""
    out: dict[str, float] = {}
    values, ids = torch.topk(row, k)
    texts = [written(tok, prefix, int(i), keep) for i in ids]
    for text, value in zip(texts, values.tolist(), strict=True):
        out[text] = max(out.get(text, -float("inf")), value)
    return out, len(set(texts)) < len(texts)


def starts(tok, ids: list[int], keep: bool, skip: int = 0) -> tuple[str, list[int]]:
    """(the text of ids[skip:]: the decode of ids less the decode of ids[:skip]; where each of those tokens starts
    in it).  A token starts where the text of the tokens before it ends: at the decode of the longest prefix before
    it that the whole decode begins with and that ends on a whole character (or whose U+FFFD every longer prefix
    keeps: bytes that make no character), so a token inside a character starts where that character does."""
    decs = [decode(tok, ids[:j], keep) for j in range(len(ids) + 1)]
    whole = decs[-1]

    def done(j: int) -> bool:
        return whole.startswith(decs[j]) and (not decs[j].endswith("\ufffd") or
                                              all(d.startswith(decs[j]) for d in decs[j:]))

    head = len(decs[skip])
    out, last = [], head
    for i in range(skip, len(ids)):
        if done(i):
            last = len(decs[i])
        out.append(last - head)
    return whole[head:], out


def check_offsets(tok, ids: list[int], text: str, tokens: list[str], offsets: list[int], keep: bool,
                  skip: int = 0, shift: int = 0) -> int:
    """Every token's offset (less `shift`, the text before ids[skip:]'s) is where starts() puts it, and a token that
    is whole characters is text[offset:offset + len(token)]; a special token the text skips is listed by name.
    Where the text holds U+FFFD (bytes that make no character) only the order is checked.  Returns the number of
    `bytes:` tokens checked exactly."""
    want_text, want = starts(tok, ids, keep, skip)
    assert text[shift:] == want_text
    special = special_ids(tok)
    exact = 0
    for i, (token, offset, at) in enumerate(zip(tokens, offsets, want, strict=True)):
        if at < len(want_text) and want_text[at] == "\ufffd":
            assert (offsets[i - 1] if i else shift) <= offset <= len(text), (i, token, offset)
            continue
        assert offset - shift == at, (i, token, offset - shift, at, want_text)
        tid = ids[skip + i]
        if not keep and tid in special:
            assert token == tok.id_to_token(tid)
        elif token.startswith("bytes:"):
            exact += 1
        else:
            assert text[offset:offset + len(token)] == token, (i, token, offset, text)
    return exact
