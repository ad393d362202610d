"""The compact layout: a fast graph whose attention is onnxruntime's GroupQueryAttention (export/gqa.py).

Each row's KV cache lies from slot 0 of its row, right-padded, and the graph is told each row's length
(`seqlens_k`: its total length minus one) instead of reading a mask over left-padded rows.  The attention mask is
still fed, for the positions alone: each new token's position is the count of ones before it in its row.

- A prompt call (Scheduler.run): rows right-padded, `total_sequence_length` the padded length when no row has a
  past (onnxruntime's "first prompt").  onnxruntime's kernel refuses several rows with a past and more than one new
  token each, so the scheduler runs such calls a row at a time.
- A decode step (service/decoder.py): one buffer per cache tensor, (rows, KV heads, capacity, head dim), bound
  through IOBinding as both the past input and the present output.  The kernel writes each row's new key and value
  at that row's own slot, so a step copies nothing, allocates no cache, and the cache is held once (a padded step
  holds the past and the present it concatenates).  Rows joining and leaving move single rows within the buffers;
  they are made again only when the rows outgrow their slots (ROWS at a time) or the longest row the capacity
  (GROW positions more, or what the rows may still need if less), and made smaller at a rebuild where they hold
  more than SHRINK times what the open streams need (a long row gone).
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort

GROW = 64  # positions a decode batch's buffers hold past its longest row, when a row may go that far
ROWS = 8  # the batch's row slots come in multiples of this
# buffers holding more than this many times what the rows need are made again at what they need: a factor, not
# any row that leaves, so a batch whose rows come and go does not remake its buffers back and forth
SHRINK = 2


def prompt_feeds(m, jobs) -> dict[str, np.ndarray]:
    """A prompt call's inputs for jobs with .ids and .state (model m): new tokens and pasts right-padded,
    seqlens_k, total_sequence_length (the padded length when no row has a past: onnxruntime's first prompt), and
    the mask for positions."""
    B = len(jobs)
    T = max(len(j.ids) for j in jobs)
    P = max(0 if j.state is None else j.state[0].shape[1] for j in jobs)
    ids = np.zeros((B, T), np.int64)
    mask = np.zeros((B, P + T), np.int64)
    seqlens = np.zeros(B, np.int32)
    pasts = [np.zeros((B, m.kv_heads, P, m.head_dim), np.float32) for _ in m.state]
    for b, j in enumerate(jobs):
        t, p = len(j.ids), 0 if j.state is None else j.state[0].shape[1]
        ids[b, :t] = j.ids
        mask[b, :p] = 1
        mask[b, P:P + t] = 1
        seqlens[b] = p + t - 1
        for s, tensor in enumerate(j.state or []):
            pasts[s][b, :, :p] = tensor
    feeds = {"input_ids": ids, "attention_mask": mask, "seqlens_k": seqlens,
             "total_sequence_length": np.array(T if P == 0 else P + T, np.int32)}
    feeds.update({spec["input"]: tensor for spec, tensor in zip(m.state, pasts, strict=True)})
    return feeds


def run_prompts(m, jobs, feeds: dict[str, np.ndarray], last_only: bool) -> list[tuple[np.ndarray, list | None]]:
    """Run a prompt call; per job its logits ((1, V) with last_only, else one row per new token) and its cache
    (its past and new tokens' slots, views), or None where the job wants no state."""
    names = ["logits"] + ([spec["output"] for spec in m.state] if any(j.want_state for j in jobs) else [])
    out = dict(zip(names, m.fast.run(names, feeds), strict=True))
    rows = []
    for b, j in enumerate(jobs):
        total = int(feeds["seqlens_k"][b]) + 1  # its past and its new tokens, from slot 0
        state = [out[spec["output"]][b][:, :total] for spec in m.state] if j.want_state else None
        rows.append((out["logits"][b, :1] if last_only else out["logits"][b, :len(j.ids)], state))
    return rows


def step_feeds(ids: np.ndarray, lengths: np.ndarray) -> dict[str, np.ndarray]:
    """A decode step's small inputs: rows of `lengths` cached positions each take one new token."""
    width = int(lengths.max()) + 1
    mask = (np.arange(width)[None, :] >= (width - 1 - lengths)[:, None]).astype(np.int64)  # lengths + 1 ones
    return {"input_ids": ids, "attention_mask": mask, "seqlens_k": lengths.astype(np.int32),
            "total_sequence_length": np.array(width, np.int32)}


class SharedCache:
    """The decode batch's KV caches in the compact layout: per cache tensor one buffer (row slots, H, capacity, Dh),
    of which the first `rows` rows are the batch, and an OrtValue over those rows' memory, bound as both past and
    present.  Row slots come in multiples of ROWS, so streams joining or leaving move single rows (a leaving row's
    slot takes the last row) instead of copying the whole cache; the buffers are made again only when the rows
    outgrow the slots or the longest row the capacity, or when they are `oversized` for the rows.  Slots past a
    row's length are never read (np.empty)."""

    def __init__(self, kv_heads: int, head_dim: int, tensors: int):
        self.kv_heads, self.head_dim, self.tensors = kv_heads, head_dim, tensors
        self.buffers: list[np.ndarray] = []
        self.values: list[ort.OrtValue] = []
        self.rows = 0
        self.remade = 0  # buffers made anew (tests: joins and leaves that fit move rows instead)

    @property
    def capacity(self) -> int:
        return self.buffers[0].shape[2] if self.buffers else 0

    @property
    def nbytes(self) -> int:
        return sum(buf.nbytes for buf in self.buffers)

    def oversized(self, rows: int, capacity: int) -> bool:
        """Whether the buffers hold more than SHRINK times what `rows` rows of `capacity` positions take."""
        return bool(self.buffers) and self.buffers[0].shape[0] * self.capacity > SHRINK * slots(rows) * capacity

    def take(self, b: int, length: int) -> list[np.ndarray]:
        """Row b's own cache (a copy: the row's slot is about to be reused)."""
        return [buf[b, :, :length].copy() for buf in self.buffers]

    def regroup(self, keep: list[int], entering: list[list[np.ndarray]], capacity: int, need: int = 0) -> list[int]:
        """The kept rows (old indices) and the entering rows' own caches become the batch; returns the kept rows'
        old indices in their new order (entering rows follow them).  In place when they fit: each kept row past the
        new end moves into a leaving row's slot, while the buffers hold `need` positions (the longest row's next
        step; 0 asks for new buffers) and are not oversized for `capacity`.  Otherwise new buffers of `capacity`
        positions: each old buffer and each entering cache freed once copied, so this holds one tensor twice at
        most."""
        k, rows = len(keep), len(keep) + len(entering)
        if rows and self.buffers and rows <= self.buffers[0].shape[0] and 0 < need <= self.capacity and \
                not self.oversized(rows, capacity):
            kept = set(keep)
            movers = iter(b for b in keep if b >= k)
            order = [b if b in kept else next(movers) for b in range(k)]
            for n, buf in enumerate(self.buffers):
                for slot, b in enumerate(order):
                    if slot != b:
                        buf[slot] = buf[b]
                self._enter(n, buf, k, entering)
        else:
            order, old = list(keep), self.buffers
            self.buffers, self.values = [], []
            idx = np.asarray(keep, np.intp)
            for n in range(self.tensors if rows else 0):
                buf = np.empty((slots(rows), self.kv_heads, capacity, self.head_dim), np.float32)
                if k:
                    span = min(capacity, old[n].shape[2])  # every kept row's slots lie below both capacities
                    buf[:k, :, :span] = old[n][idx, :, :span]
                    old[n] = None
                self._enter(n, buf, k, entering)
                self.buffers.append(buf)
            self.remade += bool(rows)
        self.rows = rows
        self.values = [ort.OrtValue.ortvalue_from_numpy(buf[:rows]) for buf in self.buffers]
        return order

    @staticmethod
    def _enter(n: int, buf: np.ndarray, k: int, entering: list[list[np.ndarray]]) -> None:
        for j, state in enumerate(entering):
            buf[k + j, :, :state[n].shape[1]] = state[n]
            state[n] = None

    def clear(self) -> None:
        self.buffers, self.values, self.rows = [], [], 0


def slots(rows: int) -> int:
    """Row slots for this many rows: ROWS at a time."""
    return -(-rows // ROWS) * ROWS


def capacity_for(lengths: list[int], rooms: list[int]) -> int:
    """Buffer positions for rows of these cached lengths that may grow to these rooms: one more than the longest row,
    and up to GROW more while some row may still need them."""
    longest = max(lengths) + 1
    return max(longest, min(max(rooms), longest - 1 + GROW))


def run_step(m, ids: np.ndarray, lengths: np.ndarray, cache: SharedCache) -> np.ndarray:
    """One decode step on the shared buffers, past and present bound to the same memory; only the logits are
    fetched: (B, V)."""
    io = m.fast.io_binding()
    for name, value in step_feeds(ids, lengths).items():
        io.bind_cpu_input(name, value)
    if m.logits_positions is not None:
        io.bind_cpu_input(m.logits_positions, np.zeros((len(ids), 1), np.int64))
    io.bind_output("logits")
    for spec, value in zip(m.state, cache.values, strict=True):
        io.bind_ortvalue_input(spec["input"], value)
        io.bind_ortvalue_output(spec["output"], value)
    m.fast.run_with_iobinding(io)
    return io.get_outputs()[0].numpy()[:, -1]
