"""The KV-cache interface: how a graph lays out rows' caches, for a prompt call and for the decode loop's batch.

A layout (service/layouts.py) is two classes, named as model.json's `fast.layout` names it:

- its `Codec`, the prompt call's wire format: a group of jobs' feeds, and each job's share of the outputs.  It
  holds nothing; the executor (service/executor.py) asks the codec of the graph it runs.
- its `KVCache`, one decode batch's buffers.  The decode batch (service/batch.py) holds one instance and only ever
  calls the methods below, never asking which layout it holds:

  regroup   the rows kept (old indices) and the streams coming in (their own caches) become the batch: joins and
            leaves at one step boundary, in one rebuild
  take      a row leaving with its state (a stream too far ahead of its reader, or rotated out) gets its own cache
  grow      before a step: room for every row's next position (True when it made new buffers)
  oversized whether a regroup now would free memory held for streams that have gone
  step_feeds / update
            one decode step: its inputs (and the outputs bound to the cache's own memory, written in place), then
            the fetched outputs carried into the batch; every row takes one new token, or a lone row several (a
            speculative step: its token and the drafts verified in one call)
  drop      after a lone row's speculative step: its last n positions given back (drafts the model did not make);
            `drops` says whether the layout can (a fixed-size state cannot)

Both are given the model's cache geometry alone (`KVSpec`: heads, head size, the carried tensors, the dtype), not
the model.  `lengths[b]` is row b's cached positions; the cache keeps it (a step adds one to every row).
onnxruntime-genai's KeyValueCache (Add: the step's inputs and outputs; Update: the outputs become the next pasts)
has this shape.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple, Protocol

import numpy as np
import onnxruntime as ort

from service.jobs import Job
from service.model_json import Carried, ModelJson
from service.settings import Tuning

State = list[np.ndarray]  # one row's own carried tensors: per state tensor (H, length, Dh), or its fixed-size one
# a prompt call's share of the outputs for one job: (logits, attention maps or None, its state or None)
Row = tuple[np.ndarray, np.ndarray | None, State | None]


@dataclass(frozen=True)
class KVSpec:
    """A model's cache geometry, read once from model.json: what every layout needs and nothing else."""

    kv_heads: int  # key/value heads (fewer than the query heads under grouped-query attention)
    head_dim: int
    state: tuple[Carried, ...]  # the carried tensors, in the graph's order
    dtype: type = np.float32  # of the compact layout's buffers: float16 where the fast graph served is float16

    @classmethod
    def of(cls, meta: ModelJson, dtype: type = np.float32) -> KVSpec:
        return cls(meta.sizes.kv_heads, meta.sizes.head_dim, meta.state, dtype)

    @property
    def growing(self) -> list[bool]:
        """Per state tensor: whether it is a KV cache (grows along its sequence axis) or a fixed-size state."""
        return [spec.sequence_axis is not None for spec in self.state]

    @property
    def outputs(self) -> list[str]:
        return [spec.output for spec in self.state]

    def empty(self, batch: int) -> State:
        """The carried tensors before any token: KV of length 0, and zeros of its declared shape for a fixed-size
        state (sequence_axis null: a mixer layer's past_conv.{i} and past_ssm.{i}, cpe's past_conv_state)."""
        return [np.zeros((batch, self.kv_heads, 0, self.head_dim), np.float32) if spec.sequence_axis is not None
                else np.zeros((batch, *(int(d) for d in (spec.shape or ())[1:])), np.float32)
                for spec in self.state]


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


class Codec(ABC):
    """A layout's prompt calls: a group of jobs' inputs, and each job's share of the outputs."""

    name: ClassVar[str]  # model.json's fast.layout
    inputs: ClassVar[tuple[str, ...]] = ()  # the graph's inputs beyond model.json's, which the layout feeds
    kv_only: ClassVar[bool] = False  # whether it carries KV caches alone (no fixed-size state)

    @classmethod
    def calls(cls, jobs: list[Job]) -> list[list[Job]]:
        """How a group of jobs runs: one call, unless the layout's kernels take it apart."""
        return [jobs]

    @classmethod
    @abstractmethod
    def prompt_feeds(cls, spec: KVSpec, jobs: list[Job]) -> tuple[dict[str, np.ndarray], np.ndarray]:
        """A call's inputs for jobs (new ids on their own past), and each row's last new token's position."""

    @classmethod
    def presents(cls, spec: KVSpec, feeds: dict[str, np.ndarray], names: list[str]) -> dict[str, np.ndarray]:
        """Arrays a prompt call writes the fetched `names` among its present outputs into (bound through
        IOBinding), by output name; none: onnxruntime allocates every output."""
        return {}

    @classmethod
    @abstractmethod
    def prompt_rows(cls, spec: KVSpec, jobs: list[Job], feeds: dict[str, np.ndarray], out: dict[str, Any],
                    last_only: bool) -> list[Row]:
        """Each job's share of the call's outputs: its logits ((1, V) with last_only, else one per new token), its
        attention maps where it asked, its cache (past and new tokens) where it wants its state."""


class KVCache(ABC):
    """One decode batch's caches in one layout."""

    def __init__(self, spec: KVSpec, tuning: Tuning | None = None):
        self.spec, self.tuning = spec, tuning or Tuning()  # its sizes (the compact layout's grow, rows, shrink)
        self.lengths = np.zeros(0, np.int64)  # row b's cached positions

    @property
    def rows(self) -> int:
        return len(self.lengths)

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

    def grow(self, streams: Sequence[Stream], ahead: int = 1) -> bool:
        """Make room for every row's next `ahead` positions before a step; True when new buffers were made."""
        return False

    def oversized(self, streams: Sequence[Stream]) -> bool:
        """Whether the batch holds far more memory than these streams need (a regroup now would free it)."""
        return False

    @abstractmethod
    def step_feeds(self, ids: np.ndarray) -> StepFeeds:
        """A decode step's call: every row takes its new tokens ids[b] (one each, or a lone row's several)."""

    @abstractmethod
    def update(self, fetched: list[np.ndarray]) -> None:
        """After the step: the fetched outputs (StepFeeds.fetch, in order) carried in; every row as many positions
        longer as it took tokens."""

    @property
    def drops(self) -> bool:
        """Whether `drop` can give back a row's last positions (every carried tensor a KV cache)."""
        return False

    def drop(self, n: int) -> None:
        """A lone row's last n positions given back: drafts of a speculative step the model did not make."""
        raise NotImplementedError(f"the {type(self).__name__} layout cannot give back positions")

    @abstractmethod
    def clear(self) -> None:
        """No rows (a failed step or regroup drops the batch)."""


class Layout(NamedTuple):
    """A layout: its prompt calls' codec and its decode batch's cache class."""

    codec: type[Codec]
    cache: type[KVCache]

    @property
    def name(self) -> str:
        return self.codec.name
