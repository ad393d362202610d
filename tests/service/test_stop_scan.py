"""Stop strings found incrementally (service.generation.StopScan) give the answers of a naive search over the whole
text after every delta: where the first stop string starts, and how much of the text a stream may show (the text
cut there; mid-stream, without a tail that may yet become one).  The decode loop's Generation ends on the token that
completes the first stop string, and a completion's streamed text (service.http.completion.Completion) is the naive
cut, whatever the deltas.  A stop string longer than MAX_STOP_LENGTH characters is refused naming `stop`."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from service.errors import InvalidArgument
from service.generation import Emitted, Generation, StopScan
from service.http.completion import Completion
from service.sampling import MAX_STOP_LENGTH, SamplingParams

# a small alphabet makes stop strings, their overlaps and their partial matches common; "é" and "中" are characters
# that are more than one byte in UTF-8 (the scan counts characters)
TEXT = st.text(alphabet="abcé中", max_size=6)
STOPS = st.lists(st.text(alphabet="abcé中", min_size=1, max_size=6), min_size=1, max_size=5)
DELTAS = st.lists(TEXT, max_size=25)
PROPERTY = settings(max_examples=600, deadline=None)


def naive_cut(text: str, stops: list[str]) -> int | None:
    """Where the first stop string in the text starts: every stop string searched in the whole text."""
    cuts = [text.find(s) for s in stops if s in text]
    return min(cuts) if cuts else None


def naive_end(text: str, stops: list[str], final: bool) -> int:
    """How much of the text a client may see: up to the first stop string; mid-stream, less the longest tail
    that is the start of a stop string (every stop string, every length)."""
    cut = naive_cut(text, stops)
    if cut is not None:
        return cut
    if final:
        return len(text)
    held = max((k for s in stops for k in range(1, min(len(s) - 1, len(text)) + 1) if text.endswith(s[:k])),
               default=0)
    return len(text) - held


@PROPERTY
@given(stops=st.lists(st.text(alphabet="abcé中", max_size=6), min_size=1, max_size=5), deltas=DELTAS)
@example(stops=["ab", "xyzab"], deltas=["xyza", "b"])  # the longest held tail is xyzab's, not the first stop's
@example(stops=["bcd", "abcde"], deltas=["abcde"])  # the first to start, not the first to end
@example(stops=["bc", "abcX"], deltas=["ab", "c", "X"])  # an earlier start completed after the first cut
@example(stops=["aab"], deltas=["a", "a", "a", "a", "b"])  # a partial match that falls back (KMP's table)
@example(stops=[""], deltas=["a"])  # an empty stop string is at 0 (posenc.v1 Generate takes one)
@example(stops=["\\", "^x", "a-c", "]"], deltas=["a-", "b]", "^x\\"])  # a regex's own characters are characters
@example(stops=["^"], deltas=["a^"])
@example(stops=["ab", "ab"], deltas=["a", "b"])  # the same string twice
def test_the_incremental_scan_equals_a_naive_search_of_the_whole_text(stops, deltas):
    scan, text = StopScan(stops), ""
    assert scan.end(final=False) == naive_end(text, stops, False)
    for delta in deltas:
        text += delta
        assert scan.feed(delta) == scan.cut == naive_cut(text, stops), (text, stops)
        assert scan.length == len(text)
        assert scan.end(final=False) == naive_end(text, stops, False), (text, stops)
        assert scan.end(final=True) == naive_end(text, stops, True), (text, stops)


class Deltas:
    """A Detokenizer whose token i lets out deltas[i] (Generation only pushes, peeks and flushes)."""

    def __init__(self, deltas: list[str]):
        self.deltas = deltas

    def push(self, token: int) -> tuple[str, str]:
        return self.deltas[token], self.deltas[token]

    def peek(self, token: int) -> str:
        return self.deltas[token]

    def flush(self) -> str:
        return ""

    def raw(self, token: int) -> bytes:
        return self.deltas[token].encode()


def generated(stops: list[str], deltas: list[str]) -> list[Emitted]:
    """The tokens a Generation emits when its i-th token writes deltas[i], until it finishes."""
    params = SamplingParams(max_new_tokens=len(deltas), stop=tuple(stops))
    gen = Generation([0], params, Deltas(deltas))  # type: ignore[arg-type]
    out = []
    for i in range(len(deltas)):
        out.append(gen.emit(i, 0.0, []))
        if gen.done:
            break
    return out


@PROPERTY
@given(stops=STOPS, deltas=st.lists(TEXT, min_size=1, max_size=25))
def test_a_generation_ends_on_the_token_that_completes_the_first_stop_string(stops, deltas):
    items = generated(stops, deltas)
    ends = next((i for i in range(len(deltas)) if deltas[i] and naive_cut("".join(deltas[:i + 1]), stops)
                 is not None), None)
    assert len(items) == (len(deltas) if ends is None else ends + 1)
    assert items[-1].reason == ("length" if ends is None else "stop")
    assert items[-1].text == "".join(deltas[:len(items)])


def completion(stops: list[str]) -> Completion:
    """A choice of a completion with these stop strings, as service.http.completion.events makes it."""
    gen = SimpleNamespace(params=SamplingParams(stop=tuple(stops)), prompt=[0], eos=frozenset())
    return Completion(0, gen, SimpleNamespace(token_bytes=lambda token: b""))  # type: ignore[arg-type]


@PROPERTY
@given(stops=STOPS, deltas=st.lists(TEXT, min_size=1, max_size=25))
@example(stops=["ab", "xyzab"], deltas=["xyza", "b"])
@example(stops=["中", "a中中"], deltas=["a中", "中"])  # ends at the first cut: "a中中" never completes
def test_a_streamed_completion_shows_the_naive_cut_after_every_token(stops, deltas):
    """Each token's delta as the decode loop emits them: the token that completes the first stop string is the last
    (the test above), with reason "stop"; the last of all with "length"."""
    c, text, shown = completion(stops), "", ""
    for i, delta in enumerate(deltas):
        text += delta
        reason = "stop" if naive_cut(text, stops) is not None else "length" if i == len(deltas) - 1 else ""
        new, _ = c.take(Emitted(i, None, text, reason, delta, delta, []))
        shown += new
        assert shown == c.shown == text[:naive_end(text, stops, bool(reason))], (text, stops)
        if reason:
            break
    assert c.choice().text == shown


def test_a_stop_string_past_the_limit_is_refused_naming_stop():
    check = dict(max_new_tokens=32, max_stop=16, max_logprobs=5, vocab=256)
    SamplingParams(stop=("x" * MAX_STOP_LENGTH, "中" * MAX_STOP_LENGTH)).check(**check)
    with pytest.raises(InvalidArgument, match=rf"stop strings may have at most {MAX_STOP_LENGTH} characters "
                                              rf"each; stop\[1\] has {MAX_STOP_LENGTH + 1}") as err:
        SamplingParams(stop=("x", "中" * (MAX_STOP_LENGTH + 1))).check(**check)
    assert err.value.param == "stop"


def test_a_long_never_matching_stop_costs_nothing_per_token_until_its_first_character():
    """A delta without a stop string's first character skips it in one C-speed search (no per-character loop):
    the KMP table is made only at a stop string's first mismatch after a partial match."""
    scan = StopScan([chr(0x4E00 + i) * MAX_STOP_LENGTH for i in range(16)])
    for _ in range(1000):
        scan.feed("abc ")
    assert scan.cut is None and scan.held == 0 and all(b is None for b in scan.border)
    scan.feed("一一一")
    assert scan.held == 3 and scan.end(final=False) == 4000
    scan.feed("a")
    assert scan.held == 0 and scan.cut is None and sum(b is not None for b in scan.border) == 1

