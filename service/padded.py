"""The padded layout: rows left-padded to the longest under the attention mask (every exact graph, and a fast graph
whose attention is the exact graph's).

A prompt call pads each row's new tokens to the longest on the left and its past to the longest past (a variant's
fixed-size state stacked as it is); each row's result is cut back to its own slots.  The decode batch carries the
tensors as onnxruntime returned them: a step's present outputs are the next step's pasts, so a step copies nothing
in Python; a regroup copies once, the pad trimmed to the longest row.  Positions come from the mask in the graph,
so each row's result is the one it gets alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from service.jobs import Job, MapRequest
from service.kvcache import Codec, KVCache, KVSpec, Row, State, StepFeeds, Stream, length
from service.settings import Tuning


class PaddedCodec(Codec):
    """A prompt call's rows left-padded under the mask."""

    name = "padded"

    @classmethod
    def prompt_feeds(cls, spec: KVSpec, jobs: list[Job]) -> tuple[dict[str, np.ndarray], np.ndarray]:
        B = len(jobs)
        T = max(len(j.ids) for j in jobs)
        P = max(0 if j.state is None else length(j.state) for j in jobs)
        ids = np.zeros((B, T), np.int64)
        mask = np.zeros((B, P + T), np.int64)
        kv = spec.growing
        initial = [] if all(kv) else spec.empty(1)  # only a fixed-size state needs it
        state = [np.zeros((B, spec.kv_heads, P, spec.head_dim), np.float32) if g else np.repeat(initial[s], B, axis=0)
                 for s, g in enumerate(kv)]
        for b, j in enumerate(jobs):
            t, p = len(j.ids), 0 if j.state is None else length(j.state)
            ids[b, T - t:] = j.ids
            mask[b, P - p:P] = 1
            mask[b, P + T - t:] = 1
            for s, tensor in enumerate(j.state or []):
                if kv[s]:
                    state[s][b, :, P - p:] = tensor
                else:
                    state[s][b] = tensor
        feeds: dict[str, np.ndarray] = {"input_ids": ids, "attention_mask": mask}
        for carried, tensor in zip(spec.state, state, strict=True):
            feeds[carried.input] = tensor
        return feeds, np.full(B, T - 1)

    @classmethod
    def prompt_rows(cls, spec: KVSpec, jobs: list[Job], feeds: dict[str, np.ndarray], out: dict[str, Any],
                    last_only: bool) -> list[Row]:
        T = feeds["input_ids"].shape[1]
        P = feeds["attention_mask"].shape[1] - T
        kv = spec.growing
        rows: list[Row] = []
        for b, j in enumerate(jobs):
            t, p = len(j.ids), 0 if j.state is None else length(j.state)
            # this row's own key slots: its past, then its new tokens; one range (a view, no copy) when either
            # part fills its whole span
            keys = slice(P - p, P + T) if t == T else slice(P + T - t, P + T) if p == 0 else \
                np.r_[P - p:P, P + T - t:P + T]
            first = T - 1 if j.attention is MapRequest.LAST_ROW else T - t  # query rows the job wants
            att = None if j.attention is MapRequest.NONE else out["attentions"][b, T - t:] \
                if j.attention is MapRequest.PROFILE else out["attentions"][b][:, :, first:][..., keys]
            state = [out[name][b][:, keys] if g else out[name][b]
                     for name, g in zip(spec.outputs, kv, strict=True)] if j.want_state else None
            logits = out["logits"][b, :1] if last_only else out["logits"][b, T - t:]
            rows.append((logits, att, state))
        return rows


class PaddedCache(KVCache):
    """A decode batch's tensors as onnxruntime returned them, each row left-padded under the mask."""

    def __init__(self, spec: KVSpec, tuning: Tuning | None = None):
        super().__init__(spec, tuning)
        self.growing = spec.growing
        self.tensors: list[np.ndarray] = []  # (B, H, P, Dh) per KV tensor, (B, ...) per fixed-size one
        self.mask = np.zeros((0, 0), np.int64)  # (B, P): 1 for each row's real cache slots
        self._stepped = self.mask  # the running step's mask (P + 1 wide)
        self._fetch = spec.outputs  # a step's presents: the next step's pasts

    def take(self, b: int) -> State:
        n = int(self.lengths[b])
        return [t[b, :, t.shape[2] - n:].copy() if g else t[b].copy()
                for t, g in zip(self.tensors, self.growing, strict=True)]

    def regroup(self, keep: list[int], entering: list[State], streams: Sequence[Stream], coming: int = 0
                ) -> list[int]:
        """Kept rows' slots from the old tensors, then the entering caches, left-padded to the new longest row."""
        old, k = self.tensors, len(keep)
        self.lengths = np.concatenate([self.lengths[keep], [length(s) for s in entering]]).astype(np.int64)
        if not self.rows:
            self.clear()
            return keep
        spec = self.spec
        B, P = self.rows, int(self.lengths.max())
        idx = np.asarray(keep, np.intp)
        self.tensors = []
        for g in self.growing:  # tensor by tensor, each old one and each entering row's taken from its list (so
            # let go once copied): the regroup holds one tensor twice at most, not the whole cache
            past = old.pop(0) if old else None  # (no old tensors when the batch was empty)
            parts = [state.pop(0) for state in entering]
            if g:
                t = np.zeros((B, spec.kv_heads, P, spec.head_dim), np.float32)
                if k and past is not None:  # kept rows' real slots lie in the last P columns of the old cache
                    span = min(P, past.shape[2])
                    t[:k, :, P - span:] = past[idx, :, past.shape[2] - span:]
                for j, part in enumerate(parts):
                    t[k + j, :, P - part.shape[1]:] = part
            else:
                t = np.concatenate(([past[idx]] if k and past is not None else []) + [part[None] for part in parts])
            self.tensors.append(t)
            del past, parts
        self.mask = (np.arange(P)[None, :] >= (P - self.lengths)[:, None]).astype(np.int64)
        return keep

    @property
    def drops(self) -> bool:
        return all(self.growing)  # a fixed-size state cannot give back a token

    def step_feeds(self, ids: np.ndarray) -> StepFeeds:
        self._stepped = np.concatenate([self.mask, np.ones(ids.shape, np.int64)], axis=1)
        feeds = {"input_ids": ids, "attention_mask": self._stepped}
        for carried, tensor in zip(self.spec.state, self.tensors, strict=True):
            feeds[carried.input] = tensor
        return StepFeeds(feeds, self._fetch, [])

    def update(self, fetched: list[np.ndarray]) -> None:
        self.lengths += self._stepped.shape[1] - self.mask.shape[1]  # the step's new tokens per row
        self.tensors, self.mask = fetched, self._stepped

    def drop(self, n: int) -> None:
        self.tensors = [np.ascontiguousarray(t[:, :, :t.shape[2] - n]) for t in self.tensors]
        self.mask, self.lengths = self.mask[:, :self.mask.shape[1] - n], self.lengths - n

    def clear(self) -> None:
        self.tensors, self.mask, self.lengths = [], np.zeros((0, 0), np.int64), np.zeros(0, np.int64)
