"""Continuous batching for Generate: one decode loop per model steps every active stream together.

A stream's prompt goes through the model's scheduler like any request (batched with Predict and other prefills);
from its second token on, the stream joins this loop, which makes ONE onnxruntime call per step for every active
stream (each row its own KV cache, left-padded to the longest past by Scheduler.run), samples each row's next token
with the stream's own generator, and hands it to the stream's queue.  Streams join at the next step boundary and
leave (finished, cancelled, deadline passed) without stalling the others.  The loop takes the session through
Scheduler.exclusive(), so its steps and the scheduler's batches take turns instead of competing for the cores.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from service.errors import DeadlineExceeded, ServiceError, Unavailable
from service.sampling import log_softmax, pick
from service.scheduler import Job, Result, Scheduler

log = logging.getLogger(__name__)


@dataclass
class Stream:
    """One Generate request's decoding: sampling settings, what it produced, and where its tokens go."""

    prompt_len: int
    max_new_tokens: int
    temperature: float
    top_k: int
    top_p: float
    rng: np.random.Generator
    decode_text: Callable[[int], str]  # incremental: the text so far after one more token
    stop: list[str] = field(default_factory=list)
    limit: int | None = None  # the model's max_positions
    deadline: float | None = None
    generated: int = 0
    state: list[np.ndarray] | None = None
    last: int = -1
    cancelled: bool = False
    is_active: Callable[[], bool] = lambda: True  # the RPC's liveness: the loop drops a stream whose client left
    out: queue.Queue = field(default_factory=queue.Queue)  # (token, logprob, text, reason) or an exception

    def advance(self, result: Result) -> tuple[int, float, str, str]:
        """Sample the next token from a step's result; the finish reason is '' while the stream goes on."""
        self.state = result.state
        logp = log_softmax(result.logits[-1])
        token = pick(logp, self.temperature, self.top_k, self.top_p, self.rng)
        self.generated += 1
        self.last = token
        text = self.decode_text(token)
        reason = ""
        if self.stop and any(s and s in text for s in self.stop):
            reason = "stop"
        elif self.limit is not None and self.prompt_len + self.generated >= self.limit:
            reason = "max_positions"  # the next token would need a position past the learned table
        elif self.generated >= self.max_new_tokens:
            reason = "length"
        return token, float(logp[token]), text, reason


LOOKAHEAD = 2  # tokens a stream may run ahead of its reader: enough to keep steps full, little work to waste


class Decoder:
    """The decode loop of one model (its thread starts with the first stream and waits while none is active)."""

    def __init__(self, scheduler: Scheduler, max_rows: int = 64, on_step: Callable[[int], None] | None = None):
        self.scheduler, self.max_rows, self.on_step = scheduler, max_rows, on_step
        self._cond = threading.Condition()
        self._joining: list[Stream] = []
        self._active: list[Stream] = []
        self.closed = False
        self.steps = 0  # onnxruntime calls made by the loop (tests and metrics)
        self._thread: threading.Thread | None = None

    def add(self, stream: Stream) -> None:
        with self._cond:
            if self.closed:
                raise Unavailable("server is shutting down")
            self._joining.append(stream)
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name=f"decode-{self.scheduler.model.name}",
                                                daemon=True)
                self._thread.start()
            self._cond.notify()

    def wake(self) -> None:
        """A reader took a token: its stream may step again."""
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
            return len(self._active) + len(self._joining)

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not (self._joining or self._active or self.closed):
                    self._cond.wait()
                if self.closed and not (self._joining or self._active):
                    return
                self._active += self._joining  # new streams join at this step boundary
                self._joining = []
                batch = self._live()
                if not batch and self._active:  # every stream is LOOKAHEAD tokens ahead of its reader
                    self._cond.wait(timeout=0.05)
                    continue
            if not batch:
                continue
            try:
                self._step(batch)
            except Exception as err:  # a failed step ends its streams, never the loop
                if not isinstance(err, ServiceError):
                    log.exception("decode step of %d streams failed on model %s", len(batch),
                                  self.scheduler.model.name)
                for s in batch:
                    s.out.put(err)
                self._drop(batch)

    def _live(self) -> list[Stream]:
        """Drop cancelled streams and those whose deadline passed; the rows for this step: streams not too far ahead
        of their readers, oldest first, rotated so that more than max_rows streams all advance."""
        now = time.monotonic()
        keep = []
        for s in self._active:
            if s.cancelled or not s.is_active():
                continue
            if s.deadline is not None and now > s.deadline:
                s.out.put(DeadlineExceeded("deadline passed mid-stream"))
                continue
            keep.append(s)
        ready = [s for s in keep if s.out.qsize() < LOOKAHEAD]
        batch = ready[:self.max_rows]
        if len(ready) > self.max_rows:  # the others go first next step
            chosen = {id(s) for s in batch}
            keep = [s for s in keep if id(s) not in chosen] + batch
        self._active = keep
        return batch

    def _step(self, batch: list[Stream]) -> None:
        jobs = [Job(np.array([s.last], np.int64), s.state) for s in batch]
        with self.scheduler.exclusive():
            results = self.scheduler.run(jobs)
        self.steps += 1
        if self.on_step is not None:
            self.on_step(len(batch))
        done = []
        for s, result in zip(batch, results, strict=True):
            item = s.advance(result)
            s.out.put(item)
            if item[3]:
                done.append(s)
        self._drop(done)

    def _drop(self, streams: list[Stream]) -> None:
        if streams:
            gone = {id(s) for s in streams}
            with self._cond:
                self._active = [s for s in self._active if id(s) not in gone]
