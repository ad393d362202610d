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
from service.plan import Regroup
from service.sampling import log_softmax
from service.stats import EngineStats

log = logging.getLogger(__name__)


class Steps(Protocol):
    """What runs a decode step (service.executor.Executor)."""

    def step(self, ids: np.ndarray, cache: KVCache) -> np.ndarray: ...


class DecodeBatch:
    """The decode batch of one model and its open streams (those in it, and those outside it with their own state:
    new, ahead of their reader, rotated out).  Its lists change under its own lock, so `count` is read from any
    thread; everything else is called by the engine's turn alone."""

    def __init__(self, cache: KVCache, name: str, max_rows: int, stats: EngineStats):
        self.cache, self.name, self.max_rows, self.stats = cache, name, max_rows, stats  # cache row b = rows[b]
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

    def run(self, executor: Steps) -> tuple[list[Generation], np.ndarray, float]:
        """One decode step's onnxruntime call: the rows, their (B, V) logits, when it ended."""
        rows, seconds = self.rows, self.stats.seconds
        begun = time.perf_counter()
        if self.cache.grow(rows + self.outside):  # the longest row reached the end of the cache's room
            self.stats.rebuilds += 1
            seconds["regroup"] += time.perf_counter() - begun
        begun = time.perf_counter()
        logits = executor.step(np.array([[s.last] for s in rows], np.int64), self.cache)
        ended = time.perf_counter()
        seconds["run"] += ended - begun
        return rows, logits, ended

    def hand_out(self, rows: list[Generation], logits: np.ndarray, ended: float) -> None:
        """Each row's token from the step's logits, to its reader."""
        self.stats.step(len(rows))
        plain = [b for b, s in enumerate(rows) if s.plain]  # argmax rows, all at once
        chosen = {}
        if plain:
            tokens, logprobs = greedy_rows(logits if len(plain) == len(rows) else logits[plain],
                                           np.array([rows[b].params.token_logprob for b in plain]))
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
