"""Incremental detokenization against the tokenizers library's decode of the whole sequence, for each kind of
tokenizer served models use (SentencePiece with byte fallback, ByteLevel, WordPiece) and non-ASCII text: a
completion's pieces add up to decode(prompt + completion)[len(decode(prompt)):], and none is half a character."""

import numpy as np
import pytest
from tokenizers import Tokenizer

from service.tokenizer import HFTokenizer
from tests.hf.tokenizer_kinds import KINDS, tokenizer_json

PROMPTS = ["Hello", "The quick brown fox", "中文 and ", "naïve café: ", "x"]
COMPLETIONS = [" world there", " jumps over the lazy dog 🙂.", "漢字 mixed with text", "reve", " don't stop.\n\n  ok"]


@pytest.fixture(scope="module", params=KINDS)
def kind(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    path.write_text(tokenizer_json(request.param))
    return request.param, HFTokenizer(path), Tokenizer.from_file(str(path))


def stream(served, prompt, completion):
    detok = served.detokenizer(prompt)
    pieces = [detok.push(t)[0] for t in completion]
    return pieces, detok.flush()


def check(served, ref, prompt, completion):
    pieces, rest = stream(served, prompt, completion)
    whole = ref.decode(prompt + completion, skip_special_tokens=True)
    head = ref.decode(prompt, skip_special_tokens=True)
    want = whole[len(head):]
    assert "".join(pieces) + rest == want
    assert all(want.startswith("".join(pieces[:n])) for n in range(len(pieces)))  # nothing is taken back


def test_text_completions_add_up_to_the_whole_decode(kind):
    name, served, ref = kind
    for p in PROMPTS:
        for c in COMPLETIONS:
            ids = ref.encode(p + c).ids
            cut = len(ref.encode(p).ids)
            check(served, ref, ids[:cut], ids[cut:])


def test_sentencepiece_keeps_the_first_space_and_joins_byte_pieces(tmp_path):
    path = tmp_path / "tokenizer.json"
    path.write_text(tokenizer_json("sentencepiece"))
    served, ref = HFTokenizer(path), Tokenizer.from_file(str(path))
    prompt, completion = ref.encode("Hello").ids, ref.encode("Hello world there").ids[len(ref.encode("Hello").ids):]
    pieces, rest = stream(served, prompt, completion)
    assert "".join(pieces) + rest == " world there"
    ids = ref.encode("a reve 中").ids
    assert "<0xE4>" in [ref.id_to_token(i) for i in ids]
    k = next(k for k in range(1, len(ids)) if ref.decode(ids[:k]) == "a")
    pieces, rest = stream(served, ids[:k], ids[k:])
    assert "".join(pieces) + rest == " reve 中" and "\ufffd" not in "".join(pieces)


def settled(ref, ids, cut) -> bool:
    """Whether the whole decode keeps every earlier text: no prefix's text (less an unfinished character) is
    changed by what follows.  Byte-fallback decoding is lossy where it is not: bytes that join no character turn
    the whole run into U+FFFD, text decoded earlier included, and no incremental decoder can take text back."""
    whole = ref.decode(ids, skip_special_tokens=True)
    heads = [ref.decode(ids[:n], skip_special_tokens=True) for n in range(cut, len(ids))]
    return not heads[0].endswith("\ufffd") and all(whole.startswith(h.rstrip("\ufffd")) for h in heads)


def test_random_ids_add_up_to_the_whole_decode(kind):
    """Any ids (byte pieces cut mid-character, special tokens, runs of continuations)."""
    name, served, ref = kind
    rng = np.random.default_rng(3)
    vocab = ref.get_vocab_size()
    checked = 0
    for _ in range(300):
        ids = rng.integers(0, vocab, rng.integers(2, 30)).tolist()
        cut = int(rng.integers(1, len(ids)))
        if not settled(ref, ids, cut):
            continue
        check(served, ref, ids[:cut], ids[cut:])
        checked += 1
    assert checked >= 100


def test_openai_token_strings(kind):
    """logprobs.tokens: a token that completes text is that text; a byte of an unfinished character is bytes:\\xNN."""
    name, served, ref = kind
    ids = ref.encode("a 中").ids
    detok = served.detokenizer(ids[:1])
    out = [detok.push(t) for t in ids[1:]]
    assert "".join(d for d, _ in out) + detok.flush() == ref.decode(ids)[len(ref.decode(ids[:1])):]
    if name == "wordpiece":  # 中 is a whole token of its own there
        assert out[-1][1] == " 中"
    else:
        assert out[-3][1] == "bytes:\\xe4" or out[-2][1].startswith("bytes:\\x")


def test_byte_fallback_runs_come_out_whole(tmp_path):
    """A byte-fallback decoder decodes a run of byte pieces at once (all U+FFFD when the run is not UTF-8, ASCII
    bytes included): the run's text is held until it ends, so streamed text equals the whole decode even then."""
    path = tmp_path / "tokenizer.json"
    path.write_text(tokenizer_json("sentencepiece"))
    served, ref = HFTokenizer(path), Tokenizer.from_file(str(path))
    byte_ids = sorted(served.byte_pieces)
    assert len(byte_ids) == 256
    rng = np.random.default_rng(7)
    for _ in range(300):
        ids = [int(rng.choice(byte_ids)) if rng.random() < 0.6 else int(rng.integers(259, ref.get_vocab_size()))
               for _ in range(rng.integers(2, 30))]
        cut = int(rng.integers(1, len(ids)))
        if ids[cut - 1] in served.byte_pieces or ref.decode(ids[:cut]).endswith("\ufffd"):
            continue  # a run cut by the prompt's end is decoded apart there, whole here
        check(served, ref, ids[:cut], ids[cut:])
    ids = ref.encode("x-中").ids
    run = [ref.token_to_id("<0x2D>"), ref.token_to_id("<0xE4>"), ref.token_to_id("<0x41>")]  # '-', a lone lead
    pieces, rest = stream(served, ids[:1], run + ids[1:2])
    assert "".join(pieces) + rest == ref.decode(ids[:1] + run + ids[1:2])[len(ref.decode(ids[:1])):]
    assert "-" not in "".join(pieces) + rest  # the whole run is U+FFFD, the '-' with it
