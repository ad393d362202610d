"""The executor of a model's calls: builds the feeds of a group of jobs or a decode step and runs onnxruntime.

Every onnxruntime call of a model goes through Executor.run (prompts) or Executor.step (a decode step), on behalf
of its engine (service/engine.py, which decides what runs when): a group of prompt jobs (service/scheduler.py) or
the decode batch's step (service/decoder.py).  The feeds and each row's share of the outputs are the layout's
(service/kvcache.py): the exact graph's rows are padded, the fast graph's laid out as its artifact says
(service/layouts.py), chosen once here.  A decode step runs on the batch's cache: plain feeds through
InferenceSession.run, or with the cache's buffers bound as both past and present through IOBinding (written in
place, only the logits fetched).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from service.artifacts import LoadedModel
from service.jobs import Job, MapRequest, Result, Step
from service.kvcache import KVCache
from service.layouts import layout_of
from service.padded import PaddedCache
from service.settings import Tuning

if TYPE_CHECKING:
    import onnxruntime as ort


class Executor:
    """One model's onnxruntime calls: feeds built, the session run, results per job."""

    def __init__(self, model: LoadedModel, on_batch: Callable[[int], None] | None = None,
                 tuning: Tuning | None = None):
        self.model, self.tuning = model, tuning or Tuning()  # the tuning: the decode batch's cache sizes
        self.layout = layout_of(model)  # the fast graph's (decode steps, prompts without maps)
        self.on_batch = on_batch  # called with the size of every batch sent to onnxruntime
        self.rows_run = 0  # rows sent to onnxruntime so far (for metrics and tests)

    def cache(self) -> KVCache:
        """A decode batch's cache, in the layout its steps run on."""
        return self.layout(self.model, self.tuning)

    def run(self, jobs: list[Job]) -> list[Result]:
        """A group of jobs, a Result per job: one call (or one per row where the layout's kernel wants that) on the
        fast graph unless a row wants maps, on the exact graph (padded) otherwise."""
        m, maps = self.model, any(j.attention is not MapRequest.NONE for j in jobs)
        # a profile's call runs the profile graph (its rows reduced in it); buckets never mix it with maps
        profile = any(j.attention is MapRequest.PROFILE for j in jobs)
        session = m.profile_session if profile else m.session_for(maps)
        layout = self.layout if session is m.fast else PaddedCache  # the exact graph lays rows out padded
        results = []
        for group in layout.calls(jobs):
            results += self._call(session, layout, group, maps, profile)
        return results

    def _call(self, session: ort.InferenceSession, layout: type[KVCache], jobs: list[Job], maps: bool,
              profile: bool = False) -> list[Result]:
        m = self.model
        feeds, last = layout.prompt_feeds(m, jobs)
        names = ["logits"] + (["attentions"] if maps else [])
        names += [spec["output"] for spec in m.state] if any(j.want_state for j in jobs) else []
        last_only = self._positions(session, jobs, feeds, last)
        start = self._count(len(jobs))
        out: dict[str, Any] = {}
        fetch = names
        if profile:  # the profile graph has no logits (nor their head): each row's are (n, 0)
            assert m.meta.profile is not None  # (m.profile_session ran: the artifact has a profile graph)
            names, out["logits"] = names[1:], np.zeros((*feeds["input_ids"].shape, 0), np.float32)
            fetch = [m.meta.profile.output if n == "attentions" else n for n in names]
        out.update(zip(names, session.run(fetch, feeds), strict=True))
        compute_ms = (time.monotonic() - start) * 1000
        return [Result(logits, att, state, (start - j.enqueued) * 1000, compute_ms, len(jobs))
                for j, (logits, att, state) in zip(jobs, layout.prompt_rows(m, jobs, feeds, out, last_only),
                                                   strict=True)]

    def _positions(self, session: ort.InferenceSession, jobs: list[Job], feeds: dict[str, np.ndarray],
                   last: np.ndarray) -> bool:
        """Feed the fast graph's logits positions: each row's last new token (`last`) when no job wants more, else
        every position; True for the former (each row's logits are then (1, V))."""
        m = self.model
        if session is not m.fast or m.logits_positions is None:
            return False
        last_only = all(j.last_only for j in jobs)
        shape = feeds["input_ids"].shape  # every position: 0 .. T-1 on each row
        feeds[m.logits_positions] = last.astype(np.int64)[:, None] if last_only else \
            np.broadcast_to(np.arange(shape[1], dtype=np.int64), shape)
        return last_only

    def _count(self, rows: int) -> float:
        """Count a call's rows (metrics, tests); returns when it starts."""
        self.rows_run += rows
        if self.on_batch is not None:
            self.on_batch(rows)
        return time.monotonic()

    def step(self, step: Step) -> np.ndarray:
        """One decode step on the batch's cache: the (B, V) logits of each row's next position; the cache updated."""
        m, cache = self.model, step.cache
        session = m.session_for(False)
        feeds = cache.step_feeds(step.ids)
        if m.logits_positions is not None:  # the fast graph's (the step runs it when there is one)
            feeds.inputs[m.logits_positions] = np.zeros((len(step.ids), 1), np.int64)  # the step's one position
        self._count(len(step.ids))
        if feeds.shared:  # buffers read as the past and written as the present: only the logits come back
            io = session.io_binding()
            for name, value in feeds.inputs.items():
                io.bind_cpu_input(name, value)
            for name in ["logits"] + feeds.fetch:  # bound first: the first outputs come back
                io.bind_output(name)
            for past, present, value in feeds.shared:
                io.bind_ortvalue_input(past, value)
                io.bind_ortvalue_output(present, value)
            session.run_with_iobinding(io)
            out: list[np.ndarray] = [value.numpy() for value in io.get_outputs()[:1 + len(feeds.fetch)]]
        else:
            out = session.run(["logits"] + feeds.fetch, feeds.inputs)
        cache.update(out[1:])
        logits: np.ndarray = out[0][:, -1]
        return logits
