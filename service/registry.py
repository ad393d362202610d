"""The set of served models: install, replace and retire them (a reload) without dropping in-flight requests,
acquire one for a request, warm-up, the server's limits and its Generate stream slots.

Operations (service/operations.py) run requests against what this holds; the servicers never touch it directly
except to list models."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np

from service.artifacts import LoadedModel
from service.errors import NotFound, ResourceExhausted, Unavailable
from service.jobs import Job, MapRequest
from service.metrics import Metrics
from service.prefix import PrefixCache
from service.scheduler import Scheduler
from service.settings import Batching, Limits, Tuning  # defined with every other worker setting


class Registry:
    """The loaded models with their schedulers (each model's engine batched and tuned by the settings given)."""

    def __init__(self, models: dict[str, LoadedModel], limits: Limits, batching: Batching | None = None,
                 tuning: Tuning | None = None, metrics: Metrics | None = None):
        self.limits = limits
        self.metrics = metrics or Metrics()
        self.batching, self.tuning = batching or Batching(), tuning or Tuning()
        self.prefix = PrefixCache.of_mb(self.batching.prefix_cache_mb, self.metrics)  # every model's, one bound
        self.models: dict[str, LoadedModel] = {}
        self._lock = threading.Lock()
        self.streams = 0  # open Generate streams
        self.shutting_down = False
        for m in models.values():
            self.install(m)

    # --- the set of models: install, replace, remove (a reload), without dropping in-flight requests -------

    def start_scheduler(self, m: LoadedModel) -> LoadedModel:
        if not m.started:
            # --max-batch caps the rows of every onnxruntime call, the decode batch's steps included
            m.scheduler = Scheduler(m, self.batching, self.tuning,
                                    on_batch=self.metrics.batch_size.labels(m.name).observe, prefix=self.prefix)
        return m

    def warm_up(self, m: LoadedModel, timeout: float = 120.0) -> None:
        """One request through the model's own scheduler: raises if the artifact cannot really run.  A model with
        a fast graph warms up without maps (its exact graph loads when a request first wants them)."""
        self.start_scheduler(m)
        maps = MapRequest.NONE if m.fast is not None else MapRequest.FULL
        job = Job(np.asarray(m.tokenizer.encode("warm up")[:8] or [0], np.int64), None, maps, None)
        m.scheduler.submit(job).result(timeout)

    def install(self, m: LoadedModel) -> LoadedModel | None:
        """Serve `m` under its name; a model it replaces is retired (closed once its last request finishes)."""
        self.start_scheduler(m)
        with self._lock:
            old = self.models.get(m.name)
            self.models[m.name] = m
            self.metrics.watch_queue(m.name, m.scheduler.waiting)
        if old is not None:
            self._retire(old)
        return old

    def remove(self, name: str) -> LoadedModel | None:
        with self._lock:
            old = self.models.pop(name, None)
        if old is not None:
            self._retire(old)
        return old

    def _retire(self, m: LoadedModel) -> None:
        with self._lock:
            m.retired = True
            idle = m.active == 0
        if idle:
            self._close_later(m)

    @staticmethod
    def _close_later(m: LoadedModel) -> None:
        """Close a retired model's scheduler off the request thread (close() joins its batching thread)."""
        if m.started:
            threading.Thread(target=m.scheduler.close, name=f"retire-{m.name}", daemon=True).start()

    def _not_found(self, name: str) -> NotFound:
        return NotFound(f"unknown model {name!r}; served models: {', '.join(sorted(self.models))}")

    @contextmanager
    def acquire(self, name: str) -> Iterator[LoadedModel]:
        """The named model for one request; a reload that replaces it meanwhile waits for this request to end
        before closing its scheduler.  Refused while shutting down (work in flight carries on)."""
        if self.shutting_down:
            raise Unavailable("server is shutting down")
        with self._lock:
            m = self.models.get(name)
            if m is not None:
                m.active += 1
        if m is None:
            raise self._not_found(name)
        try:
            yield m
        finally:
            with self._lock:
                m.active -= 1
                close = m.retired and m.active == 0
            if close:
                self._close_later(m)

    @contextmanager
    def stream_slot(self) -> Iterator[None]:
        with self._lock:
            if self.streams >= self.limits.max_streams:
                raise ResourceExhausted(f"{self.streams} Generate streams are open, the server's limit is "
                                        f"{self.limits.max_streams}; retry when one finishes")
            self.streams += 1
        try:
            yield
        finally:
            with self._lock:
                self.streams -= 1

    def close(self) -> None:
        self.shutting_down = True
        with self._lock:
            current = list(self.models.values())
        for m in current:
            if m.started:
                m.scheduler.close()

    def get(self, name: str) -> LoadedModel:
        """The named model (for requests that use its session directly, e.g. KServe ModelInfer)."""
        if self.shutting_down:
            raise Unavailable("server is shutting down")
        m = self.models.get(name)
        if m is None:
            raise self._not_found(name)
        return m
