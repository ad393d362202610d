"""Continuous batching for Generate: the decode batch of one model, one part of its engine (service/engine.py).

A stream's prompt goes through the engine's prompt runner like any request (batched with Predict and other
prefills); from its second token on, the stream joins the decode batch, which makes ONE onnxruntime call per engine
turn for every stream in it.  The batch's caches are one KVCache (service/kvcache.py) in the layout of the graph the
steps run on (service/layouts.py); the batch never asks which.  The engine decides when the batch changes
(service/plan.py: joins, leaves, streams ahead of their readers, rotation) and this carries it out: a regroup at a
step boundary, the step's call through the executor the engine hands in, each row's token handed to its reader.
Each row's inputs are exactly what a prompt call would build for it, so every stream's tokens are those it gets
alone.  A step or rebuild that fails ends the streams it touched (out of memory: RESOURCE_EXHAUSTED), never the
engine.

Speculative decoding (--speculate K): a greedy stream that is the model's only stream (alone in the batch, none
outside it) proposes up to K tokens by prompt lookup (service/lookup.py) and its step runs its token and the drafts
in one call on the batch's cache.  Each position's argmax is the token plain decoding would choose there, so the
stream takes them in order while they equal the drafts, and one more: the model's token after the last draft it
agreed with.  The positions of the drafts it did not make are given back (KVCache.drop), and the tokens go to the
reader one by one, each through the same emit as a plain step's (stop strings, EOS, max_new_tokens, its logprob), so
the stream's tokens are those plain decoding gives, up to the float rounding of a wider call.  While streams share
the batch, or where the layout cannot give positions back (a fixed-size state: a mixer layer's, cpe's) or the
model's RoPE follows the length (every prompt whole), steps are plain.

A speculative step costs more than a plain one (a wider call; bench/results/speculative*.json), so a stream whose
drafts fail stops paying for them: its drafts per step follow what it takes (two more after a step that took them
all, one fewer otherwise, from K down to 1), and a step that took none makes it wait one plain step before it
proposes again, twice as many after each such step in a row (up to BACKOFF_MAX).  A stream whose text repeats
keeps speculating; one whose drafts rarely hold proposes seldom.  The drafts change how many tokens a call gives,
never which.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Protocol

import numpy as np

from service.errors import DeadlineExceeded, ResourceExhausted, ServiceError
from service.generation import Generation, greedy_rows
from service.kvcache import KVCache, State
from service.lookup import drafts
from service.plan import Regroup
from service.sampling import log_softmax
from service.stats import EngineStats

log = logging.getLogger(__name__)

BACKOFF_MAX = 32  # the most plain steps a stream waits after speculative steps that took no draft


class Guess:
    """A lone greedy stream's speculation as it goes: the drafts it proposes per step, and the plain steps it waits
    after steps whose drafts all failed."""

    def __init__(self, stream: Generation, most: int) -> None:
        self.stream, self.most = stream, most
        self.k, self.misses, self.wait = most, 0, 0

    def size(self) -> int:
        """The drafts of this step (0: a plain step, counted off the wait)."""
        if self.wait:
            self.wait -= 1
            return 0
        return self.k

    def taken(self, taken: int, proposed: int) -> None:
        if taken == proposed:
            self.k, self.misses = min(self.most, self.k + 2), 0
        else:
            self.k = max(1, self.k - 1)
            self.misses = 0 if taken else self.misses + 1
            if not taken:
                self.wait = min(BACKOFF_MAX, 2 ** (self.misses - 1))


class Steps(Protocol):
    """What runs a decode step (service.executor.Executor)."""

    def step(self, ids: np.ndarray, cache: KVCache) -> np.ndarray: ...


class DecodeBatch:
    """The decode batch of one model and its open streams (those in it, and those outside it with their own state:
    new, ahead of their reader, rotated out).  Its lists change under its own lock, so `count` is read from any
    thread; everything else is called by the engine's turn alone."""

    def __init__(self, cache: KVCache, name: str, max_rows: int, stats: EngineStats, speculate: int = 0):
        self.cache, self.name, self.max_rows, self.stats = cache, name, max_rows, stats  # cache row b = rows[b]
        self.speculate = speculate if cache.drops else 0  # the most draft tokens of a lone greedy stream's step
        self.guess: Guess | None = None  # the lone stream's speculation so far
        self.adapt = True  # False: K drafts at every step whatever they did before (bench speculative's comparison)
        self.rows: list[Generation] = []  # the batch, in row order
        self.outside: list[Generation] = []  # streams with their own state: new, ahead of their reader, rotated out
        self._lock = threading.Lock()

    @property
    def count(self) -> int:
        """Streams open in it or beside it."""
        with self._lock:
            return len(self.rows) + len(self.outside)

    @property
    def holding(self) -> bool:
        """Whether any stream is open."""
        return bool(self.rows or self.outside)

    # --- the engine's update before it decides (its lock held) -----------------------------------------------

    def prune(self, joined: list[Generation]) -> tuple[list[int], bool]:
        """New streams come in at this boundary; finished, cancelled and expired ones are dropped from outside the
        batch.  Returns the rows still going on, and whether the cache holds far more than the streams left need
        (a stream gone from outside the batch may leave it oversized)."""
        now = time.monotonic()
        with self._lock:
            self.outside += joined
        before = len(self.outside)
        kept = [s for s in self.outside if _alive(s, now)]
        with self._lock:
            self.outside = kept
        live = [b for b, s in enumerate(self.rows) if _alive(s, now)]
        shrink = len(self.outside) < before and len(live) == len(self.rows) and \
            self.cache.oversized(self.rows + self.outside)
        return live, shrink

    # --- execute and update -------------------------------------------------------------------------------------

    def touched(self, change: Regroup | None) -> list[Generation]:
        """The streams a failed regroup or step would end: the batch's rows and those coming in."""
        return self.rows + ([self.outside[i] for i in change.enter] if change is not None else [])

    def regroup(self, change: Regroup, prompts: int = 0) -> None:
        """Rebuild the batch: kept rows (in the order the cache gives them), then the streams coming in.  `prompts`:
        streams whose prompts are still being prefilled (queued ones too), which the cache may make room for now."""
        begun = time.perf_counter()
        rows, enter = self.rows, [self.outside[i] for i in change.enter]
        for b in change.out:  # leaving with its own state (a copy: the batch's memory is about to be reused)
            s = rows[b]
            s.state, s.since = self.cache.take(b), self.stats.steps
            self.stats.taken_out += 1
        entering = set(change.enter)
        # sized for the streams outside too (ahead of their readers, rotated out: they come back), so memory is
        # freed where a stream has gone, not where one steps aside
        back = [s for i, s in enumerate(self.outside) if i not in entering] + [rows[b] for b in change.out]
        states = [_own_state(s) for s in enter]
        rows_next = len(change.keep) + len(enter)
        coming = min(prompts, max(self.max_rows - rows_next, 0))
        keep = self.cache.regroup(change.keep, states, [rows[b] for b in change.keep] + enter + back, coming)
        with self._lock:  # both lists at once: `count` never sees a stream in neither
            self.outside = back
            self.rows = [rows[b] for b in keep] + enter
        self.stats.rebuilds += 1
        for s in enter:
            s.state, s.since = None, self.stats.steps
        self.stats.seconds["regroup"] += time.perf_counter() - begun

    def drafts(self) -> list[int]:
        """A speculative step's drafts: those of the batch's one greedy stream, when it is the model's only one and
        may still emit more than one token; none otherwise (a plain step)."""
        if not self.speculate or len(self.rows) != 1 or self.outside:
            return []
        s = self.rows[0]
        if not s.params.greedy:
            return []
        if self.guess is None or self.guess.stream is not s or self.guess.most != self.speculate:
            self.guess = Guess(s, self.speculate)
        size = self.guess.size() if self.adapt else self.speculate
        k = min(size, s.room - s.prompt_len - s.generated - 1)  # the step emits up to k + 1 tokens
        if k < 1:
            return []
        return drafts(np.array(s.prompt + s.output, np.int64), k)

    def run(self, executor: Steps) -> tuple[list[Generation], np.ndarray, float, list[int]]:
        """One decode step's onnxruntime call: the rows, their (B, V) logits, when it ended, and the drafts of a
        speculative step (then the logits are (1, 1 + drafts, V))."""
        rows, seconds = self.rows, self.stats.seconds
        begun = time.perf_counter()
        guess = self.drafts()
        if self.cache.grow(rows + self.outside, 1 + len(guess)):  # the longest row reached the end of its room
            self.stats.rebuilds += 1
            seconds["regroup"] += time.perf_counter() - begun
        begun = time.perf_counter()
        ids = np.array([[rows[0].last, *guess]] if guess else [[s.last] for s in rows], np.int64)
        logits = executor.step(ids, self.cache)
        ended = time.perf_counter()
        seconds["run"] += ended - begun
        return rows, logits, ended, guess

    def hand_out(self, rows: list[Generation], logits: np.ndarray, ended: float, guess: list[int] | None = None
                 ) -> None:
        """Each row's token from the step's logits, to its reader (a speculative step's tokens: `verify`)."""
        if guess:
            self.verify(rows[0], logits[0], guess)
            self.stats.seconds["tokens"] += time.perf_counter() - ended
            return
        self.stats.step(len(rows))
        plain = [b for b, s in enumerate(rows) if s.plain]  # argmax rows, all at once
        chosen = {}
        if plain:
            held = [(i, rows[b].barred(logits.shape[1])) for i, b in enumerate(plain) if rows[b].holds()]
            tokens, logprobs = greedy_rows(logits if len(plain) == len(rows) else logits[plain],
                                           np.array([rows[b].params.token_logprob for b in plain]), held)
            chosen = {b: (tokens[i], logprobs[i]) for i, b in enumerate(plain)}
        for b, s in enumerate(rows):
            s.cached += 1
            if b in chosen:
                token, logprob = chosen[b]
                s.out.put(s.emit(int(token), logprob, []))
            else:
                s.out.put(s.take(log_softmax(logits[b])))
            if s.signal is not None:
                s.signal.set()
        self.stats.seconds["tokens"] += time.perf_counter() - ended

    def verify(self, s: Generation, logits: np.ndarray, guess: list[int]) -> None:
        """A speculative step's tokens, one by one to the reader: each position's argmax while the drafts before it
        were the model's own, up to the stream's end; the positions of the drafts not taken given back."""
        self.stats.step(1)
        held = [(i, s.barred(logits.shape[1])) for i in range(len(logits)) if s.holds(i)]  # i: the next + i
        plain = greedy_rows(logits, np.full(len(logits), s.params.token_logprob), held) if s.plain else None
        taken = 0  # drafts the model made
        for i in range(len(logits)):
            item = s.emit(int(plain[0][i]), plain[1][i], []) if plain is not None else \
                s.take(log_softmax(logits[i]))
            s.out.put(item)
            if s.signal is not None:
                s.signal.set()
            if item.reason or i == len(guess) or item.id != guess[i]:
                break
            taken += 1
        s.cached += 1 + taken
        self.cache.drop(len(guess) - taken)
        self.stats.speculated(taken, len(guess) - taken)
        if self.guess is not None and self.guess.stream is s:
            self.guess.taken(taken, len(guess))

    def fail(self, streams: list[Generation], err: Exception) -> None:
        """End the streams a failed step or rebuild touched (the batch's rows, and those coming in, whose caches may
        be half moved) with the error, their readers told; the batch starts again empty, the other streams outside
        it go on.  Out of memory is RESOURCE_EXHAUSTED, anything else not a ServiceError INTERNAL (logged)."""
        name = self.name
        if isinstance(err, MemoryError):
            log.error("decode batch of %d streams on model %s ran out of memory; those streams end", len(streams),
                      name)
            err = ResourceExhausted(f"the worker ran out of memory for model {name}'s decode batch ({len(streams)} "
                                    "streams); this stream ended, retry later or ask for fewer tokens")
        elif not isinstance(err, ServiceError):
            log.exception("decode step of %d streams failed on model %s", len(streams), name)
        ended = {id(s) for s in streams}
        with self._lock:
            self.rows = []
            self.outside = [s for s in self.outside if id(s) not in ended]
        self.cache.clear()
        for s in streams:
            if not (s.done or s.cancelled):  # (a finished stream's reader has had its last token)
                s.out.put(err)
                if s.signal is not None:
                    s.signal.set()
            s.done, s.state = True, None


def _own_state(s: Generation) -> State:
    """The cache of a stream coming into the batch: every stream outside it carries its own (its prompt's, or the
    one it left the batch with)."""
    if s.state is None:
        raise RuntimeError("a stream entering the decode batch carries no state")
    return s.state


def _alive(s: Generation, now: float) -> bool:
    """Whether a stream goes on; one past its deadline is told so."""
    if s.cancelled or s.done or not s.is_active():
        return False
    if s.deadline is not None and now > s.deadline:
        s.cancelled = True
        s.out.put(DeadlineExceeded("deadline passed mid-stream"))
        if s.signal is not None:
            s.signal.set()
        return False
    return True
