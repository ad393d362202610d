"""Continuous batching for Generate: the decode batch of one model, stepped by its engine (service/engine.py).

A stream's prompt goes through the model's scheduler like any request (batched with Predict and other prefills);
from its second token on, the stream joins the decode batch, which makes ONE onnxruntime call per engine step for
every stream in it.  The batch's caches are one KVCache (service/kvcache.py) in the layout of the graph the steps
run on (service/layouts.py); the batch never asks which.  The engine decides when the batch changes (service/plan.py:
joins, leaves, streams ahead of their readers, rotation) and this carries it out: a regroup at a step boundary, the
step's call through the scheduler's executor, each row's token handed to its reader.  Each row's inputs are exactly
what the scheduler would build for it, so every stream's tokens are those it gets alone.
A step or rebuild that fails ends the streams it touched (out of memory: RESOURCE_EXHAUSTED), never the engine.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from service.errors import DeadlineExceeded, ResourceExhausted, ServiceError, Unavailable
from service.generation import Emitted, Generation, NextTokens, greedy_rows
from service.jobs import Step
from service.kvcache import KVCache, State
from service.plan import Regroup
from service.sampling import log_softmax

if TYPE_CHECKING:
    from service.scheduler import Scheduler

# the stream's types are also imported from here
__all__ = ["Decoder", "Emitted", "Generation", "NextTokens", "greedy_rows"]

log = logging.getLogger(__name__)


class Decoder:
    """The decode batch of one model and its streams (those in it, those outside it with their own state, those
    joining); Generate's API (add, wake, active).  Its lists change under the engine's lock."""

    def __init__(self, scheduler: Scheduler, on_step: Callable[[int], None] | None = None):
        self.scheduler, self.on_step = scheduler, on_step
        self.engine = scheduler.engine
        self._joining: list[Generation] = []  # added, not yet seen by the engine
        self.rows: list[Generation] = []  # the batch, in row order
        self.cache: KVCache = scheduler.executor.cache()  # its caches, row b = self.rows[b]
        self.outside: list[Generation] = []  # streams with their own state: new, ahead of their reader, rotated out
        self.steps = 0  # onnxruntime calls made for the batch (tests and metrics)
        self.rebuilds = 0  # batch rebuilds (joins and leaves): the only copies of the caches
        self.taken_out = 0  # rows that left the batch with their state (ahead of their reader, or rotated)
        # seconds of the engine's thread for the batch, by what it did (bench/serving_cost.py reads them): running
        # prompts between two steps while the batch had rows, inside onnxruntime, choosing and handing out tokens,
        # rebuilding the batch
        self.seconds = {"wait": 0.0, "run": 0.0, "tokens": 0.0, "regroup": 0.0}

    @property
    def max_rows(self) -> int:
        return self.scheduler.batching.max_batch

    def add(self, stream: Generation) -> None:
        with self.engine.cond:
            if self.engine.closed:
                raise Unavailable("server is shutting down")
            stream.since = self.steps
            self._joining.append(stream)
            self.engine.signal()

    def wake(self) -> None:
        """A reader took a token: its stream may step again.  Only an engine waiting for work needs telling (it
        looks at the streams again once it is marked asleep, so a token taken meanwhile is seen either way)."""
        if self.engine.asleep:
            with self.engine.cond:
                self.engine.signal()

    def close(self) -> None:
        self.scheduler.close()

    @property
    def active(self) -> int:
        with self.engine.cond:
            return len(self.rows) + len(self.outside) + len(self._joining)

    @property
    def holding(self) -> bool:
        """Whether any stream is open (the engine's lock held)."""
        return bool(self.rows or self.outside or self._joining)

    # --- the engine's update before it decides (its lock held) -----------------------------------------------

    def prune(self) -> tuple[list[int], bool]:
        """New streams come in at this boundary; finished, cancelled and expired ones are dropped from outside the
        batch.  Returns the rows still going on, and whether the cache holds far more than the streams left need
        (a stream gone from outside the batch may leave it oversized)."""
        now = time.monotonic()
        self.outside += self._joining
        self._joining = []
        before = len(self.outside)
        self.outside = [s for s in self.outside if _alive(s, now)]
        live = [b for b, s in enumerate(self.rows) if _alive(s, now)]
        shrink = len(self.outside) < before and len(live) == len(self.rows) and \
            self.cache.oversized(self.rows + self.outside)
        return live, shrink

    # --- execute and update -------------------------------------------------------------------------------------

    def touched(self, change: Regroup | None) -> list[Generation]:
        """The streams a failed regroup or step would end: the batch's rows and those coming in."""
        return self.rows + ([self.outside[i] for i in change.enter] if change is not None else [])

    def regroup(self, change: Regroup) -> None:
        """Rebuild the batch: kept rows (in the order the cache gives them), then the streams coming in."""
        begun = time.perf_counter()
        rows, enter = self.rows, [self.outside[i] for i in change.enter]
        for b in change.out:  # leaving with its own state (a copy: the batch's memory is about to be reused)
            s = rows[b]
            s.state, s.since = self.cache.take(b), self.steps
            self.taken_out += 1
        entering = set(change.enter)
        # sized for the streams outside too (ahead of their readers, rotated out: they come back), so memory is
        # freed where a stream has gone, not where one steps aside
        back = [s for i, s in enumerate(self.outside) if i not in entering] + [rows[b] for b in change.out]
        states = [_own_state(s) for s in enter]
        rows_next = len(change.keep) + len(enter)
        with self.engine.cond:  # prompts of streams still being prefilled (queued ones too): room for them now
            prompts = sum(j.want_state for j in self.engine.pending) + sum(j.want_state for j in self.engine.queue)
        coming = min(prompts, max(self.scheduler.batching.max_batch - rows_next, 0))
        keep = self.cache.regroup(change.keep, states, [rows[b] for b in change.keep] + enter + back, coming)
        with self.engine.cond:  # both lists at once: `active` never sees a stream in neither
            self.outside = back
            self.rows = [rows[b] for b in keep] + enter
        self.rebuilds += 1
        for s in enter:
            s.state, s.since = None, self.steps
        self.seconds["regroup"] += time.perf_counter() - begun

    def run(self) -> tuple[list[Generation], np.ndarray, float]:
        """One decode step's onnxruntime call: the rows, their (B, V) logits, when it ended."""
        rows = self.rows
        begun = time.perf_counter()
        if self.cache.grow(rows + self.outside):  # the longest row reached the end of the cache's room
            self.rebuilds += 1
            self.seconds["regroup"] += time.perf_counter() - begun
        begun = time.perf_counter()
        logits = self.scheduler.run(Step(np.array([[s.last] for s in rows], np.int64), self.cache))
        ended = time.perf_counter()
        self.seconds["run"] += ended - begun
        return rows, logits, ended

    def hand_out(self, rows: list[Generation], logits: np.ndarray, ended: float) -> None:
        """Each row's token from the step's logits, to its reader."""
        self.steps += 1
        if self.on_step is not None:
            self.on_step(len(rows))
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
        self.seconds["tokens"] += time.perf_counter() - ended

    def fail(self, streams: list[Generation], err: Exception) -> None:
        """End the streams a failed step or rebuild touched (the batch's rows, and those coming in, whose caches may
        be half moved) with the error, their readers told; the batch starts again empty, the other streams outside
        it go on.  Out of memory is RESOURCE_EXHAUSTED, anything else not a ServiceError INTERNAL (logged)."""
        name = self.scheduler.model.name
        if isinstance(err, MemoryError):
            log.error("decode batch of %d streams on model %s ran out of memory; those streams end", len(streams),
                      name)
            err = ResourceExhausted(f"the worker ran out of memory for model {name}'s decode batch ({len(streams)} "
                                    "streams); this stream ended, retry later or ask for fewer tokens")
        elif not isinstance(err, ServiceError):
            log.exception("decode step of %d streams failed on model %s", len(streams), name)
        ended = {id(s) for s in streams}
        with self.engine.cond:
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
