"""One engine per model: the one owner of its session, one thread, one loop.

The engine is assembled once from its parts (`build`, as onnxruntime-genai assembles its EngineDependencies), none
of which knows the engine or the others:

  PromptRunner  service/prompts.py   the prompt jobs: pieces within the token budget, calls grouped by length,
                                      results and the prefix cache
  DecodeBatch   service/batch.py     Generate's streams: the decode batch, its cache, regroups, steps, tokens
  Executor      service/executor.py  every onnxruntime call (feeds, sessions); the one part a test replaces (`use`)
  EngineStats   service/stats.py     what they count

Each turn of the loop (`tick`) is three parts apart:

  schedule  service/plan.py decides, from the pending prompt pieces and the decode batch's streams: which pending
            jobs run their next piece (within max_batch rows and the token budget, --batch-tokens), how the
            batch changes at this boundary (joins, leaves, rotation), whether it steps
  execute   the prompt call(s) (the runner splits them by length and layout) and the batch's regroup and decode step
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
from concurrent.futures import Future
from dataclasses import dataclass

from service import plan
from service.artifacts import LoadedModel
from service.batch import DecodeBatch
from service.errors import ResourceExhausted, Unavailable
from service.executor import Executor
from service.generation import Generation
from service.jobs import Job, Result
from service.prefix import PrefixCache
from service.prompts import PromptRunner
from service.settings import Batching, Tuning
from service.stats import EngineStats


@dataclass(frozen=True)
class Parts:
    """What an engine is made of, built once."""

    prompts: PromptRunner
    batch: DecodeBatch
    executor: Executor
    stats: EngineStats


def build(model: LoadedModel, batching: Batching, tuning: Tuning, prefix: PrefixCache | None = None,
          stats: EngineStats | None = None) -> Parts:
    """A model's parts: the prompt runner on the prefix cache given (a registry's, shared by its models; else the
    model's own of --prefix-cache-mb), the decode batch in the layout of its fast graph, its executor."""
    stats = stats or EngineStats()
    prefix = prefix if prefix is not None else PrefixCache.of_mb(batching.prefix_cache_mb)
    return Parts(PromptRunner(model, batching.batch_tokens, prefix, stats),
                 DecodeBatch(model.layout.cache(model.kv, tuning), model.name, batching.max_batch, stats,
                             0 if model.whole_prompts else batching.speculate),
                 Executor(model, stats), stats)


class Engine:
    """The loop of one model over its parts.  Started at once unless start=False (tests then turn it with tick())."""

    def __init__(self, name: str, parts: Parts, batching: Batching | None = None, tuning: Tuning | None = None,
                 start: bool = True):
        self.name, self.batching, self.tuning = name, batching or Batching(), tuning or Tuning()
        self.prompts, self.batch, self.executor, self.stats = parts.prompts, parts.batch, parts.executor, parts.stats
        self.cond = threading.Condition()  # guards what arrives (jobs, streams, readers' wakes) and the lists
        self.session = threading.Lock()  # held for every turn, and by a job run in its caller's thread
        self.closed = False
        self.queue: deque[Job] = deque()  # submitted, not yet seen by the engine
        self.pending: deque[Job] = deque()  # seen, waiting for a call (their next piece)
        self.joining: list[Generation] = []  # streams added, not yet seen by the engine
        self._signals = 0  # bumped by every arrival; a turn that finds nothing waits for the next
        self.asleep = False  # the loop found nothing to do and waits: readers' wakes signal
        self._seen = 0
        self._thread: threading.Thread | None = None
        if start:
            self.start()

    def start(self) -> Engine:
        self._thread = threading.Thread(target=self._loop, name=f"engine-{self.name}", daemon=True)
        self._thread.start()
        return self

    def use(self, executor: Executor) -> Executor:
        """Run every later call through `executor` (a test's or a benchmark's: one that holds, slows, counts or fails
        calls); returns the one it replaces.  Taken between turns, never inside one."""
        with self.session:
            previous, self.executor = self.executor, executor
        return previous

    @property
    def running(self) -> bool:
        """Whether its thread is running (a failed step never ends it)."""
        return self._thread is not None and self._thread.is_alive()

    @property
    def turns(self) -> int:
        return self.stats.turns

    def signal(self) -> None:
        """Something arrived (the lock held): a turn that found nothing to do looks again."""
        self._signals += 1
        self.cond.notify()

    @property
    def waiting(self) -> int:
        """Jobs submitted and not yet in a call (metrics: the queue's size; the --max-queue bound)."""
        return len(self.queue) + len(self.pending)

    @property
    def active(self) -> int:
        """Generate streams open on the model."""
        with self.cond:
            joining = len(self.joining)
        return self.batch.count + joining

    def _idle(self) -> bool:
        return not (self.queue or self.pending or self.joining or self.batch.holding)

    # --- what arrives -------------------------------------------------------------------------------------------

    def submit(self, job: Job) -> Future[Result]:
        """Queue a job for the engine; when it holds nothing and the job runs in one call, run it at once in the
        caller's thread instead (no hand-off to the engine's thread and back: ~0.1 ms of a lone request's latency).
        A job over the budget always queues: its pieces take turns with the decode steps."""
        with self.cond:
            if self.closed:
                raise Unavailable("server is shutting down")
            alone = self.prompts.piece(job) == len(job.ids)
            inline = alone and self._idle() and self.session.acquire(blocking=False)
            if not inline:
                if self.waiting >= self.batching.max_queue:
                    raise ResourceExhausted(f"queue for model {self.name} is full ({self.batching.max_queue} "
                                            "waiting); retry later")
                self.queue.append(job)
                self.signal()
        if inline:
            try:
                self.prompts.execute([job], self.executor)
            finally:
                self.session.release()
        return job.future

    def add(self, stream: Generation) -> None:
        """A Generate stream whose prompt has run: it joins the decode batch at a coming boundary."""
        with self.cond:
            if self.closed:
                raise Unavailable("server is shutting down")
            stream.since = self.stats.steps
            self.joining.append(stream)
            self.signal()

    def wake(self) -> None:
        """A reader took a token: its stream may step again.  Only an engine waiting for work needs telling (it
        looks at the streams again once it is marked asleep, so a token taken meanwhile is seen either way)."""
        if self.asleep:
            with self.cond:
                self.signal()

    def close(self) -> None:
        """Refuse new work; what is queued runs and open streams finish (waited for up to 10 s); the model's blocks
        leave the prefix cache."""
        with self.cond:
            self.closed = True
            self.signal()
        if self._thread is not None:
            self._thread.join(timeout=10)
        self.prompts.close()

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
                        self.cond.wait(self.tuning.idle_s if self.batch.holding else None)
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
        until = time.monotonic() + self.batching.max_wait_ms / 1000.0
        with self.cond:
            while self.waiting < self.batching.max_batch and not self.closed:
                left = until - time.monotonic()
                if left <= 0:
                    break
                self.cond.wait(left)
            self._intake()

    def _prefilling(self) -> int:
        """Prompts of streams still being prefilled, queued ones too (the lock held): the batch makes room for them."""
        return sum(j.want_state for j in self.pending) + sum(j.want_state for j in self.queue)

    def tick(self) -> bool:
        """One turn: schedule, execute, update.  False when there was nothing to do."""
        b, batching = self.batch, self.batching
        with self.session:
            with self.cond:
                # what arrived up to here is looked at in this turn; a job queued after the intake (the lock is
                # let go before the schedule) is a signal this turn has not seen, so the loop turns again for it
                self._seen = self._signals
                arrived = self._intake()
            if arrived and not b.rows and self.waiting < batching.max_batch and batching.max_wait_ms > 0:
                self._gather()
            with self.cond:
                joined, self.joining = self.joining, []
                live, shrink = b.prune(joined)
                todo = plan.schedule([self.prompts.piece(j) for j in self.pending], b.rows, live, b.outside,
                                     self.stats.steps, batching.max_batch, self.prompts.budget, self.tuning, shrink)
                jobs = [self.pending.popleft() for _ in range(todo.prompts)]
                prefilling = self._prefilling()
            if todo.idle:
                return False
            self.stats.turns += 1
            executor = self.executor
            if jobs:
                begun = time.perf_counter()
                self.prompts.execute(jobs, executor)
                if b.rows:
                    self.stats.seconds["wait"] += time.perf_counter() - begun
                with self.cond:  # a job's next piece goes first next time
                    self.pending.extendleft(reversed([j for j in jobs if not j.future.done()]))
                    prefilling = self._prefilling()
            ran, touched = None, b.touched(todo.regroup)
            try:
                if todo.regroup is not None:
                    b.regroup(todo.regroup, prefilling)
                if todo.step:
                    ran = b.run(executor)
            except Exception as err:  # a failed step or rebuild ends its streams, never the loop
                b.fail(touched, err)
        if ran is not None:
            b.hand_out(*ran)
        return True


def engine_for(model: LoadedModel, batching: Batching | None = None, tuning: Tuning | None = None,
               prefix: PrefixCache | None = None, stats: EngineStats | None = None, start: bool = True) -> Engine:
    """A model's engine with its parts built (`build`); started unless start=False."""
    batching, tuning = batching or Batching(), tuning or Tuning()
    return Engine(model.name, build(model, batching, tuning, prefix, stats), batching, tuning, start)
