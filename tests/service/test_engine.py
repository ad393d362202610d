"""A model's engine (service/engine.py) turned by hand (engine_for(start=False): no thread, engine.tick() is one turn
of schedule, execute, update) on a real onnxruntime session: a lone job runs in its caller's thread, a Predict
arriving while a stream decodes is answered in the next turn beside that turn's step, and a long prompt's pieces
and the decode steps alternate within the token budget."""

import time

import numpy as np
import pytest

from model import tokenizer
from service.artifacts import load_artifact
from service.engine import engine_for
from service.generation import Generation
from service.jobs import Job
from service.sampling import SamplingParams
from service.settings import Batching
from service.tokenizer import ByteTokenizer
from tests.serving import hook


@pytest.fixture(scope="module")
def model(tiny_artifacts):
    return load_artifact(tiny_artifacts[0] / "rope", threads=1)


def by_hand(model, max_tokens=256):
    return engine_for(model, Batching(max_batch=8, max_wait_ms=0, batch_tokens=max_tokens), start=False)


def open_stream(sched, text, n):
    """A greedy stream as Operations.generate opens it: its prompt through submit, its first token, then the batch."""
    ids = tokenizer.encode(text)
    s = Generation(ids, SamplingParams(max_new_tokens=n), ByteTokenizer().detokenizer(ids),
                   limit=sched.prompts.model.max_positions)
    future = sched.submit(Job(np.asarray(ids, np.int64), None))
    while not future.done():
        assert sched.tick()
    s.advance(future.result())
    sched.add(s)
    return s


def alone(model, ids):
    """The job's logits from a call of its own, on a fresh engine."""
    sched = by_hand(model)
    try:
        (result,) = sched.executor.run([Job(np.asarray(ids, np.int64), None)])
        return result.logits
    finally:
        sched.close()


def test_a_lone_job_runs_at_once_in_the_callers_thread(model):
    sched = by_hand(model)
    try:
        ids = np.array([5, 6, 7])
        future = sched.submit(Job(ids, None))
        assert future.done() and sched.turns == 0  # no engine turn ran it: the caller did
        assert np.allclose(future.result().logits, alone(model, ids), atol=1e-6)
        assert not sched.tick()  # and nothing was left for the engine
    finally:
        sched.close()


def test_a_job_queues_while_a_stream_is_open_and_runs_in_the_next_turn_beside_its_step(model):
    sched = by_hand(model)
    try:
        s = open_stream(sched, "the cat", 20)
        assert sched.tick() and s.out.qsize() == 1  # the stream joined and stepped
        ids = np.arange(1, 12)
        future = sched.submit(Job(ids, None, want_state=False))
        assert not future.done() and sched.waiting == 1  # the stream holds the engine: the job queued
        steps, turns = sched.stats.steps, sched.turns
        assert sched.tick()
        assert future.done() and sched.turns == turns + 1  # answered in one turn ...
        assert sched.stats.steps == steps + 1 and s.out.qsize() == 2  # ... which also stepped the stream
        assert np.allclose(future.result().logits, alone(model, ids), atol=1e-5)
    finally:
        sched.close()


def test_each_turn_runs_at_most_the_token_budget_of_prompts_and_one_step(model):
    sched = by_hand(model, max_tokens=20)
    calls = []  # per onnxruntime prompt call: its new tokens and rows

    def recording(work):
        if isinstance(work, list):  # a prompt call (a decode step's work is its ids)
            calls.append((sum(len(j.ids) for j in work), len(work)))

    hook(sched, recording)
    try:
        s = open_stream(sched, "r", 60)
        calls.clear()
        rng = np.random.default_rng(2)
        prompts = [rng.integers(0, 256, n) for n in (50, 10, 10, 10)]
        futures = [sched.submit(Job(p, None, want_state=False)) for p in prompts]
        turns = []  # per turn: prompt tokens run, decode steps made
        while not all(f.done() for f in futures):
            before, steps = len(calls), sched.stats.steps
            assert sched.tick()
            turns.append((sum(t for t, _ in calls[before:]), sched.stats.steps - steps))
            while not s.out.empty():  # the reader keeps up
                s.out.get()
        assert all(tokens <= 20 or rows == 1 for tokens, rows in calls)
        assert all(tokens <= 20 and steps == 1 for tokens, steps in turns), turns  # a step between every two calls
        assert sum(t for t, _ in turns) == 80 and len(turns) >= 4  # 80 prompt tokens, at most 20 a turn
        for p, f in zip(prompts, futures, strict=True):
            assert np.allclose(f.result().logits, alone(model, p), atol=1e-5)
    finally:
        sched.close()


def test_a_full_queue_is_refused_and_a_closed_engine_takes_nothing(model):
    from service.errors import ResourceExhausted, Unavailable

    sched = engine_for(model, Batching(max_batch=8, max_wait_ms=0, max_queue=2), start=False)
    open_stream(sched, "x", 10)  # the engine holds a stream: jobs queue
    futures = [sched.submit(Job(np.array([1]), None)) for _ in range(2)]
    with pytest.raises(ResourceExhausted, match="queue for model .* is full"):
        sched.submit(Job(np.array([1]), None))
    assert sched.tick() and all(f.done() for f in futures)
    sched.close()
    with pytest.raises(Unavailable):
        sched.submit(Job(np.array([1]), None))


def test_a_job_queued_between_a_turns_intake_and_its_schedule_is_run_without_another_arrival(model):
    """The loop waits for a signal once a turn finds nothing to do and it is marked asleep. A job submitted while
    the engine's thread holds the session (so it queues) after that turn drained the queue, before it scheduled,
    must still run: the turn has not seen it. Here the job arrives inside the loop's second look (the one after
    it is marked asleep), right after its intake, with nothing else arriving after it."""
    sched = engine_for(model, Batching(max_batch=8, max_wait_ms=0, batch_tokens=256), start=False)
    intake, calls, futures = sched._intake, [], []

    def arriving():
        drained = intake()
        calls.append(drained)
        if len(calls) == 2:  # the look after the first idle turn: a job arrives just after the queue was taken
            futures.append(sched.submit(Job(np.arange(1, 9), None, want_state=False)))
        return drained

    sched._intake = arriving
    sched.start()
    try:
        deadline = time.monotonic() + 10
        while not futures and time.monotonic() < deadline:
            time.sleep(0.01)
        assert futures, "the engine's loop did not look twice"
        result = futures[0].result(timeout=10)  # waited forever when the turn counted it as seen
        assert np.allclose(result.logits, alone(model, np.arange(1, 9)), atol=1e-5)
    finally:
        sched.close()
