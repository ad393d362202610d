"""The set of served models: install, replace and retire them (a reload) without dropping in-flight requests,
acquire one for a request, warm-up, the server's limits and its Generate stream slots.

Operations (service/operations.py) run requests against what this holds; the servicers never touch it directly
except to list models."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

from service.artifacts import LoadedModel
from service.engine import Engine, engine_for
from service.errors import NotFound, ResourceExhausted, Unavailable
from service.jobs import Job, MapRequest
from service.metrics import Metrics
from service.prefix import PrefixCache
from service.settings import Batching, Limits, Tuning  # defined with every other worker setting
from service.stats import EngineStats


@dataclass
class Served:
    """A model as the registry serves it: the artifact, its engine, the requests using it now, and whether a reload
    has replaced it (it closes once the last of those requests ends)."""

    model: LoadedModel
    engine: Engine
    active: int = 0
    retired: bool = False


class Registry:
    """The served models with their engines (each model's engine batched and tuned by the settings given)."""

    def __init__(self, models: dict[str, LoadedModel], limits: Limits, batching: Batching | None = None,
                 tuning: Tuning | None = None, metrics: Metrics | None = None):
        self.limits = limits
        self.metrics = metrics or Metrics()
        self.batching, self.tuning = batching or Batching(), tuning or Tuning()
        self.prefix = PrefixCache.of_mb(self.batching.prefix_cache_mb, self.metrics)  # every model's, one bound
        self.served: dict[str, Served] = {}
        self._lock = threading.Lock()
        self.streams = 0  # open Generate streams
        self.shutting_down = False
        for m in models.values():
            self.install(self.prepare(m))

    @property
    def models(self) -> dict[str, LoadedModel]:
        """The models served now, by name."""
        return {name: s.model for name, s in self.served.items()}

    def engine(self, name: str) -> Engine:
        """The engine serving the named model (tests, benchmarks, metrics)."""
        return self._served(name).engine

    # --- the set of models: install, replace, remove (a reload), without dropping in-flight requests -------

    def prepare(self, m: LoadedModel) -> Served:
        """The model with its engine started, not yet served (install serves it)."""
        # --max-batch caps the rows of every onnxruntime call, the decode batch's steps included
        stats = EngineStats(on_call=self.metrics.batch_size.labels(m.name).observe,
                            on_drafts=self.metrics.drafts(m.name))
        return Served(m, engine_for(m, self.batching, self.tuning, self.prefix, stats))

    def warm_up(self, served: Served, timeout: float = 120.0) -> None:
        """One request through the model's own engine: raises if the artifact cannot really run.  A model with a fast
        graph warms up without maps (its exact graph loads when a request first wants them)."""
        m = served.model
        maps = MapRequest.NONE if m.fast is not None else MapRequest.FULL
        job = Job(np.asarray(m.tokenizer.encode("warm up")[:8] or [0], np.int64), None, maps, None)
        served.engine.submit(job).result(timeout)

    def install(self, served: Served) -> Served | None:
        """Serve a prepared model under its name; one it replaces is retired (closed once its last request ends)."""
        name = served.model.name
        with self._lock:
            old = self.served.get(name)
            self.served[name] = served
            self.metrics.watch_queue(name, lambda: served.engine.waiting)
        if old is not None:
            self._retire(old)
        return old

    def remove(self, name: str) -> Served | None:
        with self._lock:
            old = self.served.pop(name, None)
        if old is not None:
            self._retire(old)
        return old

    def _retire(self, s: Served) -> None:
        with self._lock:
            s.retired = True
            idle = s.active == 0
        if idle:
            self._close_later(s)

    @staticmethod
    def _close_later(s: Served) -> None:
        """Close a retired model's engine off the request thread (close() joins its thread)."""
        threading.Thread(target=s.engine.close, name=f"retire-{s.model.name}", daemon=True).start()

    def _not_found(self, name: str) -> NotFound:
        return NotFound(f"unknown model {name!r}; served models: {', '.join(sorted(self.served))}")

    def _served(self, name: str) -> Served:
        if self.shutting_down:
            raise Unavailable("server is shutting down")
        s = self.served.get(name)
        if s is None:
            raise self._not_found(name)
        return s

    @contextmanager
    def acquire(self, name: str) -> Iterator[Served]:
        """The named model and its engine for one request; a reload that replaces it meanwhile waits for this
        request to end before closing its engine.  Refused while shutting down (work in flight carries on)."""
        if self.shutting_down:
            raise Unavailable("server is shutting down")
        with self._lock:
            s = self.served.get(name)
            if s is not None:
                s.active += 1
        if s is None:
            raise self._not_found(name)
        try:
            yield s
        finally:
            with self._lock:
                s.active -= 1
                close = s.retired and s.active == 0
            if close:
                self._close_later(s)

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
            current = list(self.served.values())
        for s in current:
            s.engine.close()

    def get(self, name: str) -> LoadedModel:
        """The named model's artifact, for what needs no engine (its tokenizer, sizes, KServe metadata); operations
        (service/operations.py) hand it to the fronts."""
        return self._served(name).model
