"""Dynamic batching: one scheduler per model gathers concurrent requests into one padded onnxruntime call.

A job is (new token ids, its cached state).  A request that finds nothing queued or running runs at once in
its own thread; otherwise the scheduler gathers what is waiting (up to max_batch, at most max_wait) and splits
it into runs of similar length.  Rows are laid out as the graph's cache layout wants (service/kvcache.py: padded on
the left under the attention mask, or each row from slot 0 with its length), so each row's result equals the same
job run alone.  The queue is bounded; a job whose deadline has passed is dropped
before it runs; results are cut back to each row's own slots.  The scheduler decides what runs when; the calls
themselves (feeds, onnxruntime) are its executor's (service/executor.py).

One call of the batching thread takes at most max_tokens new tokens (rows x padded length): jobs past the budget
wait for the next call, and a prompt longer than the budget runs in pieces, each piece's cache carried into the
next (a KV-cached forward equals the whole one); a prompt of a model whose RoPE frequencies follow the length
(LoadedModel.whole_prompts) runs whole, since every key of it is rotated for the whole prompt's length.  The decode
loop (service/decoder.py) steps its streams between two calls, so a burst of long prompts delays the running
streams by one budget's worth of prefill per token, not by every prompt at once; the budget also bounds the
largest call's memory (its logits are tokens x vocabulary).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from concurrent.futures import Future
from contextlib import contextmanager
from typing import overload

import numpy as np

from service.artifacts import LoadedModel
from service.errors import DeadlineExceeded, ResourceExhausted, Unavailable
from service.executor import Executor
from service.jobs import Job, MapRequest, Result, Step

log = logging.getLogger(__name__)

MAX_TOKENS = 256  # new tokens in one call of the batching thread: 2 prompts of 128, or a piece of a longer one


class Scheduler:
    def __init__(self, model: LoadedModel, max_batch: int = 32, max_wait_ms: float = 2.0, max_queue: int = 64,
                 on_batch=None, max_tokens: int = MAX_TOKENS):
        self.model, self.max_batch, self.max_wait = model, max_batch, max_wait_ms / 1000.0
        self.max_tokens = max(1, max_tokens)
        self.whole_prompts = model.whole_prompts  # a length-dependent RoPE scaling: every prompt runs in one call
        self.queue: queue.Queue[Job | None] = queue.Queue(maxsize=max_queue)
        self.closed = False
        self.executor = Executor(model, on_batch)  # builds the feeds and runs onnxruntime (on_batch: each call's rows)
        self.pieces = 0  # pieces of prompts longer than the budget run so far (tests)
        self._cond = threading.Condition()
        self._running = False  # a batch (or an inline job) holds the session
        self._queued = 0  # jobs submitted to the queue and not yet settled (queued, or waiting for their next piece)
        self._batches = 0  # batches the batching thread has run (exclusive() gives queued jobs a turn)
        self._waiters: list[int] = []  # the batch count each exclusive() caller saw when it began waiting
        self._pending: deque[Job] = deque()  # taken from the queue, waiting for a call (their next piece)
        self.decoder = None  # service.decoder.Decoder: Generate's decode loop, closed with the scheduler
        self.thread = threading.Thread(target=self._loop, name=f"batch-{model.name}", daemon=True)
        self.thread.start()

    def submit(self, job: Job) -> Future:
        """Queue a job; when nothing is queued or running, run it at once in the caller's thread instead (no
        hand-off to the batching thread and back: ~0.1-0.2 ms of a lone request's latency)."""
        if self.closed:
            raise Unavailable("server is shutting down")
        with self._cond:  # a job over the budget queues: its pieces take turns with the decode loop
            inline = self._queued == 0 and not self._running and self._piece(job) == len(job.ids)
            if inline:
                self._running = True
            else:
                try:
                    self.queue.put_nowait(job)
                except queue.Full:
                    raise ResourceExhausted(f"queue for model {self.model.name} is full ({self.queue.maxsize} "
                                            "waiting); retry later") from None
                self._queued += 1
        if inline:
            try:
                self._execute([job])
            finally:
                self._release(batch=True)  # a prompt's turn like a batch: a waiting decode step goes next
        return job.future

    @property
    def prompts_waiting(self) -> bool:
        """Whether jobs are queued or waiting for their next piece (the decode loop gathers new streams meanwhile)."""
        return self._queued > 0

    def _release(self, batch: bool = False) -> None:
        with self._cond:
            self._batches += batch
            self._running = False
            self._cond.notify_all()

    @contextmanager
    def exclusive(self):
        """Hold the session for work outside the queue (the decode loop's steps): waits out a running batch, and
        lets jobs already queued run first (one batch), so a new stream's prompt waits at most one decode step;
        requests arriving meanwhile queue up and run together after it.  Once that batch has run the caller goes
        before the next one (a long prompt's pieces and the decode steps alternate)."""
        with self._cond:
            turn = self._batches
            self._waiters.append(turn)
            try:
                while self._running or (self._queued and self._batches == turn):
                    self._cond.wait()
            finally:
                self._waiters.remove(turn)
            self._running = True
        try:
            yield
        finally:
            self._release()

    def close(self) -> None:
        self.closed = True
        if self.decoder is not None:
            self.decoder.close()
        self.queue.put(None)
        self.thread.join(timeout=10)

    # --- the batching loop ------------------------------------------------------------------------------

    def _divides(self, job: Job) -> bool:
        """Whether the job may run in pieces: not one wanting full maps (every row must span the same keys), nor
        any of a model whose RoPE frequencies follow the length (every key of a prompt is rotated for the whole
        prompt's length, which a piece's call does not see)."""
        return job.divisible and not self.whole_prompts

    def _piece(self, job: Job) -> int:
        """The new tokens of the job's next call: what is left, up to the budget where it may run in pieces."""
        left = len(job.ids) - job.done
        return min(left, self.max_tokens) if self._divides(job) else left

    def _gather(self) -> None:
        """Move queued jobs behind the pending ones, up to max_batch; under load wait up to max_wait for more (a
        lone request runs at once; requests pile up while a batch computes)."""
        if self.queue.empty():
            return
        until = time.monotonic() + self.max_wait
        while len(self._pending) < self.max_batch:
            remaining = until - time.monotonic()
            try:
                job = self.queue.get(timeout=max(remaining, 0)) if remaining > 0 else self.queue.get_nowait()
            except queue.Empty:
                break
            if job is None:
                self.queue.put(None)  # keep the stop marker for the outer loop
                break
            self._pending.append(job)

    def _take(self) -> list[Job]:
        """The pending jobs the next call runs, oldest first: up to max_batch rows and max_tokens new tokens (rows x
        the longest piece); a job that cannot run in pieces is taken alone even past the budget."""
        taken, longest = [], 0
        while self._pending and len(taken) < self.max_batch:
            job = self._pending[0]
            piece = self._piece(job)
            if taken and (len(taken) + 1) * max(longest, piece) > self.max_tokens:
                break
            taken.append(self._pending.popleft())
            longest = max(longest, piece)
        return taken

    def _loop(self) -> None:
        while True:
            if not self._pending:
                first = self.queue.get()
                if first is None:
                    return
                self._pending.append(first)
            with self._cond:  # wait out an inline run or a decode step, and let an owed decode step go first
                while self._running or any(t != self._batches for t in self._waiters):
                    self._cond.wait()
                self._running = True
            settled = 0
            try:
                self._gather()
                jobs = self._take()
                self._execute(jobs)
                unfinished = [j for j in jobs if not j.future.done()]
                self._pending.extendleft(reversed(unfinished))  # their next piece goes first next time
                settled = len(jobs) - len(unfinished)
            finally:
                with self._cond:
                    self._queued -= settled
                self._release(batch=True)

    def _execute(self, jobs: list[Job]) -> None:
        """Run the next piece of every live job (not cancelled, deadline not passed) and settle the futures of the
        jobs whose last piece ran; the others stay running (the batching thread runs their next piece)."""
        now = time.monotonic()
        live = []
        for job in jobs:
            if job.done == 0 and not job.future.set_running_or_notify_cancel():
                continue
            if job.deadline is not None and now > job.deadline:
                job.future.set_exception(DeadlineExceeded("deadline passed while queued; the work was not run"))
                continue
            live.append(job)
        if not live:
            return
        longest = max(self._piece(j) for j in live)
        pieces = {}
        for job in live:
            n = min(len(job.ids) - job.done, longest) if self._divides(job) else len(job.ids) - job.done
            last = job.done + n == len(job.ids)
            pieces[id(job)] = Job(job.ids[job.done:job.done + n], job.state, job.attention if last else
                                  MapRequest.NONE, job.deadline, job.want_state or not last, job.last_only,
                                  enqueued=job.enqueued)
            self.pieces += not (last and job.done == 0)
        owner = {id(pieces[id(j)]): j for j in live}
        try:
            for group in self.buckets([pieces[id(j)] for j in live]):
                for piece, result in zip(group, self.run(group), strict=True):
                    self._advance(owner[id(piece)], piece, result)
        except Exception as err:  # never let one bad batch kill the loop
            log.exception("batch of %d failed on model %s", len(live), self.model.name)
            for job in live:
                if not job.future.done():
                    job.future.set_exception(err)

    @staticmethod
    def _advance(job: Job, piece: Job, result: Result) -> None:
        """Carry a piece's result into its job; the job's result once its last piece has run."""
        first, job.done = job.done, job.done + len(piece.ids)
        if job.reduce is not None and not job.last_only:  # the piece's rows reduced now, its logits let go
            job.reduced += job.reduce(result.logits, first)
            result.logits = result.logits[-1:]
        if job.done < len(job.ids):
            if not job.parts:
                job.parts = [[], 0.0, result.queue_ms]
            if not job.last_only and job.reduce is None:  # an earlier piece's last logits are nobody's
                job.parts[0].append(result.logits)
            job.parts[1] += result.compute_ms
            job.state = result.state
            return
        if job.parts:  # the whole prompt's logits, as one call would give them
            logits, compute_ms, queue_ms = job.parts
            result = Result(np.concatenate(logits + [result.logits]), result.attentions, result.state, queue_ms,
                            compute_ms + result.compute_ms, result.batch_size)
            job.parts = []
        if job.reduce is not None:
            result.reduced, job.reduced = job.reduced, []
        job.future.set_result(result)

    @staticmethod
    def buckets(jobs: list[Job], slack: float = 1.25, extra: int = 8) -> list[list[Job]]:
        """Split a gathered batch into runs of similar length, so a short prompt is not padded to the longest
        one: a group grows while its longest job is within slack x its shortest (+ extra positions).  Jobs that
        want attention maps never share a call with jobs that do not: a call computes maps for every row it holds,
        and runs the exact graph instead of the fast one."""
        groups: list[list[Job]] = []
        maps = lambda j: j.attention is not MapRequest.NONE  # noqa: E731
        for job in sorted(jobs, key=lambda j: (maps(j), j.length)):
            if groups and maps(job) == maps(groups[-1][0]) and job.length <= slack * groups[-1][0].length + extra:
                groups[-1].append(job)
            else:
                groups.append([job])
        return groups

    @overload
    def run(self, work: list[Job]) -> list[Result]: ...

    @overload
    def run(self, work: Step) -> np.ndarray: ...

    def run(self, work):
        """Every onnxruntime call of the model, made by the executor (service/executor.py): a group of jobs (a
        Result per job), or a decode Step (each row's (B, V) logits; the step's cache carries its outputs).  The
        one place every call passes (tests slow or hold them here)."""
        return self.executor.step(work) if isinstance(work, Step) else self.executor.run(work)

    @property
    def rows_run(self) -> int:
        """Rows sent to onnxruntime so far (metrics, tests)."""
        return self.executor.rows_run
