"""service/sampling.py against independent definitions: candidates and greedy choice under ties (a sort by
(-logp, id) in plain Python), and log-probabilities of chosen tokens (a float64 log-softmax in plain numpy)."""

import math
import tracemalloc

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from service.generation import greedy_rows
from service.sampling import SamplingParams, next_token_rows, pick, top_candidates

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


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(-30, 0).map(float), min_size=2, max_size=300),  # gaps of 1 or more: exp(-1 / T) is 0
       st.sampled_from([5e-324, 1e-310, 1e-308, 1e-200]),
       st.integers(0, 2**32 - 1))
def test_a_vanishing_temperature_samples_a_most_likely_token(logp, temperature, seed):
    """softmax(logp / T) tends to the uniform choice among the most likely tokens as T goes to 0; a subnormal T once
    overflowed every logp / T to -inf and drew from NaN (found by tests/service/test_fuzz.py)."""
    params = SamplingParams(temperature=temperature, seed=seed)
    best = {i for i, v in enumerate(logp) if v == max(logp)}
    assert pick(np.array(logp), params, np.random.default_rng(seed)) in best


def reference_log_softmax(logits: np.ndarray) -> np.ndarray:
    """torch's float64 log-softmax: the independent definition."""
    return torch.log_softmax(torch.from_numpy(logits).double(), dim=-1).numpy()


def long_logits(rows: int, vocab: int, seed: int = 0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal((rows, vocab)) * 4).astype(np.float32)


def peak_bytes(fn, *args) -> int:
    """Peak traced allocation (numpy's arrays included) while fn runs."""
    tracemalloc.start()
    try:
        fn(*args)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_next_token_rows_equal_a_float64_log_softmax():
    logits = long_logits(300, 3000)  # several blocks of rows
    tokens = np.random.default_rng(1).integers(0, 3000, 300).tolist()
    want = reference_log_softmax(logits)[np.arange(300), tokens]
    got = next_token_rows(logits, tokens)
    assert np.abs(np.array([lp for lp, _ in got]) - want).max() <= 1e-5 and all(top == [] for _, top in got)


def test_next_token_rows_give_the_top_candidates_and_stop_at_the_last_following_token():
    logits = long_logits(120, 2000, seed=2)
    prompt = np.random.default_rng(3).integers(0, 2000, 120).tolist()
    ref = reference_log_softmax(logits)
    got = next_token_rows(logits, prompt[1:], 3)  # the last row has no following token: nothing for it
    assert len(got) == len(prompt) - 1
    for t, (logprob, top) in enumerate(got):
        assert abs(logprob - ref[t, prompt[t + 1]]) <= 1e-5
        assert [i for i, _ in top] == reference_top(ref[t].tolist(), 3)
        assert max(abs(lp - ref[t, i]) for i, lp in top) <= 1e-5


def test_long_prompt_logprobs_need_a_fraction_of_their_logits_memory():
    """A 2,048 x 8,192 prompt's logits (64 MiB in float32): its log-probabilities take scratch memory far below the
    logits' own size, never a T x V float64 copy (which alone is twice the logits)."""
    logits = long_logits(2048, 8192)
    tokens = np.random.default_rng(4).integers(0, 8192, 2048).tolist()
    assert peak_bytes(next_token_rows, logits, tokens) / logits.nbytes < 0.25
    assert peak_bytes(next_token_rows, logits, tokens, 5) / logits.nbytes < 0.25
