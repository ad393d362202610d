"""service/sampling.py against independent definitions: candidates and greedy choice under ties (a sort by
(-logp, id) in plain Python), and log-probabilities of chosen tokens (a float64 log-softmax in plain numpy)."""

import math

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from service.generation import greedy_rows
from service.sampling import SamplingParams, pick, top_candidates

# rows of few distinct values: ties everywhere, at the top and at the k boundary
tied_rows = st.lists(st.integers(0, 3), min_size=1, max_size=80)


def normalised(values: list[int]) -> list[float]:
    """log-probabilities of the values taken as logits, in plain Python (equal values stay equal)."""
    top = max(values)
    total = math.log(math.fsum(math.exp(v - top) for v in values))
    return [v - top - total for v in values]


def reference_top(logp: list[float], k: int) -> list[int]:
    """The definition: most likely first, ties broken by lower id."""
    return sorted(range(len(logp)), key=lambda i: (-logp[i], i))[:k]


@settings(max_examples=400, deadline=None)
@given(tied_rows, st.integers(1, 8))
def test_top_candidates_break_ties_by_lower_id(values, k):
    logp = normalised(values)
    got = top_candidates(np.array(logp), k)
    assert [i for i, _ in got] == reference_top(logp, k)
    assert [lp for _, lp in got] == [logp[i] for i in reference_top(logp, k)]


@settings(max_examples=400, deadline=None)
@given(tied_rows, st.integers(1, 5))
def test_the_greedy_token_is_the_first_candidate(values, k):
    logp = normalised(values)
    first = reference_top(logp, 1)[0]
    row = np.array(logp)
    assert pick(row, SamplingParams(), np.random.default_rng(0)) == first
    assert pick(row, SamplingParams(temperature=0.7, top_k=1), np.random.default_rng(0)) == first
    assert top_candidates(row, k)[0][0] == first
    # the decode loop's greedy rows (logits, not log-probabilities, several rows at once) agree
    tokens, best = greedy_rows(np.array([values, values[::-1]], np.float32))
    assert tokens.tolist() == [first, reference_top(normalised(values[::-1]), 1)[0]]
    assert abs(best[0] - logp[first]) < 1e-6


@settings(max_examples=200, deadline=None)
@given(tied_rows, st.integers(1, 5), st.integers(0, 2**32 - 1))
def test_top_k_sampling_draws_from_the_tied_top_k(values, k, seed):
    logp = normalised(values)
    allowed = set(reference_top(logp, k))
    params = SamplingParams(temperature=1.0, top_k=min(k, len(values)), seed=seed)
    rng = np.random.default_rng(seed)
    for _ in range(5):
        assert pick(np.array(logp), params, rng) in allowed
