"""KServe v2 `inference.GRPCInferenceService` (tritonclient-compatible) on the worker's port.

ModelInfer takes input_ids INT64 [batch, seq] and an optional attention_mask INT64 [batch, seq] (0 = left
padding), checked by service.kserve_request as the REST front's are, and returns logits FP32 [batch, seq, vocab]
and attentions FP32 [batch, layers, heads, seq, seq], raw, one buffer per output in the order of `outputs`
(docs/design.md, "KServe v2 on the wire").  Prefill only: the KV cache is posenc.v1's Generate.

A model with a profile graph also returns `profile` FP32 [batch, layers, heads, columns] when a request names it:
each row's attention profile (service/profile.py), averaged over the last `profile_last` query rows (a request
parameter; 0 or absent: all), its columns named in the model config's `profile_columns` parameter and in the
output's `columns` parameter (comma-separated: the distance buckets, then first, entropy[, learned_sink]).

A model whose layers have learned attention sinks (model.json layers[].sinks) also returns `sink_mass` FP32
[batch, layers, heads, seq] when a request names it: the probability each query row's sink took, 1 - the row's sum
over the prompt's keys in `attentions` (0 for a padded query row and for a layer without sinks), as posenc.v1
Predict's AttentionMap.sink_mass.  It comes from the profile graph's `learned_sink` column, each row's real tokens a
job run in pieces as a profile's are, so no call holds more than one layer of one profile piece's maps, whatever
else is asked; an artifact without a profile graph reads it from the maps, counted against the message limit as if
`attentions` were asked for (service.kserve_request).

A request with the optional input `position_ids` INT64 [batch, seq], or any intervention parameter (`shift`,
`stretch`, `positional_off`, `ablate_heads`, `rope_scaling`), runs under that intervention: every row in one call of
the model's intervention graph, each with its own positions (service/kserve_intervene.py).  ModelMetadata lists
position_ids where the model's intervention graph takes positions.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from protos.inference import config, grpc_service_pb2_grpc, model_config_pb2
from protos.inference import grpc_service_pb2 as kv
from service import kserve_intervene, profile
from service.artifacts import LoadedModel
from service.auth import charge
from service.errors import InvalidArgument
from service.jobs import Job, MapRequest, awaited
from service.kserve_request import (
    PROFILE,
    SINK_MASS,
    VERSION,
    Checked,
    InferCall,
    Tensor,
    check,
    model_of,
    sinks_in_graph,
)
from service.maps_window import sink_mass
from service.operations import Operations
from service.rpc import capped_deadline, unary

if TYPE_CHECKING:
    import grpc

EXTENSIONS = ["model_configuration"]


def io_tensors(m: LoadedModel) -> tuple[list[tuple[str, str, list[int]]], list[tuple[str, str, list[int]]]]:
    """(name, datatype, full shape with -1 for variable dims) of the inputs and outputs ModelInfer exposes."""
    inputs = [("input_ids", "INT64", [-1, -1]), ("attention_mask", "INT64", [-1, -1])]
    if kserve_intervene.takes_positions(m):
        inputs.append((kserve_intervene.POSITION_IDS, "INT64", [-1, -1]))
    outputs = [("logits", "FP32", [-1, -1, m.vocab_size]),
               ("attentions", "FP32", [-1, m.n_layers, m.n_heads, -1, -1])]
    columns = profile_columns(m)
    if columns:
        outputs.append((PROFILE, "FP32", [-1, m.n_layers, m.n_heads, len(columns)]))
    if m.meta.sink_layers:
        outputs.append((SINK_MASS, "FP32", [-1, m.n_layers, m.n_heads, -1]))
    return inputs, outputs


def profile_columns(m: LoadedModel) -> list[str]:
    """The `profile` output's columns, or [] for a model without a profile graph."""
    return list(m.meta.profile.columns) if m.meta.profile is not None and m.profile is not None else []


def sink_masses(attentions: np.ndarray, mask: np.ndarray, sink_layers: frozenset[int]) -> np.ndarray:
    """[batch, layers, heads, seq] from attentions [batch, layers, heads, seq, seq]: each query row's sink mass, 1 -
    its sum over the keys, where the row is a real token of a layer with sinks; 0 elsewhere."""
    mass = sink_mass(attentions)
    layers = np.isin(np.arange(attentions.shape[1]), list(sink_layers))
    keep = (mask[:, None, None, :] == 1) & layers[None, :, None, None]
    out: np.ndarray = np.where(keep, mass, np.float32(0))
    return out


@dataclass
class SinkRows(Job):
    """A profile job (MapRequest.PROFILE: the profile graph, in pieces) that keeps each query row's `column` (the
    learned sink's mass) instead of summing the rows: the result's attentions are (T, layers, heads)."""

    column: int = -1
    rows: list[np.ndarray] = field(default_factory=list, repr=False)

    def add_profile(self, rows: np.ndarray | None, first: int) -> np.ndarray | None:
        if rows is None:
            return None
        self.rows.append(np.array(rows[..., self.column], np.float32))  # a copy: the call's output is let go
        return np.concatenate(self.rows) if first + len(rows) == len(self.ids) else None


def graph_sink_masses(ops: Operations, name: str, ids: np.ndarray, mask: np.ndarray,
                      deadline: float | None) -> np.ndarray:
    """[batch, layers, heads, seq] from the profile graph's learned_sink column: each row's real tokens (mask 1) one
    job, the jobs batched by the model's engine in pieces that share one profile piece's budget of query rows x
    keys (service.profile.PIECE_CELLS); 0 on padded query rows and on layers without sinks."""
    with ops.registry.acquire(name) as served:
        model = served.model
        assert model.meta.profile is not None  # (sinks_in_graph: the model has a profile graph)
        column = model.meta.profile.columns.index(profile.LEARNED_SINK)
        rows = [np.flatnonzero(keep) for keep in mask]
        futures, cells = [], profile.PIECE_CELLS // len(rows)  # the rows run together: one profile piece's budget
        for row, real in zip(ids, rows, strict=True):
            toks = np.asarray(ops.tokens(model, None, row[real].tolist()), np.int64)
            futures.append(served.engine.submit(SinkRows(toks, None, MapRequest.PROFILE, deadline, want_state=False,
                                                         last_only=True, column=column,
                                                         max_piece=max(1, cells // len(toks)))))
        out = np.zeros((*mask.shape[:1], model.n_layers, model.n_heads, mask.shape[1]), np.float32)
        for b, (real, future) in enumerate(zip(rows, futures, strict=True)):
            got = awaited(future, deadline).attentions  # (T, layers, heads)
            if got is None:
                raise RuntimeError(f"model {name!r} answered a sink job without its rows")
            out[b][..., real] = got.transpose(1, 2, 0)
        out[:, ~np.isin(np.arange(model.n_layers), list(model.meta.sink_layers))] = 0
        return out


def param(value: kv.InferParameter) -> int | str | bool | None:
    """A KServe InferParameter's value, whichever of its fields is set."""
    kind = value.WhichOneof("parameter_choice")
    return None if kind is None else getattr(value, kind)


def model_config(m: LoadedModel) -> model_config_pb2.ModelConfig:
    """What ModelInfer takes and returns, from the builder config.pbtxt is written with (export triton)."""
    inputs, outputs = io_tensors(m)
    cfg = config.model_config(m.name, m.meta.variant, [config.Tensor(*t) for t in inputs],
                              [config.Tensor(*t) for t in outputs])
    if profile_columns(m):
        cfg.parameters["profile_columns"].string_value = ",".join(profile_columns(m))
    return cfg


def from_grpc(request: kv.ModelInferRequest) -> InferCall:
    """The neutral request from ModelInfer's message: raw buffers (one per input) or typed INT64 contents."""
    if request.raw_input_contents and len(request.raw_input_contents) != len(request.inputs):
        raise InvalidArgument(f"{len(request.raw_input_contents)} raw buffers for {len(request.inputs)} inputs")
    inputs = []
    for i, t in enumerate(request.inputs):
        if request.raw_input_contents:
            values = request.raw_input_contents[i]
        else:  # typed contents: INT64 is the only datatype ModelInfer takes
            values = np.asarray(t.contents.int64_contents, np.int64)
        inputs.append(Tensor(t.name, t.datatype, list(t.shape), values))
    return InferCall(request.model_name, request.model_version, request.id, inputs,
                     [o.name for o in request.outputs], {k: param(v) for k, v in request.parameters.items()})


class KServeServicer(grpc_service_pb2_grpc.GRPCInferenceServiceServicer):
    def __init__(self, ops: Operations, ready: Callable[[], bool], instance: str = ""):
        self.ops, self.registry, self.ready, self.instance = ops, ops.registry, ready, instance

    def _model(self, name: str, version: str = "") -> LoadedModel:
        return model_of(self.ops, name, version)

    @unary
    def ServerLive(self, request: kv.ServerLiveRequest, context: grpc.ServicerContext) -> kv.ServerLiveResponse:
        return kv.ServerLiveResponse(live=True)

    @unary
    def ServerReady(self, request: kv.ServerReadyRequest, context: grpc.ServicerContext) -> kv.ServerReadyResponse:
        return kv.ServerReadyResponse(ready=self.ready())

    @unary
    def ModelReady(self, request: kv.ModelReadyRequest, context: grpc.ServicerContext) -> kv.ModelReadyResponse:
        return kv.ModelReadyResponse(ready=self.ready() and request.name in self.registry.served
                                     and request.version in ("", VERSION))

    @unary
    def ServerMetadata(self, request: kv.ServerMetadataRequest,
                       context: grpc.ServicerContext) -> kv.ServerMetadataResponse:
        return kv.ServerMetadataResponse(name="posenc", version="0.1.0", extensions=EXTENSIONS)

    @unary
    def ModelMetadata(self, request: kv.ModelMetadataRequest,
                      context: grpc.ServicerContext) -> kv.ModelMetadataResponse:
        m = self._model(request.name, request.version)
        inputs, outputs = io_tensors(m)
        T = kv.ModelMetadataResponse.TensorMetadata
        return kv.ModelMetadataResponse(name=m.name, versions=[VERSION], platform="onnxruntime_onnx",
                                        inputs=[T(name=n, datatype=d, shape=s) for n, d, s in inputs],
                                        outputs=[T(name=n, datatype=d, shape=s) for n, d, s in outputs])

    @unary
    def ModelConfig(self, request: kv.ModelConfigRequest, context: grpc.ServicerContext) -> kv.ModelConfigResponse:
        return kv.ModelConfigResponse(config=model_config(self._model(request.name, request.version)))

    @unary
    def ModelInfer(self, request: kv.ModelInferRequest, context: grpc.ServicerContext) -> kv.ModelInferResponse:
        checked, out = self.infer(from_grpc(request), capped_deadline(context, self.registry.limits.max_request_s))
        resp = kv.ModelInferResponse(model_name=checked.model.name, model_version=VERSION, id=request.id)
        for name in checked.outputs:
            array = np.ascontiguousarray(out[name], "<f4")
            tensor = kv.ModelInferResponse.InferOutputTensor(name=name, datatype="FP32", shape=list(array.shape))
            if name == PROFILE:
                tensor.parameters["columns"].string_param = ",".join(profile_columns(checked.model))
            resp.outputs.append(tensor)
            resp.raw_output_contents.append(array.tobytes())
        return resp

    def infer(self, call: InferCall, deadline: float | None) -> tuple[Checked, dict[str, np.ndarray]]:
        """A request from either transport, checked once, through the model's engine like every other request
        (batched with them, queue-limited, deadline-bound): (what was checked, output name -> float32 array)."""
        checked = check(call, self.ops)
        charge(len(checked.ids), "rows", "input_ids")  # each row one unit, whichever outputs run (idempotent)
        wanted, out = set(checked.outputs), {}
        if checked.rows is not None:  # under an intervention; sink_mass from its maps
            names = [*checked.outputs, *(["attentions"] if SINK_MASS in wanted else [])]
            out = kserve_intervene.infer(self.ops, checked.model.name, checked.rows, checked.mask, names,
                                         checked.profile_last, deadline)
            if SINK_MASS in wanted:
                att = out["attentions"] if "attentions" in wanted else out.pop("attentions")
                out[SINK_MASS] = sink_masses(att, checked.mask, checked.model.meta.sink_layers)
            return checked, out
        in_graph = SINK_MASS in wanted and sinks_in_graph(checked.model)
        maps = "attentions" in wanted or (SINK_MASS in wanted and not in_graph)
        if maps or "logits" in wanted:
            out = self.ops.infer(checked.model.name, checked.ids, checked.mask, maps, deadline)
        if in_graph:
            out[SINK_MASS] = graph_sink_masses(self.ops, checked.model.name, checked.ids, checked.mask, deadline)
        elif SINK_MASS in wanted:
            att = out["attentions"] if "attentions" in wanted else out.pop("attentions")
            out[SINK_MASS] = sink_masses(att, checked.mask, checked.model.meta.sink_layers)
        if PROFILE in checked.outputs:
            out[PROFILE] = profile.batch(self.ops, checked.model.name, checked.ids, checked.mask,
                                         checked.profile_last, deadline)
        return checked, out
