"""Helpers for tests that start a real worker on a loopback port (fixtures in tests/conftest.py)."""

import time

from service.server import Server, Settings
from service.settings import Batching


def slow_runs(scheduler, seconds: float) -> None:
    """Make every onnxruntime call of a scheduler take `seconds` longer, so requests sent together overlap (a
    tiny model answers in well under a millisecond: each could otherwise find the model idle and run alone)."""
    scheduler.run = lambda jobs, run=scheduler.run: (time.sleep(seconds), run(jobs))[1]


def start(root, **overrides):
    overrides.setdefault("metrics_port", -1)
    overrides.setdefault("http_port", -1)  # HTTP only where a test asks for it (the worker's default is 8000)
    batching = {k: overrides.pop(k) for k in ("max_batch", "max_wait_ms", "max_queue") if k in overrides}
    settings = Settings(model_dir=root, host="127.0.0.1", port=0, threads=1, batching=Batching(**batching), **overrides)
    return Server(settings).start()
