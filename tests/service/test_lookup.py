"""Prompt lookup's drafts (service/lookup.py) against the rule written as a plain scan: for the longest suffix of
n_max tokens down to 1 that occurs earlier (ending before the last token), the k tokens after its latest occurrence
that has k tokens after it, else after its first occurrence; nothing when no suffix occurs earlier."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from service.lookup import N_MAX, drafts


def scan(tokens: list[int], k: int, n_max: int) -> list[int]:
    size = len(tokens)
    for n in range(min(n_max, size - 1), 0, -1):
        suffix = tokens[size - n:]
        places = [j for j in range(size - n) if tokens[j:j + n] == suffix]
        if places:
            full = [j for j in places if j + n + k <= size]
            start = (full[-1] if full else places[0]) + n
            return tokens[start:start + k]
    return []


@settings(max_examples=400, deadline=None)
@given(st.lists(st.integers(0, 5), max_size=60), st.integers(1, 8), st.integers(1, 4))
def test_drafts_follow_the_longest_earlier_suffix(tokens, k, n_max):
    assert drafts(np.array(tokens, np.int64), k, n_max) == scan(tokens, k, n_max)


def test_examples():
    assert drafts(np.array([1, 2, 3, 9, 1, 2, 3]), 2) == [9, 1]  # the three-token suffix, then what followed it
    assert drafts(np.array([7, 7, 7, 7]), 4, N_MAX) == [7]  # a loop shorter than k: its first place, what is left
    assert drafts(np.array([4, 5, 6]), 3) == []  # nothing occurs earlier
    assert drafts(np.array([4]), 3) == [] and drafts(np.array([], np.int64), 3) == []
