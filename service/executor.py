"""The executor of a model's calls: builds the feeds of a group of jobs or a decode step and runs onnxruntime.

Every onnxruntime call of a model goes through Executor.run, on behalf of its scheduler (service/scheduler.py, which
decides what runs when) and the decode loop (service/decoder.py, through the scheduler).  A group of jobs is one
call: left-padded (new tokens to the longest, the KV cache to the longest past; a variant's fixed-size state stacked
as it is) on the exact or the padded fast graph, or right-padded on a compact fast graph (service/compact.py); each
row's result is cut back to its own slots.  A decode step runs on the batch's carried tensors, or writes into the
compact layout's shared buffers.
"""

from __future__ import annotations

import time

import numpy as np

from service import compact
from service.artifacts import LoadedModel
from service.jobs import Job, MapRequest, Result, Step


class Executor:
    """One model's onnxruntime calls: feeds built, the session run, results per job."""

    def __init__(self, model: LoadedModel, on_batch=None):
        self.model = model
        self.on_batch = on_batch  # called with the size of every batch sent to onnxruntime
        self.rows_run = 0  # rows sent to onnxruntime so far (for metrics and tests)

    def run(self, jobs: list[Job] | Step) -> list[Result] | tuple[np.ndarray, list[np.ndarray]]:
        """Every onnxruntime call of the model goes through here.  A group of jobs: one call, left-padded (new
        tokens to the longest, the KV cache to the longest past; a variant's fixed-size state stacked as it is) or
        compact (_run_compact), a Result per job.  A decode Step: ((B, V) logits, the state for the next step)."""
        if isinstance(jobs, Step):
            return self._step(jobs)
        m, maps = self.model, any(j.attention is not MapRequest.NONE for j in jobs)
        session = m.session_for(maps)  # the fast graph (fused operators, no maps) unless a row wants maps
        if session is m.fast and m.layout == "compact":
            return self._run_compact(jobs)
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
        names = ["logits"] + (["attentions"] if maps else [])
        want_state = any(j.want_state for j in jobs)
        names += [spec["output"] for spec in m.state] if want_state else []
        last_only = self._positions(session, jobs, feeds, np.full(B, T - 1))
        start = self._count(B)
        out = dict(zip(names, session.run(names, feeds), strict=True))
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
            logits = out["logits"][b, :1] if last_only else out["logits"][b, T - t:]
            results.append(Result(logits, att, rows, (start - j.enqueued) * 1000, compute_ms, B))
        return results

    def _positions(self, session, jobs: list[Job], feeds: dict, last: np.ndarray) -> bool:
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

    def _run_compact(self, jobs: list[Job]) -> list[Result]:
        """A prompt call on a compact fast graph (service/compact.py); onnxruntime's kernel takes several new tokens
        on a past for one row at a time, so such calls run row by row."""
        m = self.model
        if len(jobs) > 1 and max(len(j.ids) for j in jobs) > 1 and any(j.state is not None for j in jobs):
            return [self._run_compact([j])[0] for j in jobs]
        feeds = compact.prompt_feeds(m, jobs)
        last_only = self._positions(m.fast, jobs, feeds, np.array([len(j.ids) - 1 for j in jobs]))
        start = self._count(len(jobs))
        rows = compact.run_prompts(m, jobs, feeds, last_only)
        compute_ms = (time.monotonic() - start) * 1000
        return [Result(logits, None, state, (start - j.enqueued) * 1000, compute_ms, len(jobs))
                for j, (logits, state) in zip(jobs, rows, strict=True)]

    def _count(self, rows: int) -> float:
        """Count a call's rows (metrics, tests); returns when it starts."""
        self.rows_run += rows
        if self.on_batch is not None:
            self.on_batch(rows)
        return time.monotonic()

    def _step(self, step: Step) -> tuple[np.ndarray, list[np.ndarray] | compact.SharedCache]:
        m = self.model
        self._count(len(step))
        if isinstance(step.state, compact.SharedCache):  # written in place: only the logits come back
            return compact.run_step(m, step.ids, step.lengths, step.state), step.state
        feeds = {"input_ids": step.ids, "attention_mask": step.mask}
        if m.logits_positions is not None:  # the fast graph's (the step runs it when there is one)
            feeds[m.logits_positions] = np.zeros((len(step), 1), np.int64)  # the step's one position
        for spec, tensor in zip(m.state, step.state, strict=True):
            feeds[spec["input"]] = tensor
        out = m.session_for(False).run(["logits"] + [spec["output"] for spec in m.state], feeds)
        return out[0][:, -1], out[1:]
