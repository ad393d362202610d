"""service.http.completion.coalesced: which of a stream's tokens one server-sent chunk carries.  Pure: stand-in
choices whose queue says how many tokens are already waiting (no worker, no timing)."""

from types import SimpleNamespace

import pytest

from service.http.completion import HELD, coalesced, extended


class Choice:
    """A Completion as coalesced reads it: its latest token (None before the first), its finish, its queue."""

    def __init__(self):
        self.last, self.finish = None, None
        self.waiting = 0
        self.gen = SimpleNamespace(out=SimpleNamespace(qsize=lambda: self.waiting))


def tokens(choice, steps):
    """The stream as service.http.completion.events gives it: the choice opening, then each token (text, waiting
    tokens behind it, last?) with one token's logprobs."""
    yield choice, "", None
    for i, (text, waiting, last) in enumerate(steps):
        choice.last, choice.waiting, choice.finish = i, waiting, "length" if last else None
        yield choice, text, {"tokens": [f"t{i}"], "text_offset": [i]}


def test_a_token_without_text_rides_with_the_next_one_that_has_text():
    c = Choice()
    out = list(coalesced(tokens(c, [("a", 0, False), ("", 0, False), ("", 0, False), ("é", 0, False),
                                    ("", 0, True)]), extended))
    assert [(text, lp and lp["tokens"]) for _, text, lp in out] == [
        ("", None), ("a", ["t0"]), ("é", ["t1", "t2", "t3"]), ("", ["t4"])]  # the choice's end sends what is left
    assert out[2][2]["text_offset"] == [1, 2, 3]


def test_tokens_already_waiting_go_in_one_chunk_up_to_held():
    c = Choice()
    steps = [("x", 3, False), ("y", 2, False), ("z", 0, False)] + [("w", 99, False)] * (HELD + 1) + [("v", 5, True)]
    out = list(coalesced(tokens(c, steps), extended))[1:]
    assert [text for _, text, _ in out] == ["xyz", "w" * HELD, "wv"]
    assert [len(lp["tokens"]) for _, _, lp in out] == [3, HELD, 2]


def test_without_logprobs_a_token_with_no_text_is_no_chunk_of_its_own():
    c = Choice()
    out = list(coalesced(((x, text, None) for x, text, _ in tokens(c, [("", 0, False), ("a", 1, False),
                                                                          ("b", 0, True)])), extended))
    assert [(text, lp) for _, text, lp in out] == [("", None), ("", None), ("ab", None)]


def test_another_choice_s_token_sends_the_held_ones_first():
    a, b = Choice(), Choice()

    def stream():
        yield a, "", None
        a.last = 0
        yield a, "", {"tokens": ["a0"]}  # no text: held
        yield b, "", None  # b opens
        b.last = 0
        yield b, "B", {"tokens": ["b0"]}

    out = list(coalesced(stream(), extended))
    assert [(x is a, text, lp) for x, text, lp in out] == [
        (True, "", None), (True, "", {"tokens": ["a0"]}), (False, "", None), (False, "B", {"tokens": ["b0"]})]


def test_an_error_comes_after_the_tokens_held_before_it():
    c = Choice()

    def stream():
        yield c, "", None
        c.last = 0
        yield c, "", {"tokens": ["t0"]}
        raise RuntimeError("the step failed")

    out = coalesced(stream(), extended)
    assert next(out) == (c, "", None)
    assert next(out) == (c, "", {"tokens": ["t0"]})
    with pytest.raises(RuntimeError, match="the step failed"):
        next(out)
