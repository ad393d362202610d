"""Continuous batching for Generate: one decode loop per model steps every active stream together.

A stream's prompt goes through the model's scheduler like any request (batched with Predict and other prefills);
from its second token on, the stream joins this loop, which makes ONE onnxruntime call per step for every stream
in its batch.  The batch's caches are one KVCache (service/kvcache.py) in the layout of the graph the steps run on
(service/layouts.py: left-padded rows whose outputs are the next step's inputs, or shared buffers each step writes
into); the loop never asks which.  The batch is regrouped only at a step boundary where streams join or leave: a
stream whose prompt has run (several together while the scheduler still has prompts to run: up to GATHER steps),
one finished, cancelled or past its deadline, one too far ahead of its reader (LOOKAHEAD) while another reader
waits, or, when more streams are open than max_rows, the rows that ran ROTATE steps giving way to those waiting.
Each row's inputs are exactly what the scheduler would build for it, so every stream's tokens are those it gets
alone.
The loop takes the session through Scheduler.exclusive(), so its steps and the scheduler's batches take turns.
A step or rebuild that fails ends the streams it touched (out of memory: RESOURCE_EXHAUSTED), never the loop.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import numpy as np

from service.errors import DeadlineExceeded, ResourceExhausted, ServiceError, Unavailable
from service.generation import Emitted, Generation, greedy_rows
from service.jobs import Step
from service.kvcache import KVCache
from service.sampling import log_softmax
from service.scheduler import Scheduler

__all__ = ["Decoder", "Emitted", "Generation", "greedy_rows"]  # the stream's types are also imported from here

log = logging.getLogger(__name__)

LOOKAHEAD = 8  # tokens a stream may run ahead of its reader: readers a few tokens apart do not split the batch
ROTATE = 8  # steps a row keeps its place when more streams wait than max_rows allows
GATHER = 4  # steps a new stream may wait to join a running batch while more prompts are being prefilled


class Decoder:
    """The decode loop of one model (its thread starts with the first stream and waits while none can step)."""

    def __init__(self, scheduler: Scheduler, max_rows: int = 64, on_step: Callable[[int], None] | None = None):
        self.scheduler, self.max_rows, self.on_step = scheduler, max(1, max_rows), on_step
        self._cond = threading.Condition()
        self._joining: list[Generation] = []  # added, not yet seen by the loop
        self._rows: list[Generation] = []  # the batch, in row order
        self.cache: KVCache = scheduler.executor.cache()  # its caches, row b = self._rows[b]
        self._outside: list[Generation] = []  # streams with their own state: new, ahead of their reader, rotated out
        self._sleeping = False
        self.closed = False
        self.steps = 0  # onnxruntime calls made by the loop (tests and metrics)
        self.rebuilds = 0  # batch rebuilds (joins and leaves): the only copies of the caches
        self.taken_out = 0  # rows that left the batch with their state (ahead of their reader, or rotated)
        # seconds of the loop's thread, by what it did (bench/serving_cost.py reads them): waiting for the session
        # (the scheduler's batches), inside onnxruntime, choosing and handing out tokens, rebuilding the batch
        self.seconds = {"wait": 0.0, "run": 0.0, "tokens": 0.0, "regroup": 0.0}
        self._thread: threading.Thread | None = None

    def add(self, stream: Generation) -> None:
        with self._cond:
            if self.closed:
                raise Unavailable("server is shutting down")
            stream.since = self.steps
            self._joining.append(stream)
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name=f"decode-{self.scheduler.model.name}",
                                                daemon=True)
                self._thread.start()
            self._cond.notify()

    def wake(self) -> None:
        """A reader took a token: its stream may step again.  Only a sleeping loop needs the lock (it re-plans
        with the flag up and the lock held, so a token taken meanwhile is seen either way)."""
        if self._sleeping:
            with self._cond:
                self._cond.notify()

    def close(self) -> None:
        with self._cond:
            self.closed = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout=10)

    @property
    def active(self) -> int:
        with self._cond:
            return len(self._rows) + len(self._outside) + len(self._joining)

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not (self._joining or self._rows or self._outside or self.closed):
                    self._cond.wait()
                if self.closed and not (self._joining or self._rows or self._outside):
                    return
                self._outside += self._joining  # new streams join at this step boundary
                self._joining = []
                plan = self._plan()
                if plan is None and not self._steppable():  # every stream is ahead of its reader
                    self._sleeping = True  # re-planned with the flag up: a token taken meanwhile is seen either way
                    if self._plan() is None and not self._steppable():
                        self._cond.wait(timeout=0.05)
                    self._sleeping = False
                    continue
            touched = self._rows + (plan[2] if plan is not None else [])  # a failure ends these streams
            try:
                asked = time.perf_counter()
                # the rebuild too holds the session: its copies beside a prompt's call (both threads of onnxruntime
                # busy) ran tens of times slower than alone
                with self.scheduler.exclusive():
                    begun = time.perf_counter()
                    self.seconds["wait"] += begun - asked
                    if plan is not None:
                        self._regroup(*plan)
                        self.seconds["regroup"] += time.perf_counter() - begun
                    ran = self._run() if self._steppable() else None
                if ran is not None:
                    self._hand_out(*ran)
            except Exception as err:  # a failed step or rebuild ends its streams, never the loop
                self._fail(touched, err)

    def _fail(self, streams: list[Generation], err: Exception) -> None:
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
        with self._cond:
            self._rows = []
            self._outside = [s for s in self._outside if id(s) not in ended]
        self.cache.clear()
        for s in streams:
            if not (s.done or s.cancelled):  # (a finished stream's reader has had its last token)
                s.out.put(err)
                if s.signal is not None:
                    s.signal.set()
            s.done, s.state = True, None

    def _steppable(self) -> bool:
        return bool(self._rows) and all(s.out.qsize() < LOOKAHEAD for s in self._rows)

    def _alive(self, s: Generation, now: float) -> bool:
        if s.cancelled or s.done or not s.is_active():
            return False
        if s.deadline is not None and now > s.deadline:
            s.cancelled = True
            s.out.put(DeadlineExceeded("deadline passed mid-stream"))
            if s.signal is not None:
                s.signal.set()
            return False
        return True

    def _plan(self) -> tuple[list[int], list[int], list[Generation]] | None:
        """How the batch changes at this boundary: None when it stays as it is, else (rows kept, rows leaving with
        their state, streams coming in).  Finished, cancelled and expired streams leave; rows LOOKAHEAD ahead of
        their readers leave while another reader waits for a token or a stream waits to come in (readers a few
        tokens apart only pause the loop); with more streams than max_rows, rows that ran ROTATE steps give way."""
        now, outside = time.monotonic(), len(self._outside)
        self._outside = [s for s in self._outside if self._alive(s, now)]
        live = [b for b, s in enumerate(self._rows) if self._alive(s, now)]
        ahead = [b for b in live if self._rows[b].out.qsize() >= LOOKAHEAD]
        ready = [b for b in live if self._rows[b].out.qsize() < LOOKAHEAD]
        waiting = sorted((s for s in self._outside if s.out.qsize() <= LOOKAHEAD // 2), key=lambda s: s.since)
        starving = any(self._rows[b].out.qsize() == 0 for b in ready)
        keep, out = (ready, ahead) if ahead and (starving or waiting) else (live, [])
        room = self.max_rows - len(keep)
        if len(waiting) > room:  # oldest rows first, as many as streams wait beyond the room
            due = sorted((b for b in keep if self.steps - self._rows[b].since >= ROTATE),
                         key=lambda b: self._rows[b].since)[:len(waiting) - room]
            keep, out, room = [b for b in keep if b not in due], out + due, room + len(due)
        enter = waiting[:max(room, 0)]
        if (enter and keep and not out and len(live) == len(self._rows) and self.scheduler.prompts_waiting
                and all(self.steps - s.since < GATHER for s in enter)):
            enter = []  # more prompts are being prefilled: their streams join together, one rebuild for several
        if len(live) == len(self._rows) and not out and not enter:
            # a stream gone from outside the batch may leave the cache far larger than the rest need
            shrink = len(self._outside) < outside and self.cache.oversized(self._rows + self._outside)
            return (keep, [], []) if shrink else None
        return keep, out, enter

    def _regroup(self, keep: list[int], out: list[int], enter: list[Generation]) -> None:
        """Rebuild the batch: kept rows (in the order the cache gives them), then the streams coming in."""
        rows = self._rows
        for b in out:  # leaving with its own state (a copy: the batch's memory is about to be reused)
            s = rows[b]
            s.state, s.since = self.cache.take(b), self.steps
            self.taken_out += 1
        entering = {id(s) for s in enter}
        # sized for the streams outside too (ahead of their readers, rotated out: they come back), so memory is
        # freed where a stream has gone, not where one steps aside
        back = [s for s in self._outside if id(s) not in entering] + [rows[b] for b in out]
        keep = self.cache.regroup(keep, [s.state for s in enter], [rows[b] for b in keep] + enter + back)
        with self._cond:  # both lists at once: `active` never sees a stream in neither
            self._outside = back
            self._rows = [rows[b] for b in keep] + enter
        self.rebuilds += 1
        for s in enter:
            s.state, s.since = None, self.steps

    def _run(self) -> tuple[list[Generation], np.ndarray, float]:
        """One decode step's onnxruntime call (the session held): the rows, their (B, V) logits, when it ended."""
        rows = self._rows
        begun = time.perf_counter()
        if self.cache.grow(rows + self._outside):  # the longest row reached the end of the cache's room
            self.rebuilds += 1
            self.seconds["regroup"] += time.perf_counter() - begun
        begun = time.perf_counter()
        logits = self.scheduler.run(Step(np.array([[s.last] for s in rows], np.int64), self.cache))
        ended = time.perf_counter()
        self.seconds["run"] += ended - begun
        return rows, logits, ended

    def _hand_out(self, rows: list[Generation], logits: np.ndarray, ended: float) -> None:
        """Each row's token from the step's logits, to its reader (the session already free for prompts)."""
        self.steps += 1
        if self.on_step is not None:
            self.on_step(len(rows))
        plain = [b for b, s in enumerate(rows) if s.plain]  # argmax rows, all at once
        chosen = {}
        if plain:
            tokens, logprobs = greedy_rows(logits if len(plain) == len(rows) else logits[plain])
            chosen = {b: (tokens[i], logprobs[i]) for i, b in enumerate(plain)}
        for b, s in enumerate(rows):
            s.cached += 1
            if b in chosen:
                token, logprob = chosen[b]
                s.out.put(s.emit(int(token), float(logprob), []))
            else:
                s.out.put(s.take(log_softmax(logits[b])))
            if s.signal is not None:
                s.signal.set()
        self.seconds["tokens"] += time.perf_counter() - ended
