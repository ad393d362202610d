"""Detokenizer.peek's shortcut for tokenizers whose token text never depends on the tokens before it (posenc's
bytes, a ByteLevel-only decoder): after text that ends cleanly a candidate is written from a per-model table
instead of a decode of the window, and it is the same string the decode gives, in every state a stream passes
through (random ids: parts of characters, special tokens, ids past the tokenizer's vocabulary)."""

import random

import pytest

from service.tokenizer import ByteTokenizer, Detokenizer, HFTokenizer, _utf8
from tests.hf.tokenizer_kinds import tokenizer_json


def decoded(tok):
    """The same tokenizer's Detokenizer without the shortcut: every peek decodes the window."""
    if isinstance(tok, ByteTokenizer):
        return lambda ids: Detokenizer(_utf8, tok.token_bytes, ids)
    return lambda ids: Detokenizer(tok.text, tok.token_bytes, ids, tok.byte_pieces, tok.special, tok.vocab_size)


@pytest.fixture(params=["bytes", "bytelevel", "sentencepiece-bos", "wordpiece"])
def tokenizer(request, tmp_path):
    if request.param == "bytes":
        return ByteTokenizer(), 256
    path = tmp_path / "tokenizer.json"
    path.write_text(tokenizer_json(request.param))
    tok = HFTokenizer(path)
    return tok, tok.vocab_size + 2  # ids past the tokenizer's vocabulary are the model's too


def test_peek_from_the_table_is_peek_from_the_decode(tokenizer):
    tok, rows = tokenizer
    assert (tok.detokenizer().alone is not None) == (isinstance(tok, ByteTokenizer) or tok.context_free)
    rng = random.Random(7)
    for _ in range(40):
        context = [rng.randrange(rows) for _ in range(rng.randrange(12))]
        fast, slow = tok.detokenizer(context), decoded(tok)(context)
        for _ in range(24):
            assert [fast.peek(t) for t in range(rows)] == [slow.peek(t) for t in range(rows)]
            t = rng.randrange(rows)
            assert fast.push(t) == slow.push(t)
        assert fast.flush() == slow.flush()


def test_only_a_byte_level_decoder_alone_takes_the_shortcut(tmp_path):
    kinds = {}
    for kind in ("bytelevel", "sentencepiece", "sentencepiece-bos", "wordpiece"):
        (tmp_path / kind).mkdir()
        (tmp_path / kind / "tokenizer.json").write_text(tokenizer_json(kind))
        kinds[kind] = HFTokenizer(tmp_path / kind / "tokenizer.json").context_free
    assert kinds == {"bytelevel": True, "sentencepiece": False, "sentencepiece-bos": False, "wordpiece": False}
