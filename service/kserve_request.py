"""One KServe v2 inference request, whichever transport brought it, checked in one place.

gRPC ModelInfer (service/kserve.py) and the REST front (service/http/kserve_rest.py) each decode their wire format
into an `InferCall` (tensors as numpy arrays, the outputs asked for), and `check` turns it into the model and the
arrays the model runs on, or refuses it with INVALID_ARGUMENT / NOT_FOUND / RESOURCE_EXHAUSTED naming what to
change.  Only the decoding differs per transport (raw buffers and typed contents; JSON data and binary parts).
A request with `position_ids` or an intervention parameter is resolved here too, row by row
(service/kserve_intervene.py), so a bad one is refused before anything runs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from service import kserve_intervene
from service.artifacts import LoadedModel
from service.errors import InvalidArgument, NotFound, TooLarge
from service.intervention import Row
from service.kserve_intervene import POSITION_IDS
from service.operations import Operations
from service.profile import LEARNED_SINK

VERSION = "1"
INPUTS = ("input_ids", "attention_mask", POSITION_IDS)
OUTPUTS = ("logits", "attentions")  # what a request naming no outputs gets
PROFILE = "profile"  # asked for by name only, where the model has a profile graph (service/profile.py)
SINK_MASS = "sink_mass"  # asked for by name only, where the model's layers have attention sinks (model.json)
PROFILE_LAST = "profile_last"  # the request parameter: average the last N query rows of each prompt (0: all)
DTYPES = {"BOOL": np.bool_, "INT8": np.int8, "INT16": np.int16, "INT32": np.int32, "INT64": np.int64,
          "UINT8": np.uint8, "UINT16": np.uint16, "UINT32": np.uint32, "UINT64": np.uint64, "FP16": np.float16,
          "FP32": np.float32, "FP64": np.float64}


@dataclass(frozen=True)
class Tensor:
    """An input tensor as sent: its name, KServe datatype, shape, and its values: flat and row-major, as an array
    or as little-endian bytes (gRPC raw_input_contents, REST binary data), read once the datatype is checked."""

    name: str
    datatype: str
    shape: list[int]
    values: np.ndarray | bytes | memoryview


@dataclass(frozen=True)
class InferCall:
    model: str
    version: str = ""
    id: str = ""
    inputs: list[Tensor] = field(default_factory=list)
    outputs: list[str] = field(default_factory=list)  # empty: logits and attentions
    parameters: dict[str, Any] = field(default_factory=dict)  # the request's parameters, name -> value


@dataclass(frozen=True)
class Checked:
    """A request that can run: the model, input_ids and attention_mask [batch, seq] int64, the outputs in order;
    under an intervention, each row's graph inputs (`rows`)."""

    model: LoadedModel
    ids: np.ndarray
    mask: np.ndarray
    outputs: list[str]
    profile_last: int = 0
    rows: list[Row] | None = None


def model_of(ops: Operations, name: str, version: str = "") -> LoadedModel:
    if version not in ("", VERSION):
        raise NotFound(f"model {name!r} has no version {version!r}; served version: {VERSION}")
    return ops.model(name)


def _ids(t: Tensor) -> np.ndarray:
    if t.datatype != "INT64":
        raise InvalidArgument(f"input {t.name!r} must be INT64, got {t.datatype}")
    if len(t.shape) != 2 or min(t.shape) < 1:
        raise InvalidArgument(f"input {t.name!r} must have shape [batch, seq] with both >= 1, got {t.shape}")
    count = t.shape[0] * t.shape[1]
    if isinstance(t.values, bytes | memoryview):
        if len(t.values) != count * 8:
            raise InvalidArgument(f"input {t.name!r}: {len(t.values)} bytes of raw data, expected {count * 8} "
                                  f"for shape {t.shape} INT64")
        values = np.frombuffer(t.values, "<i8")
    else:
        values = t.values
        if values.size != count:
            raise InvalidArgument(f"input {t.name!r}: {values.size} values, shape {t.shape} needs {count}")
    return values.reshape(t.shape).astype(np.int64)


def check(call: InferCall, ops: Operations) -> Checked:
    """Everything a KServe inference request must satisfy before it is run, in one place."""
    m = model_of(ops, call.model, call.version)
    names = [t.name for t in call.inputs]
    if sorted(set(names) - set(INPUTS)) or "input_ids" not in names or len(set(names)) != len(names):
        raise InvalidArgument(f"inputs must be input_ids and optionally attention_mask and {POSITION_IDS}, got "
                              f"{names}")
    tensors = {t.name: t for t in call.inputs}
    ids = _ids(tensors["input_ids"])
    if "attention_mask" in tensors:
        mask = _ids(tensors["attention_mask"])
        if mask.shape != ids.shape:
            raise InvalidArgument(f"attention_mask shape {list(mask.shape)} differs from input_ids "
                                  f"{list(ids.shape)}")
        if not np.isin(mask, (0, 1)).all() or (mask.sum(1) == 0).any():
            raise InvalidArgument("attention_mask must be 0/1 with at least one 1 per row")
    else:
        mask = np.ones_like(ids)
    if ids.min() < 0 or ids.max() >= m.vocab_size:
        raise InvalidArgument(f"input_ids must be in [0, {m.vocab_size})")
    B, S = ids.shape
    cap = ops.limits.max_prompt_tokens
    if S > cap or (m.max_positions is not None and S > m.max_positions):
        limit = min(cap, m.max_positions or cap)
        raise InvalidArgument(f"sequence of {S} exceeds the limit of {limit} tokens for model {m.name}")
    wanted = list(call.outputs) or list(OUTPUTS)
    served = (OUTPUTS + ((PROFILE,) if m.meta.profile is not None and m.profile is not None else ())
              + ((SINK_MASS,) if m.meta.sink_layers else ()))
    bad = sorted(set(wanted) - set(served))
    if bad:
        raise InvalidArgument(f"unknown output {bad[0]!r}; this model returns {', '.join(served)}")
    last = call.parameters.get(PROFILE_LAST, 0)
    if isinstance(last, bool) or not isinstance(last, int) or last < 0:
        raise InvalidArgument(f"parameter {PROFILE_LAST} must be an integer >= 0 (0 = every query row), got {last!r}")
    positions = _ids(tensors[POSITION_IDS]) if POSITION_IDS in tensors else None
    rows = None
    if kserve_intervene.wanted(positions, call.parameters):
        edit = kserve_intervene.edit_of(call.parameters)
        rows = kserve_intervene.rows_of(ops, m, ids, mask, positions, edit)
    _check_size(m, B, S, wanted, ops.limits.max_message_bytes, rows is not None)
    return Checked(m, ids, mask, wanted, last, rows)


def sinks_in_graph(m: LoadedModel) -> bool:
    """Whether the model's profile graph reduces each query row's learned-sink mass (export/profile.py), so
    `sink_mass` is computed without the attention maps."""
    return m.profile is not None and m.meta.profile is not None and LEARNED_SINK in m.meta.profile.columns


def _check_size(m: LoadedModel, B: int, S: int, wanted: list[str], limit: int, intervened: bool = False) -> None:
    """The response, and the attention maps it is computed from where they are held (`attentions`, or `sink_mass` of
    a model without a profile graph or under an intervention: every layer and head; under an intervention `profile`
    holds one layer's maps of every row), must fit in 90% of the message limit."""
    maps = "attentions" in wanted or (SINK_MASS in wanted and (intervened or not sinks_in_graph(m)))
    size = 4 * B * S * (m.vocab_size * ("logits" in wanted) + m.n_layers * m.n_heads * S * maps
                        + m.n_layers * m.n_heads * (SINK_MASS in wanted))
    if intervened and PROFILE in wanted and not maps:
        size += 4 * B * S * m.n_heads * S
    if size > limit * 0.9:
        what = "response" if "attentions" in wanted or not maps else \
            "response with the attention maps its sink_mass is read from " + \
            ("(under an intervention)" if intervened else "(this artifact has no profile graph)")
        raise TooLarge(f"{what} would be {size} bytes, over the {limit}-byte message limit; request only the "
                       "logits output or send fewer tokens")
