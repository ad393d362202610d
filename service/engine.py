"""One engine per model: the one owner of its session, one thread, one loop.

Each turn of the loop (`tick`) is three parts apart:

  schedule  service/plan.py decides, from the pending prompt pieces and the decode batch's streams: which pending
            jobs run their next piece (within max_batch rows and the token budget, --batch-tokens), how the
            batch changes at this boundary (joins, leaves, rotation), whether it steps
  execute   the prompt call(s) (service/scheduler.py splits them by length and layout) and the batch's regroup and
            decode step (service/decoder.py); every onnxruntime call is the executor's (service/executor.py)
  update    futures settled (or a job's next piece put back first in line), tokens handed to the streams' readers

So a Predict arriving while streams decode runs in the next turn, beside that turn's decode step, and a long
prompt's pieces and the decode steps alternate.  A job arriving when the engine holds nothing (no job waiting, no
stream open) runs at once in its caller's thread instead, under the same session lock taken without waiting (no
hand-off to the engine's thread and back); the engine's thread takes that lock for each turn.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import TYPE_CHECKING

from service import plan
from service.errors import ResourceExhausted, Unavailable
from service.jobs import Job

if TYPE_CHECKING:
    from service.decoder import Decoder
    from service.scheduler import Scheduler


class Engine:
    """The loop of one model; `scheduler` runs its prompt jobs, `decoder` holds its decode batch."""

    def __init__(self, scheduler: Scheduler):
        self.scheduler = scheduler
        self.decoder: Decoder  # set by the scheduler right after (the decoder needs the engine)
        self.cond = threading.Condition()  # guards what arrives (jobs, streams, readers' wakes) and the lists
        self.session = threading.Lock()  # held for every turn, and by a job run in its caller's thread
        self.closed = False
        self.queue: deque[Job] = deque()  # submitted, not yet seen by the engine
        self.pending: deque[Job] = deque()  # seen, waiting for a call (their next piece)
        self.turns = 0  # turns that did something (tests)
        self._signals = 0  # bumped by every arrival; a turn that finds nothing waits for the next
        self.asleep = False  # the loop found nothing to do and waits: readers' wakes signal
        self._seen = 0
        self._thread: threading.Thread | None = None

    def start(self) -> Engine:
        self._thread = threading.Thread(target=self._loop, name=f"engine-{self.scheduler.model.name}", daemon=True)
        self._thread.start()
        return self

    @property
    def running(self) -> bool:
        """Whether its thread is running (a failed step never ends it)."""
        return self._thread is not None and self._thread.is_alive()

    def signal(self) -> None:
        """Something arrived (the lock held): a turn that found nothing to do looks again."""
        self._signals += 1
        self.cond.notify()

    @property
    def waiting(self) -> int:
        """Jobs submitted and not yet in a call (metrics: the queue's size; the --max-queue bound)."""
        return len(self.queue) + len(self.pending)

    def _idle(self) -> bool:
        return not (self.queue or self.pending or self.decoder.holding)

    def submit(self, job: Job, alone: bool) -> bool:
        """Queue a job; or, where the engine holds nothing and the job runs in one call (`alone`), take the session
        for the caller to run it at once (True: the caller runs it and then calls release())."""
        with self.cond:
            if self.closed:
                raise Unavailable("server is shutting down")
            if alone and self._idle() and self.session.acquire(blocking=False):
                return True
            if self.waiting >= self.scheduler.batching.max_queue:
                raise ResourceExhausted(f"queue for model {self.scheduler.model.name} is full "
                                        f"({self.scheduler.batching.max_queue} waiting); retry later")
            self.queue.append(job)
            self.signal()
        return False

    def release(self) -> None:
        self.session.release()

    def close(self) -> None:
        """Refuse new work; what is queued runs and open streams finish (waited for up to 10 s)."""
        with self.cond:
            self.closed = True
            self.signal()
        if self._thread is not None:
            self._thread.join(timeout=10)

    # --- the loop ---------------------------------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            if self.tick():
                continue
            # nothing to do: wait for an arrival.  Readers taking tokens signal only while `asleep` is up (a lock
            # taken per token by every reader made 32 streams' steps several times slower), so the turn is looked
            # at again with it up: a token taken before it went up is seen there, one after it signals
            self.asleep = True
            try:
                if self.tick():
                    continue
                with self.cond:
                    if self.closed and self._idle():
                        return
                    if self._signals == self._seen:  # nothing arrived since the turn looked: wait for something
                        self.cond.wait(self.scheduler.tuning.idle_s if self.decoder.holding else None)
            finally:
                self.asleep = False

    def _intake(self) -> bool:
        """Queued jobs join the pending ones (the lock held); whether any did."""
        arrived = bool(self.queue)
        self.pending.extend(self.queue)
        self.queue.clear()
        return arrived

    def _gather(self) -> None:
        """Jobs just arrived with no stream to step: wait up to max_wait for more, up to max_batch (a lone request
        runs at once in its caller's thread; requests pile up while a call computes)."""
        batching = self.scheduler.batching
        until = time.monotonic() + batching.max_wait_ms / 1000.0
        with self.cond:
            while self.waiting < batching.max_batch and not self.closed:
                left = until - time.monotonic()
                if left <= 0:
                    break
                self.cond.wait(left)
            self._intake()

    def tick(self) -> bool:
        """One turn: schedule, execute, update.  False when there was nothing to do."""
        s, d = self.scheduler, self.decoder
        with self.session:
            with self.cond:
                arrived = self._intake()
            if arrived and not d.rows and self.waiting < s.batching.max_batch and s.batching.max_wait_ms > 0:
                self._gather()
            with self.cond:
                self._seen = self._signals
                live, shrink = d.prune()
                todo = plan.schedule([s.piece(j) for j in self.pending], d.rows, live, d.outside, d.steps,
                                     s.batching.max_batch, s.max_tokens, s.tuning, shrink)
                jobs = [self.pending.popleft() for _ in range(todo.prompts)]
            if todo.idle:
                return False
            self.turns += 1
            if jobs:
                begun = time.perf_counter()
                s.execute(jobs)
                if d.rows:
                    d.seconds["wait"] += time.perf_counter() - begun
                with self.cond:  # a job's next piece goes first next time
                    self.pending.extendleft(reversed([j for j in jobs if not j.future.done()]))
            ran, touched = None, d.touched(todo.regroup)
            try:
                if todo.regroup is not None:
                    d.regroup(todo.regroup)
                if todo.step:
                    ran = d.run()
            except Exception as err:  # a failed step or rebuild ends its streams, never the loop
                d.fail(touched, err)
        if ran is not None:
            d.hand_out(*ran)
        return True
