"""The executor of a model's calls: builds the feeds of a group of jobs or a decode step and runs onnxruntime.

Every onnxruntime call of a model goes through Executor.run (prompts) or Executor.step (a decode step), on behalf
of its engine (service/engine.py, which decides what runs when): a group of prompt jobs (service/prompts.py) or the
decode batch's step (service/batch.py).  The feeds and each row's share of the outputs are the codec's of the graph
the call runs (service/kvcache.py; LoadedModel.graph: the exact graph's rows padded, the fast graph's laid out as
its artifact says).  A decode step runs on the batch's cache: plain feeds through InferenceSession.run, or with the
cache's buffers bound as both past and present through IOBinding (written in place, only the logits fetched).  A
prompt call writes the outputs its codec gives arrays for (Codec.presents) through IOBinding too, and then hands
onnxruntime's arena back what its activations took (SHRINK), so a burst of prompts leaves no peak behind it.

The engine is given its executor when it is built, and it is the one thing a test or a benchmark replaces
(`Engine.use`): a subclass that holds, slows, counts or fails calls, never a patched method.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import onnxruntime as ort

from service.artifacts import Graph, LoadedModel
from service.jobs import Job, MapRequest, Result
from service.kvcache import KVCache
from service.stats import EngineStats

# a prompt call that fetches its cache hands onnxruntime's arena back what the call's activations took (it keeps its
# peak otherwise: 160 MB after a call of 32 prompts of 128 tokens of the peer model, beside the decode batch's buffers)
SHRINK = ort.RunOptions()
SHRINK.add_run_config_entry("memory.enable_memory_arena_shrinkage", "cpu:0")


class Executor:
    """One model's onnxruntime calls: feeds built, the session run, results per job."""

    def __init__(self, model: LoadedModel, stats: EngineStats | None = None):
        self.model = model
        self.stats = stats or EngineStats()  # counts every call's rows

    def run(self, jobs: list[Job]) -> list[Result]:
        """A group of jobs, a Result per job: one call (or one per row where the layout's kernel wants that) on the
        fast graph unless a row wants maps, on the exact graph otherwise (a profile: the profile graph)."""
        maps = any(j.attention is not MapRequest.NONE for j in jobs)
        # a profile's call runs the profile graph (its rows reduced in it); the prompt runner never mixes it with maps
        profile = any(j.attention is MapRequest.PROFILE for j in jobs)
        graph = self.model.graph(maps, profile)
        results = []
        for group in graph.codec.calls(jobs):
            results += self._call(graph, group, maps, profile)
        return results

    def _call(self, graph: Graph, jobs: list[Job], maps: bool, profile: bool = False) -> list[Result]:
        m, spec = self.model, self.model.kv
        feeds, last = graph.codec.prompt_feeds(spec, jobs)
        names = ["logits"] + (["attentions"] if maps else [])
        names += spec.outputs if any(j.want_state for j in jobs) else []
        last_only = self._positions(graph, jobs, feeds, last)
        start = self._count(len(jobs))
        out: dict[str, Any] = {}
        fetch = names
        if profile:  # the profile graph has no logits (nor their head): each row's are (n, 0)
            assert m.meta.profile is not None  # (the graph is the profile graph: the artifact has one)
            names, out["logits"] = names[1:], np.zeros((*feeds["input_ids"].shape, 0), np.float32)
            fetch = [m.meta.profile.output if n == "attentions" else n for n in names]
        out.update(zip(names, self._outputs(graph, feeds, fetch), strict=True))
        compute_ms = (time.monotonic() - start) * 1000
        return [Result(logits, att, state, (start - j.enqueued) * 1000, compute_ms, len(jobs))
                for j, (logits, att, state) in zip(jobs, graph.codec.prompt_rows(spec, jobs, feeds, out, last_only),
                                                   strict=True)]

    def _outputs(self, graph: Graph, feeds: dict[str, np.ndarray], fetch: list[str]) -> list[np.ndarray]:
        """A prompt call's outputs: those the codec gives arrays for (`Codec.presents`: the compact layout's present
        keys and values, in pages of their own) written into them through IOBinding, the others onnxruntime's."""
        given = graph.codec.presents(self.model.kv, feeds, fetch)
        if not given:
            outputs: list[np.ndarray] = graph.session.run(fetch, feeds)
            return outputs
        io = graph.session.io_binding()
        for name, value in feeds.items():
            io.bind_cpu_input(name, value)
        for name in fetch:
            if name in given:
                array = given[name]
                io.bind_output(name, "cpu", 0, array.dtype, list(array.shape), array.ctypes.data)
            else:
                io.bind_output(name)
        arena = graph.session.get_session_options().enable_cpu_mem_arena
        graph.session.run_with_iobinding(io, SHRINK if arena else None)
        return [given[name] if name in given else value.numpy() for name, value in zip(fetch, io.get_outputs(),
                                                                                        strict=True)]

    @staticmethod
    def _positions(graph: Graph, jobs: list[Job], feeds: dict[str, np.ndarray], last: np.ndarray) -> bool:
        """Feed the fast graph's logits positions: each row's last new token (`last`) when no job wants more, else
        every position; True for the former (each row's logits are then (1, V))."""
        if graph.logits_positions is None:
            return False
        last_only = all(j.last_only for j in jobs)
        shape = feeds["input_ids"].shape  # every position: 0 .. T-1 on each row
        feeds[graph.logits_positions] = last.astype(np.int64)[:, None] if last_only else \
            np.broadcast_to(np.arange(shape[1], dtype=np.int64), shape)
        return last_only

    def _count(self, rows: int) -> float:
        """Count a call's rows (metrics, tests); returns when it starts."""
        self.stats.call(rows)
        return time.monotonic()

    def step(self, ids: np.ndarray, cache: KVCache) -> np.ndarray:
        """One decode step on the batch's cache, every row taking its token ids[b, 0]: the (B, V) logits of each
        row's next position; the cache updated.  A lone row taking T > 1 tokens (a speculative step: its token and
        its drafts) gets the (1, T, V) logits of every new position."""
        graph = self.model.graph(maps=False)
        feeds = cache.step_feeds(ids)
        width = ids.shape[1]
        if graph.logits_positions is not None:  # the fast graph's (the step runs it when there is one)
            feeds.inputs[graph.logits_positions] = np.zeros((len(ids), 1), np.int64) if width == 1 else \
                np.arange(width, dtype=np.int64)[None, :]
        self._count(len(ids))
        if feeds.shared:  # buffers read as the past and written as the present: only the logits come back
            io = graph.session.io_binding()
            for name, value in feeds.inputs.items():
                io.bind_cpu_input(name, value)
            for name in ["logits"] + feeds.fetch:  # bound first: the first outputs come back
                io.bind_output(name)
            for past, present, value in feeds.shared:
                io.bind_ortvalue_input(past, value)
                io.bind_ortvalue_output(present, value)
            graph.session.run_with_iobinding(io)
            out: list[np.ndarray] = [value.numpy() for value in io.get_outputs()[:1 + len(feeds.fetch)]]
        else:
            out = graph.session.run(["logits"] + feeds.fetch, feeds.inputs)
        cache.update(out[1:])
        logits: np.ndarray = out[0][:, -1] if width == 1 else out[0]
        return logits
