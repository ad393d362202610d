"""The KV-cache interface: how a graph lays out rows' caches, for a prompt call and for the decode loop's batch.

A layout is one subclass of KVCache, named as model.json's `fast.layout` names it, listed in service/layouts.py.
The executor (service/executor.py) asks the layout of the graph it runs for a prompt call's feeds and each row's
share of the outputs; the decode loop (service/decoder.py) holds one instance for its batch and only ever calls the
methods below, never asking which layout it holds:

  regroup   the rows kept (old indices) and the streams coming in (their own caches) become the batch: joins and
            leaves at one step boundary, in one rebuild
  take      a row leaving with its state (a stream too far ahead of its reader, or rotated out) gets its own cache
  grow      before a step: room for every row's next position (True when it made new buffers)
  oversized whether a regroup now would free memory held for streams that have gone
  step_feeds / update
            one decode step: its inputs (and the outputs bound to the cache's own memory, written in place), then
            the fetched outputs carried into the batch

`lengths[b]` is row b's cached positions; the cache keeps it (a step adds one to every row).  onnxruntime-genai's
KeyValueCache (Add: the step's inputs and outputs; Update: the outputs become the next pasts) has this shape.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple, Protocol

import numpy as np
import onnxruntime as ort

from service.settings import Tuning

if TYPE_CHECKING:
    from service.artifacts import LoadedModel
    from service.jobs import Job

State = list[np.ndarray]  # one row's own carried tensors: per state tensor (H, length, Dh), or its fixed-size one
# a prompt call's share of the outputs for one job: (logits, attention maps or None, its state or None)
Row = tuple[np.ndarray, np.ndarray | None, State | None]


class Stream(Protocol):
    """What a cache sizes its buffers by (service.generation.Generation is one)."""

    cached: int  # positions in its cache

    @property
    def room(self) -> int:  # the most positions it may occupy
        ...


class StepFeeds(NamedTuple):
    """A decode step's call: plain inputs, the outputs fetched besides the logits (handed to update()), and the
    cache tensors bound as both an input and an output (one buffer the step writes its keys and values into)."""

    inputs: dict[str, np.ndarray]
    fetch: list[str]
    shared: list[tuple[str, str, ort.OrtValue]]  # (input, output, value)


def length(state: State) -> int:
    """A row's cached positions: state[0] is a KV tensor (H, length, Dh)."""
    positions: int = state[0].shape[1]
    return positions


class KVCache(ABC):
    """One decode batch's caches in one layout; the class methods are the layout's prompt calls."""

    name: ClassVar[str]  # model.json's fast.layout
    inputs: ClassVar[tuple[str, ...]] = ()  # the graph's inputs beyond model.json's, which the layout feeds
    kv_only: ClassVar[bool] = False  # whether it carries KV caches alone (no variant's fixed-size state)

    def __init__(self, model: LoadedModel, tuning: Tuning | None = None):
        self.model, self.tuning = model, tuning or Tuning()  # its sizes (the compact layout's grow, rows, shrink)
        self.lengths = np.zeros(0, np.int64)  # row b's cached positions

    @property
    def rows(self) -> int:
        return len(self.lengths)

    # --- prompt calls --------------------------------------------------------------------------------------------

    @classmethod
    def calls(cls, jobs: list[Job]) -> list[list[Job]]:
        """How a group of jobs runs: one call, unless the layout's kernels take it apart."""
        return [jobs]

    @classmethod
    @abstractmethod
    def prompt_feeds(cls, model: LoadedModel, jobs: list[Job]) -> tuple[dict[str, np.ndarray], np.ndarray]:
        """A call's inputs for jobs (new ids on their own past), and each row's last new token's position."""

    @classmethod
    @abstractmethod
    def prompt_rows(cls, model: LoadedModel, jobs: list[Job], feeds: dict[str, np.ndarray], out: dict[str, Any],
                    last_only: bool) -> list[Row]:
        """Each job's share of the call's outputs: its logits ((1, V) with last_only, else one per new token), its
        attention maps where it asked, its cache (past and new tokens) where it wants its state."""

    # --- the decode batch -----------------------------------------------------------------------------------------

    @abstractmethod
    def take(self, b: int) -> State:
        """Row b's own cache, a copy (the row leaves; its slot is about to be reused)."""

    @abstractmethod
    def regroup(self, keep: list[int], entering: list[State], streams: Sequence[Stream], coming: int = 0
                ) -> list[int]:
        """The kept rows (old indices) then the entering caches become the batch; the entering states are let go
        as they are copied.  Returns the kept rows' old indices in their new order (entering rows follow them).
        streams: those the cache serves (the new batch's and those outside it that come back), for sizing;
        coming: streams whose prompts are still being prefilled, which a layout may make room for now."""

    def grow(self, streams: Sequence[Stream]) -> bool:
        """Make room for every row's next position before a step; True when new buffers were made."""
        return False

    def oversized(self, streams: Sequence[Stream]) -> bool:
        """Whether the batch holds far more memory than these streams need (a regroup now would free it)."""
        return False

    @abstractmethod
    def step_feeds(self, ids: np.ndarray) -> StepFeeds:
        """A decode step's call: every row takes its one new token ids[b, 0]."""

    @abstractmethod
    def update(self, fetched: list[np.ndarray]) -> None:
        """After the step: the fetched outputs (StepFeeds.fetch, in order) carried in; every row one longer."""

    @abstractmethod
    def clear(self) -> None:
        """No rows (a failed step or regroup drops the batch)."""
