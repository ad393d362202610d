"""Next-token distributions: log-softmax, top candidates, sampling, and the divergences Compare reports."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from service.errors import InvalidArgument

# The most characters (Unicode code points) one stop string may have, on every front (OpenAI's `stop`, posenc.v1
# Generate's `stop`): a stream holds back up to this many characters less one while its text may be the start of a
# stop string, and each token's stop-string check costs up to the stop strings' length (service.generation.StopScan).
MAX_STOP_LENGTH = 256


def permute_default(text: str | None, ids: list[int] | None) -> tuple[str | None, list[int] | None]:
    """The prompt's words in reverse order ("dog bites man" -> "man bites dog"); ids reversed."""
    if text is not None:
        return " ".join(reversed(text.split(" "))), None
    return None, list(reversed(ids or []))


def permutation(text: str | None, ids: list[int] | None, permuted_text: str | None, permuted_ids: list[int] | None
                ) -> tuple[str | None, list[int] | None]:
    """Compare's permuted prompt (the default one where none is given), checked to hold the prompt's tokens (for
    text: its characters) in another order."""
    if permuted_text is None and not permuted_ids:
        permuted_text, permuted_ids = permute_default(text, ids)
    if (text is None) != (permuted_text is None):
        raise InvalidArgument("give the prompt and the permuted prompt both as text or both as token ids")
    if text is not None and permuted_text is not None and sorted(text) != sorted(permuted_text):
        raise InvalidArgument("the permuted prompt must hold the same tokens as the prompt in another order "
                              "(for text: the same characters)")
    if text is None and sorted(ids or []) != sorted(permuted_ids or []):
        raise InvalidArgument("the permuted prompt must hold the same tokens as the prompt in another order "
                              f"({len(ids or [])} vs {len(permuted_ids or [])} tokens, or different ones)")
    return permuted_text, permuted_ids


def divergences(logp: np.ndarray, logq: np.ndarray) -> tuple[float, float, float]:
    """Total variation, KL(p || q) and Jensen-Shannon between two next-token distributions (log space)."""
    p, q = np.exp(logp), np.exp(logq)
    m = 0.5 * (p + q)
    logm = np.log(np.maximum(m, 1e-300))
    kl = float(np.sum(p * (logp - logq)))
    js = float(0.5 * np.sum(p * (logp - logm)) + 0.5 * np.sum(q * (logq - logm)))
    return float(0.5 * np.abs(p - q).sum()), kl, js


def top_of(logp: np.ndarray, k: int) -> list[tuple[int, float, float]]:
    order = np.argsort(-logp, kind="stable")[:k]
    return [(int(i), float(math.exp(logp[i])), float(logp[i])) for i in order]


def log_softmax(x: np.ndarray) -> np.ndarray:
    """float64 log-probabilities of logits (one row, or a few: the result has the input's shape in float64)."""
    out: np.ndarray = x.astype(np.float64)  # a copy, shifted in place: (x - max) - log(sum(exp(x - max)))
    out -= out.max(axis=-1, keepdims=True)
    out -= np.log(np.exp(out).sum(axis=-1, keepdims=True))
    return out


BLOCK = 1 << 18  # float64 values in one block of rows: the scratch memory of a long prompt's log-probabilities


def _blocks(logits: np.ndarray) -> Iterator[tuple[int, np.ndarray]]:
    """(first row, float64 log-softmax of a block of rows) over (T, V) logits, a block of at most BLOCK values at a
    time, so a prompt's T x V log-probabilities are never held (only the float32 logits it came with)."""
    rows = max(1, BLOCK // max(logits.shape[-1], 1))
    for start in range(0, len(logits), rows):
        block = logits[start:start + rows].astype(np.float64)
        block -= block.max(axis=1, keepdims=True)
        lse = np.log(np.exp(block).sum(axis=1, keepdims=True))
        block -= lse
        yield start, block


def next_token_rows(logits: np.ndarray, following: Sequence[int] | np.ndarray,
                    k: int = 0) -> list[tuple[float, list[tuple[int, float]]]]:
    """For each row i of (n, V) logits that has a following token: (log p(following[i] | row i), the row's k top
    candidates).  A Job's reduce (Score, echo): rows past the last following token give nothing."""
    following = np.asarray(following, np.int64)
    out: list[tuple[float, list[tuple[int, float]]]] = []
    for start, block in _blocks(logits[:len(following)]):
        picked = block[np.arange(len(block)), following[start:start + len(block)]].tolist()
        out += [(lp, top_candidates(row, k) if k else []) for lp, row in zip(picked, block, strict=True)]
    return out


@dataclass(frozen=True)
class SamplingParams:
    """How one Generate request chooses its tokens, from the request to the decode loop (one object, every front).

    temperature 0 = greedy.  top_k 0 = off.  top_p in (0, 1]: the smallest set of tokens whose probability reaches
    it (1 = off); top_p 0 is the smallest nucleus there is, the most likely token: greedy (OpenAI's and vLLM's
    meaning).  logprobs: how many top candidates each token reports (0 = none); prompt_logprobs: the prompt's own
    log-probabilities and candidates, from the prefill (OpenAI's echo).  token_logprob: whether each token's own
    log-probability is wanted (posenc.v1's Generate always carries it; the OpenAI routes only when the request asks
    for logprobs): a greedy row without it is an argmax alone.  ignore_eos: run past the model's end of sequence
    (benchmarks).  min_new_tokens: the model's end of sequence may not be chosen before this many tokens (vLLM's
    min_tokens, transformers' min_new_tokens): it is left out of the choice, not of the log-probabilities reported,
    which stay the model's own; stop strings still end the stream."""

    max_new_tokens: int = 32
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    logprobs: int = 0
    prompt_logprobs: bool = False
    ignore_eos: bool = False
    token_logprob: bool = True
    min_new_tokens: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_p == 0 or self.top_k == 1

    def check(self, *, max_new_tokens: int, max_stop: int, max_logprobs: int, vocab: int,
              names: dict[str, str] | None = None, allow_zero_tokens: bool = False,
              max_stop_length: int = MAX_STOP_LENGTH) -> None:
        """Refuse values outside the server's limits with InvalidArgument naming the caller's field (`names` maps
        these fields to the caller's own, e.g. max_new_tokens -> max_tokens for OpenAI's API)."""
        names = names or {}

        def bad(name: str, why: str) -> InvalidArgument:
            shown = names.get(name, name)
            err = InvalidArgument(f"{shown} {why}")
            err.param = shown
            return err

        low = 0 if allow_zero_tokens else 1
        if not low <= self.max_new_tokens <= max_new_tokens:
            raise bad("max_new_tokens", f"must be in [{low}, {max_new_tokens}], got {self.max_new_tokens}")
        if not 0 <= self.min_new_tokens <= self.max_new_tokens:
            most = names.get("max_new_tokens", "max_new_tokens")
            raise bad("min_new_tokens", f"must be in [0, {self.max_new_tokens}] (at most {most}), got "
                                        f"{self.min_new_tokens}")
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            raise bad("temperature", f"must be >= 0, got {self.temperature}")
        if not 0 <= self.top_k <= vocab:
            raise bad("top_k", f"must be in [0, {vocab}], got {self.top_k}")
        if not 0 <= self.top_p <= 1:
            raise bad("top_p", f"must be in [0, 1] (0 = greedy, 1 = off), got {self.top_p}")
        if len(self.stop) > max_stop:
            raise bad("stop", f"may hold at most {max_stop} strings (the server's --max-stop-strings), "
                              f"got {len(self.stop)}")
        longest = max(range(len(self.stop)), key=lambda i: len(self.stop[i]), default=None)
        if longest is not None and len(self.stop[longest]) > max_stop_length:
            raise bad("stop", f"strings may have at most {max_stop_length} characters each; {names.get('stop', 'stop')}"
                              f"[{longest}] has {len(self.stop[longest])}")
        if not 0 <= self.logprobs <= max_logprobs:
            raise bad("logprobs", f"must be in [0, {max_logprobs}], got {self.logprobs}")


def top_candidates(logp: np.ndarray, k: int) -> list[tuple[int, float]]:
    """The k most likely tokens of one row, most likely first (ties: lower id first), as (id, log-probability)."""
    if k <= 0:
        return []
    n = logp.shape[-1]
    k = min(k, n)
    # every token at least as likely as the k-th most likely one (all of a tie at the boundary), in id order; a
    # stable sort by likelihood then keeps lower ids first within a tie, so the first is the greedy token (argmax)
    part = np.arange(n) if k == n else np.flatnonzero(logp >= np.partition(logp, n - k)[n - k])
    values = logp[part]
    order = np.argsort(-values, kind="stable")[:k]
    return list(zip(part[order].tolist(), values[order].tolist(), strict=True))


def pick(logp: np.ndarray, params: SamplingParams, rng: np.random.Generator) -> int:
    """The next token: greedy takes the most likely (the lowest id of a tie, the first of top_candidates); sampling
    draws from the top-k / top-p set in the same order (ties: lower id first)."""
    if params.greedy:
        return int(np.argmax(logp))
    order = np.argsort(-logp, kind="stable")  # a temperature > 0 keeps the order
    if params.top_k:
        order = order[:params.top_k]
    # shifted before scaling, so the most likely token is exactly 0: a subnormal temperature sends the others to
    # -inf (probability 0) instead of every one to -inf and their difference to NaN
    probs = np.exp((logp[order] - logp[order[0]]) / params.temperature)
    probs /= probs.sum()
    if params.top_p < 1:
        keep = int(np.searchsorted(np.cumsum(probs), params.top_p) + 1)
        order, probs = order[:keep], probs[:keep] / probs[:keep].sum()
    return int(order[rng.choice(len(order), p=probs)])
