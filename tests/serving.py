"""Helpers for tests that start a real worker on a loopback port (fixtures in tests/conftest.py)."""

import time
from collections.abc import Callable
from typing import Any

from service.executor import Executor
from service.server import Server, Settings
from service.settings import Batching


class Hooked(Executor):
    """An engine's executor with `before(work)` called ahead of every onnxruntime call: a prompt call's jobs, or a
    decode step's (B, 1) ids (len() is the call's rows either way).  Tests install one with Engine.use, the engine's
    own way to replace its executor: what a hook does (wait, sleep, count, raise) happens in the engine's call."""

    def __init__(self, inner: Executor, before: Callable[[Any], None]):
        super().__init__(inner.model, inner.stats)
        self.before = before

    def run(self, jobs):
        self.before(jobs)
        return super().run(jobs)

    def step(self, ids, cache):
        self.before(ids)
        return super().step(ids, cache)


def hook(engine, before: Callable[[Any], None]) -> Executor:
    """Call `before(work)` ahead of every call of the engine; returns the executor it replaced (engine.use(it)
    restores it)."""
    return engine.use(Hooked(engine.executor, before))


def slow_runs(engine, seconds: float) -> Executor:
    """Make every onnxruntime call of an engine take `seconds` longer, so requests sent together overlap (a tiny
    model answers in well under a millisecond: each could otherwise find the model idle and run alone).  Returns the
    executor it replaced."""
    return hook(engine, lambda work: time.sleep(seconds))


def start(root, **overrides):
    overrides.setdefault("metrics_port", -1)
    overrides.setdefault("http_port", -1)  # HTTP only where a test asks for it (the worker's default is 8000)
    batching = {k: overrides.pop(k) for k in ("max_batch", "max_wait_ms", "max_queue") if k in overrides}
    settings = Settings(model_dir=root, host="127.0.0.1", port=0, threads=1, batching=Batching(**batching), **overrides)
    return Server(settings).start()
