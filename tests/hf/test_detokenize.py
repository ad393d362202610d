"""Incremental detokenization against the tokenizers library's decode of the whole sequence, for each kind of
tokenizer served models use (SentencePiece with byte fallback, with and without Llama-2's <s> post-processor,
ByteLevel, WordPiece) and non-ASCII text: a completion's pieces add up to
decode(prompt + completion)[len(decode(prompt)):] (special tokens skipped, as the worker does), none is half a
character, and none is taken back, however long a run of byte pieces and wherever the prompt ends (inside a
character included).  Token strings (OpenAI's logprobs) follow OpenAI's rule: a token's text as the tokenizer
decodes it in place, `bytes:\\xNN` only for a token whose bytes are not whole characters on their own."""

import string

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from service.tokenizer import HFTokenizer
from tests.hf.tokenizer_kinds import KINDS, tokenizer_json

PROMPTS = ["Hello", "The quick brown fox", "中文 and ", "naïve café: ", "x"]
COMPLETIONS = [" world there", " jumps over the lazy dog 🙂.", "漢字 mixed with text", "reve", " don't stop.\n\n  ok"]
FALLBACK = ["sentencepiece", "sentencepiece-bos"]  # byte-fallback kinds: characters outside the vocabulary are bytes
GREEK, CJK, EMOJI = "αβγδεζηθικλμνξοπρστυφχψω", "中文漢字日本語龍鳳", "🙂🎉👍🏽🚀"
ASCII = string.ascii_letters + string.digits + " .,;:'-!\n\t"
WIDE = "éüßñ" + GREEK + CJK + EMOJI + "\u0301\ufffd"  # a combining accent and U+FFFD itself are text too
QUICK = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


class Kind(tuple):
    """(name, the worker's HFTokenizer, the tokenizers library's Tokenizer), shown by name in failures."""

    def __repr__(self):
        return self[0]


def load(name, folder):
    path = folder / "tokenizer.json"
    path.write_text(tokenizer_json(name))
    return HFTokenizer(path), Tokenizer.from_file(str(path))


@pytest.fixture(scope="module", params=KINDS)
def kind(request, tmp_path_factory):
    return Kind((request.param, *load(request.param, tmp_path_factory.mktemp("tok"))))


@pytest.fixture(scope="module", params=FALLBACK)
def fallback(request, tmp_path_factory):
    return Kind((request.param, *load(request.param, tmp_path_factory.mktemp("tok"))))


def stream(served, prompt, completion):
    detok = served.detokenizer(prompt)
    pieces = [detok.push(t)[0] for t in completion]
    return pieces, detok.flush()


def reference(ref, prompt, completion) -> str:
    """The completion's text by definition: the whole decode less the prompt's (skip_special_tokens, as served)."""
    whole = ref.decode(prompt + completion, skip_special_tokens=True)
    return whole[len(ref.decode(prompt, skip_special_tokens=True)):]


def check(served, ref, prompt, completion):
    """Streamed text is the whole decode's, and every piece is whole characters of it: what has gone out is
    always a beginning of the final text (no U+FFFD where the whole decode has a character, nothing taken back)."""
    pieces, rest = stream(served, prompt, completion)
    want = reference(ref, prompt, completion)
    out = ""
    for piece in pieces:
        out += piece
        assert want.startswith(out), (out, want)
    assert out + rest == want
    return pieces


def test_text_completions_add_up_to_the_whole_decode(kind):
    name, served, ref = kind
    for p in PROMPTS:
        for c in COMPLETIONS:
            ids = ref.encode(p + c).ids
            cut = len(ref.encode(p).ids)
            check(served, ref, ids[:cut], ids[cut:])


def test_sentencepiece_keeps_the_first_space_and_joins_byte_pieces(fallback):
    name, served, ref = fallback
    prompt, completion = ref.encode("Hello").ids, ref.encode("Hello world there").ids[len(ref.encode("Hello").ids):]
    pieces, rest = stream(served, prompt, completion)
    assert "".join(pieces) + rest == " world there"
    ids = ref.encode("a reve 中").ids
    assert "<0xE4>" in [ref.id_to_token(i) for i in ids]
    k = next(k for k in range(1, len(ids)) if ref.decode(ids[:k], skip_special_tokens=True) == "a")
    pieces, rest = stream(served, ids[:k], ids[k:])
    assert "".join(pieces) + rest == " reve 中" and "\ufffd" not in "".join(pieces)


def run_length(served, ids) -> int:
    """The longest run of consecutive byte pieces in ids."""
    best = n = 0
    for t in ids:
        n = n + 1 if t in served.byte_pieces else 0
        best = max(best, n)
    return best


@pytest.mark.parametrize("text", [GREEK * 3, CJK * 6, EMOJI * 8, (GREEK[:5] + CJK[:3] + EMOJI[:2]) * 6],
                         ids=["greek", "cjk", "emoji", "mixed"])
def test_long_byte_runs_come_out_whole(fallback, text):
    """Runs of 100+ byte pieces (two-, three- and four-byte characters, and mixed) after a prompt, ended by a word
    or by the end of the stream: their text is the whole decode's, and it streams (text goes out while the run
    goes on, in whole characters)."""
    name, served, ref = fallback
    for prompt, tail in [("a ", " ok"), ("a ", ""), ("", " ok"), ("Hello 中", ".")]:
        ids = ref.encode(prompt + text + tail).ids
        cut = len(ref.encode(prompt).ids) if prompt else 0
        assert ids[:cut] == ref.encode(prompt).ids[:cut]
        assert run_length(served, ids[cut:]) >= 100
        pieces = check(served, ref, ids[:cut], ids[cut:])
        run_end = max(i for i, t in enumerate(ids[cut:]) if t in served.byte_pieces)
        assert "".join(pieces[:run_end]), "nothing went out before a 100-piece run ended"


def test_the_audit_cases(fallback):
    """Issue 31's figures: "a " then 24 Greek letters and " ok" (48 byte pieces), 10 emoji (40), and a prompt
    that ends inside a run of byte pieces ("a 🙂🙂" then "🙂")."""
    name, served, ref = fallback
    for prompt, completion in [("a ", GREEK + " ok"), ("a ", "🙂" * 10 + " ok"), ("a 🙂🙂", "🙂")]:
        head, ids = ref.encode(prompt).ids, ref.encode(prompt + completion).ids
        assert ids[:len(head)] == head
        pieces, rest = stream(served, head, ids[len(head):])
        assert "".join(pieces) + rest == completion


def test_every_prompt_end_inside_a_byte_run(kind):
    """The prompt ends at every token of a text full of multi-byte characters: between byte pieces of one
    character, between characters of a long run, at a run's end.  The window is primed from where a character
    starts (for a byte-fallback run that is not whole UTF-8, the run's start), so each completion is the whole
    decode's."""
    name, served, ref = kind
    ids = ref.encode("a " + "🙂" * 30 + GREEK + " x " + CJK * 4 + "é ok").ids
    for cut in range(len(ids)):
        check(served, ref, ids[:cut], ids[cut:])


texts = st.lists(st.one_of(st.text(alphabet=ASCII, max_size=12), st.text(alphabet=WIDE, min_size=1, max_size=60)),
                 max_size=6).map("".join)


@QUICK
@given(text=texts, data=st.data())
def test_any_text_cut_anywhere(kind, text, data):
    """Property: any text of words and runs of non-ASCII characters (up to 240 byte pieces), split into prompt
    and completion at any token."""
    name, served, ref = kind
    ids = ref.encode(text).ids
    cut = data.draw(st.integers(0, len(ids)))
    check(served, ref, ids[:cut], ids[cut:])


def settled(ref, ids, cut) -> bool:
    """Whether the whole decode keeps every earlier text: no prefix's text (less an unfinished character) is
    changed by what follows.  Byte-fallback decoding is lossy where it is not: bytes that join no character turn
    the whole run into U+FFFD, text decoded earlier included, and no incremental decoder can take text back."""
    whole = ref.decode(ids, skip_special_tokens=True)
    return all(whole.startswith(ref.decode(ids[:n], skip_special_tokens=True).rstrip("\ufffd"))
               for n in range(cut, len(ids)))


@QUICK
@given(data=st.data())
def test_any_ids_add_up_to_the_whole_decode(kind, data):
    """Property: any ids (byte pieces cut mid-character, runs of up to 200 of them, special tokens, runs of
    continuations), cut anywhere, wherever the whole decode keeps its earlier text."""
    name, served, ref = kind
    vocab = ref.get_vocab_size()
    pieces = sorted(served.byte_pieces) or list(range(vocab))
    ids = data.draw(st.lists(st.one_of(st.sampled_from(pieces), st.integers(0, vocab - 1)), min_size=1, max_size=200))
    cut = data.draw(st.integers(0, len(ids)))
    if settled(ref, ids, cut):
        check(served, ref, ids[:cut], ids[cut:])


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


def test_byte_fallback_runs_come_out_whole(fallback):
    """A byte-fallback decoder decodes a run of byte pieces at once (all U+FFFD when the run is not UTF-8, ASCII
    bytes included): the run's text is held until it ends, so streamed text equals the whole decode even then,
    wherever the prompt ends (inside the run included)."""
    name, served, ref = fallback
    byte_ids = sorted(served.byte_pieces)
    assert len(byte_ids) == 256
    rng = np.random.default_rng(7)
    for _ in range(300):
        ids = [int(rng.choice(byte_ids)) if rng.random() < 0.6 else int(rng.integers(259, ref.get_vocab_size()))
               for _ in range(rng.integers(2, 30))]
        check(served, ref, ids[:(cut := int(rng.integers(1, len(ids))))], ids[cut:])
    ids = ref.encode("x-中").ids
    run = [ref.token_to_id("<0x2D>"), ref.token_to_id("<0xE4>"), ref.token_to_id("<0x41>")]  # '-', a lone lead
    pieces, rest = stream(served, ids[:-3], run + ids[-1:])
    assert "".join(pieces) + rest == reference(ref, ids[:-3], run + ids[-1:])
    assert "-" not in "".join(pieces) + rest  # the whole run is U+FFFD, the '-' with it


# --- OpenAI's token strings --------------------------------------------------------------------------------

def own_bytes(ref, token) -> bytes:
    """A token's bytes read from its vocabulary entry: a byte piece's byte, a ByteLevel piece through GPT-2's
    byte alphabet (transformers' table), a SentencePiece piece with ▁ as a space."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    piece = ref.id_to_token(token)
    if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
        return bytes((int(piece[3:5], 16),))
    if "Ġ" in ref.get_vocab():  # ByteLevel
        table = {c: b for b, c in bytes_to_unicode().items()}
        return bytes(table[c] for c in piece)
    return piece.replace("▁", " ").encode()


def token_string(ref, special, ids, i) -> str:
    """OpenAI's string for ids[i] after ids[:i], by definition: a special token's content; a token whose bytes
    are not whole characters on their own as bytes:\\xNN; a byte piece that is a character, that character;
    else its text as the whole decode places it (what it adds, when neither the text before nor the text with
    it ends in an unfinished character), and its own text where the decode does not separate it."""
    token = ids[i]
    if token in special:
        return ref.id_to_token(token)
    raw = own_bytes(ref, token)
    try:
        own = raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
    if ref.id_to_token(token).startswith("<0x"):
        return own
    before = ref.decode(ids[:i], skip_special_tokens=True)
    after = ref.decode(ids[:i + 1], skip_special_tokens=True)
    if not before.endswith("\ufffd") and not after.endswith("\ufffd") and after.startswith(before):
        return after[len(before):]
    return own


def test_openai_token_strings_after_bos_and_byte_pieces(tmp_path):
    """Issue 31: a ▁ right after <s> (the decoder drops that first space: it adds no text) and a whole character
    after byte pieces were written bytes:\\x20 and bytes:\\x65; only a byte of an unfinished character is."""
    served, ref = load("sentencepiece-bos", tmp_path)
    ids = ref.encode("中e a").ids
    assert [ref.id_to_token(t) for t in ids] == ["<s>", "▁", "<0xE4>", "<0xB8>", "<0xAD>", "e", "▁a"]
    detok = served.detokenizer()  # an echoed prompt: from its first token
    out = [detok.push(t) for t in ids]
    assert [s for _, s in out] == ["<s>", "", "bytes:\\xe4", "bytes:\\xb8", "bytes:\\xad", "e", " a"]
    assert "".join(d for d, _ in out) + detok.flush() == "中e a"


@QUICK
@given(text=texts, data=st.data())
def test_token_strings_and_candidates(kind, text, data):
    """Property: each token's string and each candidate's (peek) follow OpenAI's rule against the whole decode,
    and a candidate is written exactly as the same token is when it comes (lm-eval's is_greedy compares them)."""
    name, served, ref = kind
    special = {t for t in range(ref.get_vocab_size()) if t in served.special}
    ids = ref.encode(text).ids
    cut = data.draw(st.integers(0, len(ids)))
    others = data.draw(st.lists(st.integers(0, ref.get_vocab_size() - 1), min_size=2, max_size=2))
    detok = served.detokenizer(ids[:cut])
    for i in range(cut, len(ids)):
        for c in others:
            assert detok.peek(c) == token_string(ref, special, ids[:i] + [c], i)
        peeked = detok.peek(ids[i])
        assert detok.push(ids[i])[1] == peeked == token_string(ref, special, ids, i)
