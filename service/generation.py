"""One Generate stream's decoding (service/batch.py steps it): its prompt, sampling settings and generator, the
tokens it produced and their text, and the queue its reader takes them from."""

from __future__ import annotations

import queue
import re
import threading
from collections.abc import Callable, Sequence
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


def _border(s: str) -> list[int]:
    """KMP's failure function of `s`: entry q is the longest proper prefix of s[:q + 1] that is also its suffix."""
    out, k = [0] * len(s), 0
    for q in range(1, len(s)):
        while k and s[q] != s[k]:
            k = out[k - 1]
        if s[q] == s[k]:
            k += 1
        out[q] = k
    return out


class StopScan:
    """Stop strings in a text that grows by deltas (a stream's tokens), found incrementally: each stop string is a
    Knuth-Morris-Pratt matcher that remembers how much of it the text ends with, so a delta costs time in its own
    length (amortised; at most the stop strings' length more), never the text's.  `cut` is where the first stop
    string in the text starts (the least start of any, as the naive `min(text.find(s) for s in stops if s in
    text)`; an empty stop string is at 0), None while there is none; `held` is how many characters at the text's
    end may yet begin one (the longest end of the text that is the start of a stop string, shorter than it), which
    a stream holds back until it knows.  tests/service/test_stop_scan.py checks both against that naive search
    over the whole text."""

    def __init__(self, stops: Sequence[str]):
        self.stops = list(dict.fromkeys(stops))  # (the same string twice is found once)
        self.length = 0  # characters fed
        self.cut: int | None = 0 if any(not s for s in self.stops) else None
        self.matched = [0] * len(self.stops)  # per stop string, how many of its characters the text ends with
        self.border: list[list[int] | None] = [None] * len(self.stops)  # KMP's table, made at its first mismatch
        # the stop strings that may still start before `cut` (all of them while there is no cut)
        self.live = [] if self.cut == 0 else [i for i, s in enumerate(self.stops) if s]
        # while no stop string is under way, a delta without any one's first character changes nothing: one search
        self.idle = True
        firsts = sorted({self.stops[i][0] for i in self.live})
        self.firsts = re.compile("[" + "".join(map(re.escape, firsts)) + "]") if firsts else None

    @property
    def held(self) -> int:
        return max((self.matched[i] for i in self.live), default=0) if self.cut is None else 0

    def end(self, final: bool) -> int:
        """How much of the text a client may see: up to the first stop string; before the end, without a tail
        that may yet become one (`final`: the text is complete, nothing is held back)."""
        if self.cut is not None:
            return self.cut
        return self.length if final else self.length - self.held

    def feed(self, delta: str) -> int | None:
        """Take the text's next characters; the first stop string's start (`cut`), or None while there is none."""
        start = self.length
        self.length += len(delta)
        if self.firsts is None or self.idle and self.firsts.search(delta) is None:
            return self.cut
        for i in self.live:
            at = self._advance(i, delta)
            if at >= 0:  # stop string i's first occurrence ends at delta[:at]
                begin = start + at - len(self.stops[i])
                self.cut = begin if self.cut is None else min(self.cut, begin)
        if self.cut is not None:  # a stop string found later starts at or after length - matched
            cut = self.cut
            self.live = [i for i in self.live if self.matched[i] < len(self.stops[i])
                         and self.length - self.matched[i] < cut]
        self.idle = not any(self.matched[i] for i in self.live)
        return self.cut

    def _advance(self, i: int, delta: str) -> int:
        """Run stop string i's matcher over delta: where its first occurrence ends in delta (matched is then its
        length), or -1."""
        s, state = self.stops[i], self.matched[i]
        m, n = len(s), len(delta)
        if state and s.startswith(delta, state):  # the whole delta goes on with the match (one C-speed compare)
            self.matched[i] = state = state + n
            return n if state == m else -1
        pos = 0
        while pos < n:
            if state == 0:  # nothing under way: jump to the next character that may start one
                pos = delta.find(s[0], pos)
                if pos < 0:
                    break
                state, pos = 1, pos + 1
            else:
                c = delta[pos]
                if s[state] != c:
                    border = self.border[i]
                    if border is None:
                        border = self.border[i] = _border(s)
                    while state and s[state] != c:
                        state = border[state - 1]
                if s[state] == c:
                    state += 1
                pos += 1
            if state == m:
                self.matched[i] = m
                return pos
        self.matched[i] = state
        return -1


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
    output: list[int] = field(default_factory=list)  # the tokens it produced (prompt lookup's drafts read them)
    cancelled: bool = False  # set by its reader when it goes away
    done: bool = False  # finished: the loop drops it at the next boundary
    since: int = 0  # the loop's step count when it last entered or left the batch
    is_active: Callable[[], bool] = lambda: True  # the RPC's liveness: the loop drops a stream whose client left
    out: queue.SimpleQueue[Emitted | Exception] = field(default_factory=queue.SimpleQueue)  # its tokens, or an error
    signal: threading.Event | None = None  # set after each item, for a reader of several streams

    def __post_init__(self) -> None:
        self.rng = np.random.default_rng(self.params.seed)
        self.stops = StopScan(self.params.stop) if self.params.stop else None  # fed each token's text
        self.eos_ids = np.array(sorted(self.eos), np.int64)  # what holds() keeps out of the choice (barred())

    def barred(self, vocab: int) -> np.ndarray:
        """The end-of-sequence ids a row of `vocab` logits has (an id past the head, which a model's configuration may
        name, is never chosen anyway)."""
        return self.eos_ids[self.eos_ids < vocab]

    def holds(self, ahead: int = 0) -> bool:
        """Whether the token `ahead` places after the next one may not be an end of sequence: fewer than
        min_new_tokens made before it, where an end of sequence would end the stream (not under ignore_eos)."""
        return (self.generated + ahead < self.params.min_new_tokens and len(self.eos_ids) > 0
                and not self.params.ignore_eos)

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
        """The prompt runner's Job.reduce for a prompt whose own log-probabilities are wanted (OpenAI's echo)."""
        return NextTokens(self.prompt, self.params.logprobs)

    def advance(self, result: Result) -> Emitted | None:
        """The first token, from the prompt's result (which carries the stream's state into the loop); the prompt's
        own log-probabilities too when asked (from the same logits).  None when no token is asked for."""
        self.state = result.state
        self.cached = self.prompt_len
        if self.params.prompt_logprobs:  # the prompt runner reduced the prompt's rows as they came (reduce)
            self.prompt_logprobs = [(None, [])] + list(result.reduced or [])
        last = log_softmax(result.logits[-1])
        if self.params.max_new_tokens == 0:
            self.done = True
            return None
        return self.take(last)

    @property
    def plain(self) -> bool:
        """Greedy with no candidates asked for: its token is the row's argmax and needs no log-softmax."""
        return self.params.greedy and self.params.logprobs == 0

    def take(self, logp: np.ndarray) -> Emitted:
        """Sample the next token from its log-probabilities; the finish reason is '' while the stream goes on."""
        best = top_candidates(logp, self.params.logprobs)
        peek = self.detok.peek
        top = [(peek(t), lp) for t, lp in best]
        held = self.holds()
        if self.params.greedy and best and len(best) == min(self.params.logprobs, logp.shape[-1]) and not held:
            # the first candidate is pick's argmax (ties: the lowest id); a row with NaN has fewer candidates
            return self.emit(best[0][0], best[0][1], top)
        choose = logp
        if held:  # chosen among the others; the candidates and the log-probability stay the model's
            choose = logp.copy()
            choose[self.barred(len(choose))] = -np.inf
        token = pick(choose, self.params, self.rng)
        return self.emit(token, float(logp[token]), top)

    def emit(self, token: int, logprob: float | None, top: list[tuple[str, float]]) -> Emitted:
        """The chosen token, as its reader gets it (text, finish reason)."""
        self.generated += 1
        self.last = token
        self.output.append(token)
        reason = ""
        if token in self.eos and not self.params.ignore_eos:  # the end of sequence is not text
            delta, piece, reason = "", self.detok.raw(token).decode("utf-8", errors="replace"), "stop"
        else:
            delta, piece = self.detok.push(token)
            if self.stops is not None and delta and self.stops.feed(delta) is not None:
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


def greedy_rows(logits: np.ndarray, wanted: np.ndarray | None = None,
                held: Sequence[tuple[int, np.ndarray]] = ()) -> tuple[np.ndarray, list[float | None]]:
    """Each row's most likely token, and its log-probability where `wanted` (a bool per row; every row when None),
    for all rows at once: log p(argmax) is -log(sum(exp(x - max))), one pass over the vocabulary without the
    log-softmax's (rows, vocabulary) result.  That pass is most of the work (at 32 rows of a 49k vocabulary about
    2 ms against 0.2 ms for the argmax), so rows whose reader does not read it (SamplingParams.token_logprob) skip
    it and get None.  held: (row, ids) whose token may not be one of ids (Generation.holds): such a row whose argmax
    is one takes the most likely of the others, with its log-probability under the whole row."""
    tokens = logits.argmax(axis=1)
    barred = []
    for r, ids in held:
        if np.isin(tokens[r], ids):
            row = logits[r].copy()
            row[ids] = -np.inf
            tokens[r] = row.argmax()
            barred.append(r)
    rows = np.arange(len(logits)) if wanted is None else np.flatnonzero(wanted)
    out: list[float | None] = [None] * len(logits)
    if barred:  # not the row's maximum: the shortcut below does not hold
        for r in barred:
            if wanted is None or wanted[r]:
                out[r] = float(log_softmax(logits[r])[tokens[r]])
        rows = rows[~np.isin(rows, barred)]
    if len(rows):
        part = logits if len(rows) == len(logits) else logits[rows]
        best = part[np.arange(len(rows)), tokens[rows]]
        shifted = np.exp(part - best[:, None])
        for r, lp in zip(rows.tolist(), (-np.log(shifted.sum(axis=1, dtype=np.float64))).tolist(), strict=True):
            out[r] = lp
    return tokens, out
