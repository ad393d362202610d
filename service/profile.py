"""Attention profiles (posenc.v1 Profile, KServe's `profile` output, POST /v1/posenc/profile): per layer and head,
the attention mass by relative distance in log-2 buckets, the mass on the first position, the rows' mean entropy
(and a learned sink's mass where the model has one), averaged over the query rows asked for: every row, or the
last N.

The artifact's profile graph (export/profile.py) reduces each query row's maps inside the graph, one layer at a
time, and a long prompt runs in pieces like any prompt without maps (the engine's budget of rows per call), each
piece's counted rows summed as it comes back (Job.add_profile); so neither the graph nor the worker ever holds a
prompt's T x T maps, and the answer's size depends on the layers, heads and log2 of the length only."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from service.errors import FailedPrecondition, InvalidArgument
from service.jobs import WHOLE_MAP_CELLS, Job, MapRequest, awaited

if TYPE_CHECKING:
    from service.operations import Operations

# the columns after the distance buckets, in the graph's order (export/profile.py); a learned sink's comes last
FIRST, ENTROPY, LEARNED_SINK = "first", "entropy", "learned_sink"
# query rows x keys of one profile call: a piece's per-layer temporaries are each that many floats per head, so a
# long prompt's pieces are short (2,048 tokens: 32 rows a call), a short prompt's as long as any call's
PIECE_CELLS = 2**16


@dataclass
class Profiled:
    """A profile: `values` (layers, heads, columns) float32, each column named in `columns`."""

    ids: list[int]
    values: np.ndarray
    columns: list[str]
    query_start: int  # the first prompt row averaged (rows query_start .. len(ids) - 1)
    tokenizer: Any = None
    total_ms: float = 0.0
    queue_ms: float = 0.0
    compute_ms: float = 0.0
    buckets: list[str] = field(default_factory=list)  # the distance columns' names (the first len(buckets) columns)
    mixer_layers: list[int] = field(default_factory=list)  # a mixers' profile (mixer_maps): each entry's layer
    mixer_heads: list[int] = field(default_factory=list)  # and how many of its heads are its own

    @property
    def query_count(self) -> int:
        return len(self.ids) - self.query_start

    def column(self, name: str) -> np.ndarray:
        """One column for every layer and head: (layers, heads)."""
        return self.values[:, :, self.columns.index(name)]

    @property
    def distance(self) -> np.ndarray:
        """The mass by distance bucket: (layers, heads, buckets)."""
        return self.values[:, :, :len(self.buckets)]


def first_row(last: int, length: int) -> int:
    """The first prompt row averaged: every row (last 0) or the last `last` rows; more rows than the prompt has, or
    a negative count, is refused in one line."""
    if last < 0 or last > length:
        raise InvalidArgument(f"last must be in [0, {length}] for a {length}-token prompt (0 = every query row), "
                              f"got {last}")
    return length - last if last else 0


def reachable(buckets: int, length: int) -> int:
    """Buckets a prompt of `length` tokens can put mass in: distances 0 .. length - 1."""
    return min(buckets, max(length - 1, 0).bit_length() + 1)


def no_profile(name: str) -> FailedPrecondition:
    """The answer for a model whose artifact has no profile graph, with an intervention or without."""
    return FailedPrecondition(f"model {name!r} has no profile graph (an artifact exported without one, or a copy "
                              "whose model.onnx changed); re-export it to ask for profiles")


def profile(ops: Operations, name: str, text: str | None, ids: list[int] | None, last: int = 0,
            deadline: float | None = None, every_bucket: bool = False) -> Profiled:
    """The prompt's attention profile on model `name`, averaged over its last `last` query rows (0: all).  The
    distance buckets are those the prompt can reach (0, 1, 2-3, ... up to its length), or with `every_bucket` all
    of the graph's (those past the prompt hold 0); an artifact without a profile graph is
    FAILED_PRECONDITION."""
    start = time.monotonic()
    with ops.registry.acquire(name) as served:
        model = served.model
        spec = model.meta.profile
        if model.profile is None or spec is None:
            raise no_profile(name)
        toks = ops.tokens(model, text, ids)
        begin = first_row(last, len(toks))
        whole = model.meta.whole_maps and len(toks) ** 2 <= WHOLE_MAP_CELLS  # Mamba-2 rows need the whole prompt
        job = Job(np.asarray(toks, np.int64), None, MapRequest.PROFILE, deadline, want_state=False, last_only=True,
                  profile_from=begin, max_piece=len(toks) if whole else max(1, PIECE_CELLS // len(toks)), whole=whole)
        result = awaited(served.engine.submit(job), deadline)
        total, result.attentions = result.attentions, None  # (L, H, C) sums of the counted rows, float64
        if total is None:
            raise RuntimeError(f"model {name!r} answered a profile job without its sums")
        keep = spec.buckets if every_bucket else reachable(spec.buckets, len(toks))
        cols = list(range(keep)) + list(range(spec.buckets, len(spec.columns)))
        values = (total[:, :, cols] / (len(toks) - begin)).astype(np.float32)
        buckets = list(spec.columns[:keep])
        return Profiled(toks, values, buckets + list(spec.columns[spec.buckets:]), begin, model.tokenizer,
                        (time.monotonic() - start) * 1000, result.queue_ms, result.compute_ms, buckets)


def batch(ops: Operations, name: str, ids: np.ndarray, mask: np.ndarray, last: int = 0,
          deadline: float | None = None) -> np.ndarray:
    """KServe's `profile` output: (batch, layers, heads, columns) float32, each row of `ids` profiled alone over its
    unpadded tokens (mask 1), with every column of the model's graph (model.json's profile.columns), so all rows
    and every prompt length share one shape."""
    return np.stack([profile(ops, name, None, [int(t) for t in row[keep == 1]], last, deadline,
                             every_bucket=True).values for row, keep in zip(ids, mask, strict=True)])
