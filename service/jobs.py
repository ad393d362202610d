"""What passes between a model's callers and its engine (service/engine.py): a Job (a sequence's new tokens on its
cached state, and what its caller wants back) and its Result."""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from collections.abc import Hashable


class MapRequest(enum.Enum):
    """Which attention probabilities a request wants: one type from the request down to onnxruntime."""

    NONE = "none"
    LAST_ROW = "last_row"  # the last query's row over every key
    FULL = "full"  # every query row
    PROFILE = "profile"  # the profile graph's reduced rows (export/profile.py), summed over the rows asked for


# the most query rows x keys a prompt that needs to run whole for its maps (Job.whole) runs as one call; a longer
# prompt runs in pieces as any other, its Mamba-2 rows then spanning each piece's keys (docs/mixers.md)
WHOLE_MAP_CELLS = 2**22


@dataclass
class Job:
    ids: np.ndarray  # (T,) int64 new tokens
    state: list[np.ndarray] | None  # per state tensor (H, P, Dh), or None for no past
    attention: MapRequest = MapRequest.NONE
    deadline: float | None = None  # time.monotonic() seconds
    want_state: bool = True  # False for Predict / Score: the carried tensors are not fetched from onnxruntime
    last_only: bool = False  # its caller reads the last position's logits alone: Result.logits is (1, V)
    future: Future[Result] = field(default_factory=Future)
    enqueued: float = field(default_factory=time.monotonic)
    done: int = 0  # tokens of ids already run (a prompt longer than the budget runs in pieces)
    parts: list[Any] = field(default_factory=list, repr=False)  # the pieces' logits, then their cost
    # reduce(logits, first): a block of the job's consecutive logits rows (n, V) and the index of its first row in
    # ids -> a list of n (or fewer) items.  Set, the engine reduces each piece's logits as it comes and the Result
    # carries the items (Result.reduced) and the last position's logits alone, so a long prompt's Score or echo
    # never holds its T x V logits
    reduce: Callable[[np.ndarray, int], list[Any]] | None = field(default=None, repr=False)
    reduced: list[Any] = field(default_factory=list, repr=False)
    # MapRequest.PROFILE: the first prompt row whose profile counts (earlier pieces run without one), and the sum of
    # the counted rows' profiles so far (L, H, C), float64
    profile_from: int = 0
    max_piece: int = 0  # the most new tokens of one call (0: the engine's token budget alone)
    profile: np.ndarray | None = field(default=None, repr=False)
    # the prefix cache's hashes of its whole blocks (service/prefix.py), where it may start on the cache and store
    # its blocks at its end; prefix_key: the key of the reduce items it needs (None: none)
    hashes: list[bytes] = field(default_factory=list, repr=False)
    prefix_key: Hashable | None = None
    # its maps or profile need the prompt in one call: a Mamba-2 layer's rows span only the keys of their own call
    # (ModelJson.whole_maps), so pieces would cut them
    whole: bool = False

    @property
    def divisible(self) -> bool:
        """Whether it may run in pieces: every attention map's row must span the same keys, so FULL maps may not,
        nor the maps or profile of a job that needs its prompt whole."""
        return self.attention is not MapRequest.FULL and not (self.whole and self.attention is not MapRequest.NONE)

    def piece_attention(self, first: int, n: int) -> MapRequest:
        """What the piece of rows first .. first + n - 1 wants: maps on the last piece only; a profile on every
        piece holding a counted row."""
        if self.attention is MapRequest.PROFILE:
            return self.attention if first + n > self.profile_from else MapRequest.NONE
        return self.attention if first + n == len(self.ids) else MapRequest.NONE

    def add_profile(self, rows: np.ndarray | None, first: int) -> np.ndarray | None:
        """A piece's profile rows (n, L, H, C), its first row at prompt row `first`, added to the running sum of the
        counted rows; returns the sum."""
        if rows is not None:
            counted = rows[max(self.profile_from - first, 0):].sum(axis=0, dtype=np.float64)
            self.profile = counted if self.profile is None else self.profile + counted
        return self.profile

    @property
    def length(self) -> int:
        """Key positions this job occupies: its cached past plus its new tokens."""
        return len(self.ids) + (0 if self.state is None else self.state[0].shape[1])


@dataclass
class Result:
    logits: np.ndarray  # (T, V); (1, V): the last position alone, for a last_only job on a fast graph
    attentions: np.ndarray | None  # (L, H, T, P + T); (L, H, 1, P + T) for MapRequest.LAST_ROW
    state: list[np.ndarray] | None  # per state tensor (H, P + T, Dh); None when the job did not want it
    queue_ms: float
    compute_ms: float
    batch_size: int
    reduced: list[Any] | None = None  # Job.reduce's items over every row, for a job that gave one


def awaited(future: Future[Result], deadline: float | None) -> Result:
    """A job's result: waited for until the request's deadline, and 5 s more for a call already running (a job still
    queued at the deadline is settled by the engine with DEADLINE_EXCEEDED first)."""
    timeout = None if deadline is None else max(deadline - time.monotonic(), 0) + 5.0
    return future.result(timeout=timeout)
