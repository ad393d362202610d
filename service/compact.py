"""The compact layout: a fast graph whose attention is onnxruntime's GroupQueryAttention (export/gqa.py).

Each row's KV cache lies from slot 0 of its row, right-padded, and the graph is told each row's length
(`seqlens_k`: its total length minus one) instead of reading a mask over left-padded rows.  The attention mask is
still fed, for the positions alone: each new token's position is the count of ones before it in its row.

- A prompt call (service/executor.py): rows right-padded, `total_sequence_length` the padded length when no row has a
  past (onnxruntime's "first prompt").  onnxruntime's kernel refuses several rows with a past and more than one new
  token each, so such calls run a row at a time.  The present keys and values it fetches are written, through
  IOBinding, into arrays in pages of their own (`CompactCodec.presents`), which go back to the kernel once the decode
  batch has copied their rows in, instead of staying in onnxruntime's arena beside the batch's buffers.
- A decode step (service/batch.py): one buffer per cache tensor, (rows, KV heads, capacity, head dim), bound
  through IOBinding as both the past input and the present output.  The kernel writes each row's new key and value
  at that row's own slot, so a step copies nothing, allocates no cache, and the cache is held once (a padded step
  holds the past and the present it concatenates).  Rows joining and leaving move single rows within the buffers;
  they are made again only when the rows outgrow their slots (Tuning.rows at a time, with room for the streams
  whose prompts are still being prefilled) or the longest row the
  capacity (Tuning.grow positions more, or what the rows may still need if less), and made smaller at a rebuild
  where they hold more than Tuning.shrink times what the open streams need (a long row gone); those values are
  service/settings.py's Tuning.
"""

from __future__ import annotations

import math
import mmap
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import onnxruntime as ort

from service.jobs import Job
from service.kvcache import Codec, KVCache, KVSpec, Row, State, StepFeeds, Stream, length
from service.settings import Tuning


def step_feeds(ids: np.ndarray, lengths: np.ndarray) -> dict[str, np.ndarray]:
    """A decode step's small inputs: rows of `lengths` cached positions each take ids.shape[1] new tokens (one, or
    a lone row's several: onnxruntime's kernel takes several new tokens on a past for one row alone)."""
    t = ids.shape[1]
    width = int(lengths.max()) + t
    mask = (np.arange(width)[None, :] >= (width - t - lengths)[:, None]).astype(np.int64)  # lengths + t ones
    return {"input_ids": ids, "attention_mask": mask, "seqlens_k": (lengths + t - 1).astype(np.int32),
            "total_sequence_length": np.array(width, np.int32)}


Allocate = Callable[[tuple[int, ...], type], np.ndarray]  # a buffer of this shape and dtype (`buffer`)


class CompactCodec(Codec):
    """A prompt call's rows right-padded, each row's cache from slot 0 and its length in seqlens_k."""

    name = "compact"
    inputs = ("seqlens_k", "total_sequence_length")
    kv_only = True

    @classmethod
    def calls(cls, jobs: list[Job]) -> list[list[Job]]:
        """onnxruntime's kernel takes several new tokens on a past for one row at a time ("batch_size must be 1
        when sequence_length > 1 and past context is given", GroupQueryAttention in onnxruntime 1.32): such calls
        run row by row, and a prompt's piece never shares a call with the decode batch's one-token rows."""
        if len(jobs) > 1 and max(len(j.ids) for j in jobs) > 1 and any(j.state is not None for j in jobs):
            return [[j] for j in jobs]
        return [jobs]

    @classmethod
    def prompt_feeds(cls, spec: KVSpec, jobs: list[Job]) -> tuple[dict[str, np.ndarray], np.ndarray]:
        """New tokens and pasts right-padded, seqlens_k, total_sequence_length (the padded length when no row has a
        past: onnxruntime's first prompt), and the mask for positions."""
        B = len(jobs)
        T = max(len(j.ids) for j in jobs)
        P = max(0 if j.state is None else length(j.state) for j in jobs)
        ids = np.zeros((B, T), np.int64)
        mask = np.zeros((B, P + T), np.int64)
        seqlens = np.zeros(B, np.int32)
        pasts: list[np.ndarray] = [np.zeros((B, spec.kv_heads, P, spec.head_dim), spec.dtype) for _ in spec.state]
        for b, j in enumerate(jobs):
            t, p = len(j.ids), 0 if j.state is None else length(j.state)
            ids[b, :t] = j.ids
            mask[b, :p] = 1
            mask[b, P:P + t] = 1
            seqlens[b] = p + t - 1
            for s, tensor in enumerate(j.state or []):
                pasts[s][b, :, :p] = tensor
        feeds: dict[str, np.ndarray] = {"input_ids": ids, "attention_mask": mask, "seqlens_k": seqlens,
                 "total_sequence_length": np.array(T if P == 0 else P + T, np.int32)}
        feeds.update({carried.input: tensor for carried, tensor in zip(spec.state, pasts, strict=True)})
        return feeds, np.array([len(j.ids) - 1 for j in jobs])

    @classmethod
    def presents(cls, spec: KVSpec, feeds: dict[str, np.ndarray], names: list[str]) -> dict[str, np.ndarray]:
        """The present keys and values a prompt call fetches, each (rows, H, past + new tokens, Dh) in pages of its
        own (`buffer`): onnxruntime would put them in its arena, which keeps their memory once the decode batch has
        copied them into its buffers (188 MB for 32 prompts of 128 tokens of SmolLM-135M's shape, resident beside
        those buffers for as long as the worker runs); a buffer goes back to the kernel when its last row is
        copied (CompactCache._enter takes each row's tensors from its list)."""
        rows, new = feeds["input_ids"].shape
        return {carried.output: buffer((rows, spec.kv_heads, feeds[carried.input].shape[2] + new, spec.head_dim),
                                       spec.dtype) for carried in spec.state if carried.output in names}

    @classmethod
    def prompt_rows(cls, spec: KVSpec, jobs: list[Job], feeds: dict[str, np.ndarray], out: dict[str, Any],
                    last_only: bool) -> list[Row]:
        """Per job its logits and its cache (its past and new tokens' slots, views); a fast graph has no maps."""
        rows: list[Row] = []
        for b, j in enumerate(jobs):
            total = int(feeds["seqlens_k"][b]) + 1  # its past and its new tokens, from slot 0
            state = [out[name][b][:, :total] for name in spec.outputs] if j.want_state else None
            rows.append((out["logits"][b, :1] if last_only else out["logits"][b, :len(j.ids)], None, state))
        return rows


class CompactCache(KVCache):
    """The decode batch's KV caches in the compact layout: per cache tensor one buffer (row slots, H, capacity, Dh),
    of which the first `rows` rows are the batch, and an OrtValue over those rows' memory, bound as both past and
    present.  Row slots come in multiples of Tuning.rows, so streams joining or leaving move single rows (a leaving
    row's slot takes the last row) instead of copying the whole cache; the buffers are made again only when the rows
    outgrow the slots or the longest row the capacity, or when they are `oversized` for the streams.  Slots past a
    row's length are never read (uninitialised)."""

    def __init__(self, spec: KVSpec, tuning: Tuning | None = None, allocate: Allocate | None = None):
        super().__init__(spec, tuning)
        self.allocate = allocate or buffer  # where its buffers come from (a part given in: tests give one that fails)
        self.tensors = len(spec.state)
        self.buffers: list[np.ndarray] = []
        self.values: list[ort.OrtValue] = []
        self._shared: list[tuple[str, str, ort.OrtValue]] = []  # a step's (past, present, value) bindings
        self.remade = 0  # buffers made anew (tests: joins and leaves that fit move rows instead)
        self._width = 1  # the running step's new tokens per row

    # --- the decode batch: shared buffers ----------------------------------------------------------------------

    @property
    def capacity(self) -> int:
        return self.buffers[0].shape[2] if self.buffers else 0

    @property
    def nbytes(self) -> int:
        return sum(buf.nbytes for buf in self.buffers)

    def _oversized(self, rows: int, capacity: int) -> bool:
        """Whether the buffers hold more than Tuning.shrink times what `rows` rows of `capacity` positions take."""
        return bool(self.buffers) and \
            self.buffers[0].shape[0] * self.capacity > self.tuning.shrink * self._slots(rows) * capacity

    def oversized(self, streams: Sequence[Stream]) -> bool:
        return bool(self.rows) and self._oversized(self.rows, capacity_for(streams, self.tuning.grow))

    def take(self, b: int) -> State:
        return [buf[b, :, :int(self.lengths[b])].copy() for buf in self.buffers]

    def regroup(self, keep: list[int], entering: list[State], streams: Sequence[Stream], coming: int = 0
                ) -> list[int]:
        """In place when they fit: each kept row past the new end moves into a leaving row's slot, while the
        buffers hold the longest row's next step and the `coming` rows too, and are not oversized for them.
        Otherwise new buffers, sized for the streams (those outside the batch too: they come back, so buffers shrink
        where a stream has gone, not where one steps aside), with row slots for the coming ones: 32 prompts
        arriving at once make the buffers once, not at every Tuning.rows of them (each time copying every row
        joined so far).  Slots no row has used cost address space, not memory (see `buffer`)."""
        lengths = np.concatenate([self.lengths[keep], [length(s) for s in entering]]).astype(np.int64)
        need = int(lengths.max()) + 1 if len(lengths) else 0  # the next step's longest row
        order = self._regroup(keep, entering, capacity_for(streams, self.tuning.grow) if len(lengths) else 0, need,
                              coming)
        self.lengths = np.concatenate([self.lengths[order], lengths[len(keep):]]).astype(np.int64)
        return order

    def grow(self, streams: Sequence[Stream], ahead: int = 1) -> bool:
        if not self.rows or self.lengths.max() + ahead <= self.capacity:
            return False
        # the longest row reached the end
        need = int(self.lengths.max()) + ahead
        self._regroup(list(range(self.rows)), [], max(capacity_for(streams, self.tuning.grow), need))
        return True

    def _regroup(self, keep: list[int], entering: list[State], capacity: int, need: int = 0, coming: int = 0
                 ) -> list[int]:
        """The kept rows' old indices in their new order; `need` 0 asks for new buffers of `capacity` positions,
        each old buffer and each entering cache freed once copied, so this holds one tensor twice at most."""
        k, rows = len(keep), len(keep) + len(entering)
        room = rows + coming if rows else 0  # row slots wanted
        if rows and self.buffers and room <= self.buffers[0].shape[0] and 0 < need <= self.capacity and \
                not self._oversized(room, capacity):
            kept = set(keep)
            movers = iter(b for b in keep if b >= k)
            order = [b if b in kept else next(movers) for b in range(k)]
            for buf in self.buffers:
                for slot, b in enumerate(order):
                    if slot != b:
                        buf[slot] = buf[b]
                self._enter(buf, k, entering)
        else:
            order, old = list(keep), self.buffers
            self.buffers, self.values, self._shared = [], [], []  # nothing else holds the old buffers
            idx = np.asarray(keep, np.intp)
            for _ in range(self.tensors if rows else 0):
                buf = self.allocate((self._slots(room), self.spec.kv_heads, capacity, self.spec.head_dim),
                                    self.spec.dtype)
                if k:  # the old buffer taken from its list, so let go once copied
                    past = old.pop(0)
                    span = min(capacity, past.shape[2])  # every kept row's slots lie below both capacities
                    buf[:k, :, :span] = past[idx, :, :span]
                    del past
                self._enter(buf, k, entering)
                self.buffers.append(buf)
            self.remade += bool(rows)
        self.values = [ort.OrtValue.ortvalue_from_numpy(buf[:rows]) for buf in self.buffers]
        self._shared = [(carried.input, carried.output, value)
                        for carried, value in zip(self.spec.state, self.values, strict=True)] if rows else []
        return order

    def _slots(self, rows: int) -> int:
        """Row slots for this many rows: Tuning.rows at a time."""
        return -(-rows // self.tuning.rows) * self.tuning.rows

    @staticmethod
    def _enter(buf: np.ndarray, k: int, entering: list[State]) -> None:
        """Each entering row's next cache tensor (buffers are filled in the state's order) into its row after the k
        kept ones, taken from the row's list, so let go once copied."""
        for j, state in enumerate(entering):
            part = state.pop(0)
            buf[k + j, :, :part.shape[1]] = part

    def step_feeds(self, ids: np.ndarray) -> StepFeeds:
        """Past and present bound to the same memory: only the logits are fetched."""
        self._width = ids.shape[1]
        return StepFeeds(step_feeds(ids, self.lengths), [], self._shared)

    def update(self, fetched: list[np.ndarray]) -> None:
        self.lengths += self._width  # each row's keys and values were written at its own slots

    @property
    def drops(self) -> bool:
        return True

    def drop(self, n: int) -> None:
        self.lengths -= n  # the slots past each row's length are never read

    def clear(self) -> None:
        self.buffers, self.values, self._shared, self.lengths = [], [], [], np.zeros(0, np.int64)


def buffer(shape: tuple[int, ...], dtype: type = np.float32) -> np.ndarray:
    """A cache buffer (float32, or float16 for a float16 fast graph) in pages of its own (an anonymous mapping):
    the kernel maps a page when a row first writes it, so row slots no row has used are not resident, and the whole
    buffer goes back to the kernel when the last view of it goes (a buffer from malloc's heap may reuse pages another
    allocation left resident, and its freed pages may stay resident after it).  No address space left is a
    MemoryError, as numpy's would be (the decode loop ends the batch's streams with RESOURCE_EXHAUSTED)."""
    count, size = math.prod(shape), np.dtype(dtype).itemsize
    try:
        pages = mmap.mmap(-1, max(count * size, 1))
    except OSError as err:
        raise MemoryError(f"cannot map {count * size} bytes for a KV cache buffer: {err}") from None
    return np.frombuffer(pages, dtype, count=count).reshape(shape)


def capacity_for(streams: Sequence[Stream], grow: int) -> int:
    """Buffer positions for streams of these cached lengths that may grow to these rooms: one more than the longest,
    and up to `grow` more while some stream may still need them."""
    longest = max(s.cached for s in streams) + 1
    return max(longest, min(max(s.room for s in streams), longest - 1 + grow))
