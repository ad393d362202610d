"""One Generate stream's decoding (service/decoder.py steps it): its prompt, sampling settings and generator, the
tokens it produced and their text, and the queue its reader takes them from."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from service.jobs import Result
from service.sampling import SamplingParams, log_softmax, next_token_rows, pick, top_candidates
from service.tokenizer import Detokenizer


class Emitted(NamedTuple):
    """One generated token as the loop hands it to its reader."""

    id: int
    logprob: float | None  # None where the request did not ask for it (SamplingParams.token_logprob)
    text: str  # the completion's text so far (never half a character, except what flush() ends on)
    reason: str  # the finish reason, or '' while the stream goes on
    delta: str  # what this token added to the text
    piece: str  # the token as OpenAI's logprobs write it (its text in context, or bytes:\xNN)
    top: list[tuple[str, float]]  # the top `logprobs` candidates (token string, log-probability), most likely first


class NextTokens:
    """A Job.reduce (Score, OpenAI's echo): each row of a piece of the prompt's logits -> (log p(the prompt's next
    token), the row's k top candidates).  Its `key` names what it computes, so the prefix cache (service/prefix.py)
    may keep its items for a prompt's leading tokens and hand them to a later job with the same key."""

    def __init__(self, tokens: list[int] | np.ndarray, k: int = 0):
        self.tokens, self.key = tokens, ("next", k)

    def __call__(self, rows: np.ndarray, first: int) -> list[tuple[float, list[tuple[int, float]]]]:
        return next_token_rows(rows, self.tokens[first + 1:first + 1 + len(rows)], self.key[1])


@dataclass(eq=False)
class Generation:
    """One Generate request's decoding: its prompt, sampling settings, what it produced, and where its tokens go."""

    prompt: list[int]
    params: SamplingParams
    detok: Detokenizer  # the completion's text, primed with the prompt's last tokens
    eos: frozenset[int] = frozenset()  # the model's end-of-sequence ids (none for byte models)
    limit: int | None = None  # the most positions the model takes (prompt + generated)
    deadline: float | None = None
    generated: int = 0
    text: str = ""
    prompt_logprobs: list[tuple[float | None, list[tuple[int, float]]]] = field(default_factory=list)
    state: list[np.ndarray] | None = None  # its own carried tensors while it is outside the loop's batch
    cached: int = 0  # positions in its KV cache
    last: int = -1
    cancelled: bool = False  # set by its reader when it goes away
    done: bool = False  # finished: the loop drops it at the next boundary
    since: int = 0  # the loop's step count when it last entered or left the batch
    is_active: Callable[[], bool] = lambda: True  # the RPC's liveness: the loop drops a stream whose client left
    out: queue.SimpleQueue[Emitted | Exception] = field(default_factory=queue.SimpleQueue)  # its tokens, or an error
    signal: threading.Event | None = None  # set after each item, for a reader of several streams

    def __post_init__(self) -> None:
        self.rng = np.random.default_rng(self.params.seed)

    @property
    def queued(self) -> int:
        """Tokens its reader has not taken yet (service/plan.py's Lane)."""
        return self.out.qsize()

    @property
    def prompt_len(self) -> int:
        return len(self.prompt)

    @property
    def room(self) -> int:
        """The most positions this stream may occupy: its prompt and every token it may still generate."""
        most = self.prompt_len + self.params.max_new_tokens
        return most if self.limit is None else min(most, self.limit)

    @property
    def reduce(self) -> NextTokens:
        """The scheduler's Job.reduce for a prompt whose own log-probabilities are wanted (OpenAI's echo)."""
        return NextTokens(self.prompt, self.params.logprobs)

    def advance(self, result: Result) -> Emitted | None:
        """The first token, from the prompt's result (which carries the stream's state into the loop); the prompt's
        own log-probabilities too when asked (from the same logits).  None when no token is asked for."""
        self.state = result.state
        self.cached = self.prompt_len
        if self.params.prompt_logprobs:  # the scheduler reduced the prompt's rows as they came (reduce)
            self.prompt_logprobs = [(None, [])] + list(result.reduced or [])
        last = log_softmax(result.logits[-1])
        if self.params.max_new_tokens == 0:
            self.done = True
            return None
        return self.take(last)

    def _stops(self, delta: str) -> bool:
        """Whether a stop string ends in the new text (only the tail it can span is searched)."""
        longest = max(len(s) for s in self.params.stop)
        tail = self.text[max(len(self.text) - longest + 1, 0):] + delta
        return any(s in tail for s in self.params.stop)

    @property
    def plain(self) -> bool:
        """Greedy with no candidates asked for: its token is the row's argmax and needs no log-softmax."""
        return self.params.greedy and self.params.logprobs == 0

    def take(self, logp: np.ndarray) -> Emitted:
        """Sample the next token from its log-probabilities; the finish reason is '' while the stream goes on."""
        best = top_candidates(logp, self.params.logprobs)
        peek = self.detok.peek
        top = [(peek(t), lp) for t, lp in best]
        if self.params.greedy and best and len(best) == min(self.params.logprobs, logp.shape[-1]):
            # the first candidate is pick's argmax (ties: the lowest id); a row with NaN has fewer candidates
            return self.emit(best[0][0], best[0][1], top)
        token = pick(logp, self.params, self.rng)
        return self.emit(token, float(logp[token]), top)

    def emit(self, token: int, logprob: float | None, top: list[tuple[str, float]]) -> Emitted:
        """The chosen token, as its reader gets it (text, finish reason)."""
        self.generated += 1
        self.last = token
        reason = ""
        if token in self.eos and not self.params.ignore_eos:  # the end of sequence is not text
            delta, piece, reason = "", self.detok.raw(token).decode("utf-8", errors="replace"), "stop"
        else:
            delta, piece = self.detok.push(token)
            if self.params.stop and delta and self._stops(delta):
                reason = "stop"
            elif self.limit is not None and self.prompt_len + self.generated >= self.limit:
                reason = "max_positions"  # the next token would need a position past the model's limit
            elif self.generated >= self.params.max_new_tokens:
                reason = "length"
        if reason:
            delta += self.detok.flush()
        self.text = text = self.text + delta
        self.done = bool(reason)
        return Emitted(token, logprob, text, reason, delta, piece, top)


def greedy_rows(logits: np.ndarray, wanted: np.ndarray | None = None) -> tuple[np.ndarray, list[float | None]]:
    """Each row's most likely token, and its log-probability where `wanted` (a bool per row; every row when None),
    for all rows at once: log p(argmax) is -log(sum(exp(x - max))), one pass over the vocabulary without the
    log-softmax's (rows, vocabulary) result.  That pass is most of the work (at 32 rows of a 49k vocabulary about
    2 ms against 0.2 ms for the argmax), so rows whose reader does not read it (SamplingParams.token_logprob) skip
    it and get None."""
    tokens = logits.argmax(axis=1)
    rows = np.arange(len(logits)) if wanted is None else np.flatnonzero(wanted)
    out: list[float | None] = [None] * len(logits)
    if len(rows):
        part = logits if len(rows) == len(logits) else logits[rows]
        best = part[np.arange(len(rows)), tokens[rows]]
        shifted = np.exp(part - best[:, None])
        for r, lp in zip(rows.tolist(), (-np.log(shifted.sum(axis=1, dtype=np.float64))).tolist(), strict=True):
            out[r] = lp
    return tokens, out
