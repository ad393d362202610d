"""Which attention maps Predict returns: the layers, heads and window of query rows a request asks for
(posenc.v1 PredictRequest.layers, heads, query_start, query_count), checked and cut out of the graph's output.

The exact graph computes every layer's and head's probabilities for every query row of its call, whatever is asked
for; a selection smaller than that is copied out of the output and the output let go before the answer is
serialised, so the worker holds no more than it returns while it writes the answer."""

from __future__ import annotations

import numpy as np

from service.errors import InvalidArgument
from service.jobs import MapRequest, Result


def query_rows(attention: MapRequest, start: int, count: int, length: int) -> slice:
    """The prompt rows (positions from 0) whose maps are returned: a window of ATTENTION_FULL's rows (count 0 = to
    the prompt's end), the last position for LAST_ROW.  A window that is negative, past the prompt's end or given
    with another mode is refused in one line."""
    if attention is not MapRequest.FULL:
        if start or count:
            raise InvalidArgument(f"query_start and query_count need attention=ATTENTION_FULL (got query_start={start},"
                                  f" query_count={count} with {attention.name})")
        return slice(length - 1, length) if attention is MapRequest.LAST_ROW else slice(0, 0)
    if start < 0 or count < 0:
        raise InvalidArgument(f"query_start and query_count must be >= 0, got query_start={start}, "
                              f"query_count={count}")
    stop = length if count == 0 else start + count
    if start >= length or stop > length:
        raise InvalidArgument(f"query rows {start}..{stop - 1} are past the prompt's {length} tokens (rows 0.."
                              f"{length - 1}; query_count 0 = to the end)")
    return slice(start, stop)


def select(result: Result, layers: list[int], heads: list[int], rows: slice,
           attention: MapRequest) -> list[tuple[int, int, np.ndarray]]:
    """(layer, head, map [rows, keys]) for each layer and head asked for, and result.attentions let go.  Views of
    the graph's output where they are all of it; otherwise copies, so the output is freed here, before the answer
    is written, not after."""
    out = result.attentions
    result.attentions = None
    if attention is MapRequest.NONE or out is None:
        return []
    if attention is MapRequest.LAST_ROW:  # the engine kept only the last row: (L, H, 1, keys)
        rows = slice(0, out.shape[2])
    whole = len(layers) * len(heads) == out.shape[0] * out.shape[1] and rows.stop - rows.start == out.shape[2]
    return [(layer, head, out[layer, head, rows] if whole else out[layer, head, rows].copy())
            for layer in layers for head in heads]


def sink_mass(amap: np.ndarray) -> np.ndarray:
    """Per row of a map [rows, keys] of a model with attention sinks: the probability the sink took, 1 - the row's
    sum over the keys (summed in float64, so only the probabilities' own float32 rounding remains)."""
    mass: np.ndarray = (1.0 - amap.sum(axis=-1, dtype=np.float64)).astype(np.float32)
    return mass
