"""Dynamic batching: one scheduler per model gathers concurrent requests into one padded onnxruntime call.

A job is (new token ids, its cached state).  A request that finds nothing queued or running runs at once in
its own thread; otherwise the scheduler gathers what is waiting (up to max_batch, at most max_wait) and splits
it into runs of similar length.  Rows are padded on the left of both the cache and the new tokens,
with the attention mask marking every pad slot 0; positions come from the mask in the graph, so each row's
result equals the same job run alone.  The queue is bounded; a job whose deadline has passed is dropped
before it runs; results are cut back to each row's own slots.
"""

from __future__ import annotations

import enum
import logging
import queue
import threading
import time
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np

from service.artifacts import LoadedModel
from service.errors import DeadlineExceeded, ResourceExhausted, Unavailable

log = logging.getLogger(__name__)


class MapRequest(enum.Enum):
    """Which attention probabilities a request wants: one type from the request down to onnxruntime."""

    NONE = "none"
    LAST_ROW = "last_row"  # the last query's row over every key
    FULL = "full"  # every query row


@dataclass
class Job:
    ids: np.ndarray  # (T,) int64 new tokens
    state: list[np.ndarray] | None  # per state tensor (H, P, Dh), or None for no past
    attention: MapRequest = MapRequest.NONE
    deadline: float | None = None  # time.monotonic() seconds
    want_state: bool = True  # False for Predict / Score: the carried tensors are not fetched from onnxruntime
    future: Future = field(default_factory=Future)
    enqueued: float = field(default_factory=time.monotonic)

    @property
    def length(self) -> int:
        """Key positions this job occupies: its cached past plus its new tokens."""
        return len(self.ids) + (0 if self.state is None else self.state[0].shape[1])


@dataclass
class Step:
    """One step of the decode loop (service/decoder.py), already batched: every row's next token, the mask over its
    left-padded cache plus that token, and the carried tensors as the previous step returned them (B first)."""

    ids: np.ndarray  # (B, 1) int64
    mask: np.ndarray  # (B, P + 1) int64
    state: list[np.ndarray]  # per state tensor: (B, H, P, Dh), or (B, ...) for a fixed-size one

    def __len__(self) -> int:
        return len(self.ids)


@dataclass
class Result:
    logits: np.ndarray  # (T, V)
    attentions: np.ndarray | None  # (L, H, T, P + T); (L, H, 1, P + T) for MapRequest.LAST_ROW
    state: list[np.ndarray]  # per state tensor (H, P + T, Dh)
    queue_ms: float
    compute_ms: float
    batch_size: int


class Scheduler:
    def __init__(self, model: LoadedModel, max_batch: int = 8, max_wait_ms: float = 2.0, max_queue: int = 64,
                 on_batch=None):
        self.model, self.max_batch, self.max_wait = model, max_batch, max_wait_ms / 1000.0
        self.on_batch = on_batch  # called with the size of every batch sent to onnxruntime
        self.queue: queue.Queue[Job | None] = queue.Queue(maxsize=max_queue)
        self.closed = False
        self.rows_run = 0  # rows sent to onnxruntime so far (for metrics and tests)
        self._cond = threading.Condition()
        self._running = False  # a batch (or an inline job) holds the session
        self._queued = 0  # jobs put in the queue and not yet taken into a batch
        self._batches = 0  # batches the batching thread has run (exclusive() gives queued jobs a turn)
        self.decoder = None  # service.decoder.Decoder: Generate's decode loop, closed with the scheduler
        self.thread = threading.Thread(target=self._loop, name=f"batch-{model.name}", daemon=True)
        self.thread.start()

    def submit(self, job: Job) -> Future:
        """Queue a job; when nothing is queued or running, run it at once in the caller's thread instead (no
        hand-off to the batching thread and back: ~0.1-0.2 ms of a lone request's latency)."""
        if self.closed:
            raise Unavailable("server is shutting down")
        with self._cond:
            inline = self._queued == 0 and not self._running
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
                self._release()
        return job.future

    def _release(self, batch: bool = False) -> None:
        with self._cond:
            self._batches += batch
            self._running = False
            self._cond.notify_all()

    @contextmanager
    def exclusive(self):
        """Hold the session for work outside the queue (the decode loop's steps): waits out a running batch, and
        lets jobs already queued run first (one batch), so a new stream's prompt waits at most one decode step;
        requests arriving meanwhile queue up and run together after it."""
        with self._cond:
            turn = self._batches
            while self._running or (self._queued and self._batches == turn):
                self._cond.wait()
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

    def _gather(self, first: Job) -> list[Job]:
        jobs = [first]
        if self.queue.empty():
            return jobs  # a lone request runs at once; under load, requests pile up while a batch computes
        until = time.monotonic() + self.max_wait
        while len(jobs) < self.max_batch:
            remaining = until - time.monotonic()
            try:
                job = self.queue.get(timeout=max(remaining, 0)) if remaining > 0 else self.queue.get_nowait()
            except queue.Empty:
                break
            if job is None:
                self.queue.put(None)  # keep the stop marker for the outer loop
                break
            jobs.append(job)
        return jobs

    def _loop(self) -> None:
        while True:
            first = self.queue.get()
            if first is None:
                return
            with self._cond:  # wait out an inline run; what arrives meanwhile joins this batch
                while self._running:
                    self._cond.wait()
                self._running = True
            try:
                jobs = self._gather(first)
                with self._cond:
                    self._queued -= len(jobs)
                self._execute(jobs)
            finally:
                self._release(batch=True)

    def _execute(self, jobs: list[Job]) -> None:
        """Run the live jobs (not cancelled, deadline not passed) and settle every job's future."""
        now = time.monotonic()
        live = []
        for job in jobs:
            if not job.future.set_running_or_notify_cancel():
                continue
            if job.deadline is not None and now > job.deadline:
                job.future.set_exception(DeadlineExceeded("deadline passed while queued; the work was not run"))
                continue
            live.append(job)
        if not live:
            return
        try:
            for group in self.buckets(live):
                for job, result in zip(group, self.run(group), strict=True):
                    job.future.set_result(result)
        except Exception as err:  # never let one bad batch kill the loop
            log.exception("batch of %d failed on model %s", len(live), self.model.name)
            for job in live:
                if not job.future.done():
                    job.future.set_exception(err)

    @staticmethod
    def buckets(jobs: list[Job], slack: float = 1.25, extra: int = 8) -> list[list[Job]]:
        """Split a gathered batch into runs of similar length, so a short prompt is not padded to the longest
        one: a group grows while its longest job is within slack x its shortest (+ extra positions)."""
        groups: list[list[Job]] = []
        for job in sorted(jobs, key=lambda j: j.length):
            if groups and job.length <= slack * groups[-1][0].length + extra:
                groups[-1].append(job)
            else:
                groups.append([job])
        return groups

    def run(self, jobs: list[Job] | Step) -> list[Result] | tuple[np.ndarray, list[np.ndarray]]:
        """Every onnxruntime call of the model goes through here.  A group of jobs: one call, left-padded (new
        tokens to the longest, the KV cache to the longest past; a variant's fixed-size state, sequence_axis null,
        stacked as it is, one row per job), a Result per job.  A decode Step: its feeds as they are, fetching
        only the logits and the carried tensors: ((B, V) logits of the new token, the state for the next step)."""
        m = self.model
        if isinstance(jobs, Step):
            return self._step(jobs)
        B = len(jobs)
        T = max(len(j.ids) for j in jobs)
        P = max(0 if j.state is None else j.state[0].shape[1] for j in jobs)  # state[0] is a KV tensor
        ids = np.zeros((B, T), np.int64)
        mask = np.zeros((B, P + T), np.int64)
        growing = [spec.get("sequence_axis") is not None for spec in m.state]
        initial = None if all(growing) else m.empty_state(1)  # only a variant's fixed-size state needs it
        state = [np.zeros((B, m.kv_heads, P, m.head_dim), np.float32) if g else np.repeat(initial[s], B, axis=0)
                 for s, g in enumerate(growing)]
        for b, j in enumerate(jobs):
            t, p = len(j.ids), 0 if j.state is None else j.state[0].shape[1]
            ids[b, T - t:] = j.ids
            mask[b, P - p:P] = 1
            mask[b, P + T - t:] = 1
            for s, tensor in enumerate(j.state or []):
                if growing[s]:
                    state[s][b, :, P - p:] = tensor
                else:
                    state[s][b] = tensor
        feeds = {"input_ids": ids, "attention_mask": mask}
        for spec, tensor in zip(m.state, state, strict=True):
            feeds[spec["input"]] = tensor
        names = ["logits"] + (["attentions"] if any(j.attention is not MapRequest.NONE for j in jobs) else [])
        want_state = any(j.want_state for j in jobs)
        names += [spec["output"] for spec in m.state] if want_state else []
        start = time.monotonic()
        self.rows_run += B
        if self.on_batch is not None:
            self.on_batch(B)
        out = dict(zip(names, m.session.run(names, feeds), strict=True))
        compute_ms = (time.monotonic() - start) * 1000
        results = []
        for b, j in enumerate(jobs):
            t, p = len(j.ids), 0 if j.state is None else j.state[0].shape[1]
            # this row's own key slots: its past, then its new tokens; one range (a view, no copy) when either
            # part fills its whole span
            keys = slice(P - p, P + T) if t == T else slice(P + T - t, P + T) if p == 0 else \
                np.r_[P - p:P, P + T - t:P + T]
            first = T - 1 if j.attention is MapRequest.LAST_ROW else T - t  # query rows the job wants
            att = None if j.attention is MapRequest.NONE else out["attentions"][b][:, :, first:][..., keys]
            rows = [out[spec["output"]][b][:, keys] if g else out[spec["output"]][b]
                    for spec, g in zip(m.state, growing, strict=True)] if j.want_state else None
            results.append(Result(out["logits"][b, T - t:], att, rows, (start - j.enqueued) * 1000, compute_ms, B))
        return results

    def _step(self, step: Step) -> tuple[np.ndarray, list[np.ndarray]]:
        m = self.model
        feeds = {"input_ids": step.ids, "attention_mask": step.mask}
        for spec, tensor in zip(m.state, step.state, strict=True):
            feeds[spec["input"]] = tensor
        names = ["logits"] + [spec["output"] for spec in m.state]
        self.rows_run += len(step)
        if self.on_batch is not None:
            self.on_batch(len(step))
        out = m.session.run(names, feeds)
        return out[0][:, -1], out[1:]
