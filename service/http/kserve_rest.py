"""KServe v2 REST (Open Inference Protocol, HTTP binding) with Triton's binary tensor extension.

Inference builds the same kv.ModelInferRequest that gRPC ModelInfer receives and calls the same
KServeServicer.infer, so names, shapes, dtypes, limits and errors are those of the gRPC front.  Tensor data comes
as JSON (`data`, row-major, nested lists accepted) or as bytes after the JSON part (`binary_data_size`, with the
`Inference-Header-Content-Length` header); outputs are JSON unless `binary_data` asks for bytes
(docs/design.md, "KServe v2 on the wire")."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import TYPE_CHECKING, Annotated, Any, Literal

import numpy as np
from google.protobuf import json_format
from pydantic import BaseModel, ConfigDict, Field, StrictFloat, StrictInt, StrictStr
from starlette.requests import Request
from starlette.responses import Response

from service.http.errors import HttpError, bad_field, validated
from service.http.front import Front, json_object, json_response
from service.http.routing import Api, route
from service.kserve import EXTENSIONS, io_tensors, model_config, profile_columns
from service.kserve_intervene import PARAMETERS
from service.kserve_request import DTYPES, PROFILE, VERSION, InferCall, Tensor

if TYPE_CHECKING:
    from service.artifacts import LoadedModel

HEADER = "inference-header-content-length"
if TYPE_CHECKING:
    Datatype = str  # to the type checker; to pydantic, one of DTYPES' names (built at run time)
else:
    Datatype = Literal[tuple(DTYPES)]
Dim = Annotated[int, Field(strict=True, ge=0, lt=2**31)]


# --- request and response bodies (GET /openapi.json publishes their schemas) ---------------------------------


class TensorParameters(BaseModel):
    model_config = ConfigDict(extra="allow")
    binary_data_size: int | None = Field(None, strict=True, ge=0, description="this input's bytes after the JSON "
                                         "part (Triton's binary tensor extension)")


class InputTensor(BaseModel):
    name: str = Field(strict=True, description="input_ids, attention_mask or (a model whose intervention graph takes "
                      "positions) position_ids")
    shape: list[Dim]
    datatype: Datatype
    data: Any = Field(None, description="the values, row-major: a flat list or nested lists (absent when "
                                        "parameters.binary_data_size is given)",
                      json_schema_extra={"type": ["array", "number", "boolean", "null"]})
    parameters: TensorParameters | None = None


class OutputParameters(BaseModel):
    model_config = ConfigDict(extra="allow")
    binary_data: bool = Field(False, strict=True, description="return this output as bytes after the JSON part")


class RequestedOutput(BaseModel):
    name: str = Field(strict=True, description="logits, attentions, (a model with a profile graph) profile or "
                      "(a model with attention sinks) sink_mass")
    parameters: OutputParameters | None = None


class InferParameters(BaseModel):
    model_config = ConfigDict(extra="allow")
    binary_data_output: bool = Field(False, strict=True, description="every output as bytes after the JSON part")
    profile_last: int = Field(0, strict=True, ge=0, description="the profile output averages each prompt's last N "
                              "query rows (0: every row)")
    # the intervention's (service/kserve_intervene.py): any of them, or the input position_ids, intervenes
    shift: StrictInt | StrictStr | None = Field(None, description="intervention: add K to every counted position")
    stretch: StrictFloat | StrictStr | None = Field(None, description="intervention: token i at round(i x S)")
    positional_off: StrictInt | StrictStr | None = Field(None, description="intervention: layers whose positional "
                                                         "computation is removed, comma-separated (\"1,3\")")
    ablate_heads: StrictStr | None = Field(None, description="intervention: heads whose output is zeroed, "
                                           "comma-separated layer.head pairs (\"0.2,1.0\")")
    rope_scaling: StrictStr | None = Field(None, description="intervention: another RoPE scaling for the call, "
                                           "transformers' rope_parameters as JSON text")


class InferRequest(BaseModel):
    """POST /v2/models/{name}[/versions/{version}]/infer: the Open Inference Protocol's request."""

    id: str | None = Field(None, strict=True)
    inputs: list[InputTensor] = Field(min_length=1)
    outputs: list[RequestedOutput] = Field(default_factory=list, description="default: every output")
    parameters: InferParameters | None = None


class OutputTensor(BaseModel):
    name: str
    datatype: str
    shape: list[int]
    data: list[float] | None = Field(None, description="row-major values (absent when sent as bytes)")
    parameters: dict[str, int | str] | None = Field(None, description="binary_data_size when sent as bytes; the "
                                                    "profile output's columns, comma-separated")


class InferResponse(BaseModel):
    model_name: str
    model_version: str
    id: str | None = None
    outputs: list[OutputTensor]


class TensorMetadata(BaseModel):
    name: str
    datatype: str
    shape: list[int] = Field(description="-1 for a dimension that varies")


class ModelMetadata(BaseModel):
    name: str
    versions: list[str]
    platform: str
    inputs: list[TensorMetadata]
    outputs: list[TensorMetadata]


class ServerMetadata(BaseModel):
    name: str
    version: str
    extensions: list[str]


class Live(BaseModel):
    live: bool


class Ready(BaseModel):
    ready: bool


class ModelReady(BaseModel):
    name: str
    ready: bool


def flatten(data: Any, where: str) -> list[Any]:
    """A row-major flat list of the scalars in (possibly nested) lists, without recursion."""
    if not isinstance(data, list):
        data = [data]
    out: list[Any] = []
    stack = [iter(data)]
    while stack:
        for item in stack[-1]:
            if isinstance(item, list):
                stack.append(iter(item))
                break
            out.append(item)
        else:
            stack.pop()
    for x in out:
        if isinstance(x, (str, dict)) or x is None:
            raise bad_field(where, f"holds {type(x).__name__} {str(x)[:20]!r}; expected numbers")
    return out


def to_array(values: list[Any], datatype: str, where: str) -> np.ndarray:
    dtype = np.dtype(DTYPES[datatype])
    if dtype.kind in "iu" and any(isinstance(x, (bool, float)) for x in values):
        raise bad_field(where, f"{datatype} data must be integers")
    if dtype.kind == "b" and any(not isinstance(x, bool) for x in values):
        raise bad_field(where, "BOOL data must be true or false")
    try:
        return np.asarray(values, dtype)
    except (OverflowError, ValueError, TypeError) as err:
        raise bad_field(where, f"not {datatype} values: {err}") from None


def parse_infer(front: Front, name: str, version: str, body: bytes,
                header_length: str | None) -> tuple[InferCall, set[str], bool]:
    """(the neutral InferCall, binary output names, whether every output is binary) from a REST body."""
    if header_length is not None:
        if not header_length.isdigit() or int(header_length) > len(body):
            raise HttpError(400, f"header Inference-Header-Content-Length {header_length!r} is not a length within "
                                 f"the {len(body)}-byte body")
        split = int(header_length)
        head, binary = body[:split], memoryview(body)[split:]
    else:
        head, binary = body, memoryview(b"")
    req = validated(InferRequest, json_object(head, "inference request"))
    inputs: list[Tensor] = []
    offset, limit = 0, front.limits.max_message_bytes
    for i, t in enumerate(req.inputs):
        where = f"inputs[{i}]"
        count = int(np.prod(t.shape, dtype=object))
        dtype = np.dtype(DTYPES[t.datatype]).newbyteorder("<")
        if count * dtype.itemsize > limit:
            raise HttpError(413, f"input {t.name!r} of shape {t.shape} is over the {limit}-byte message limit")
        size = t.parameters.binary_data_size if t.parameters else None
        if size is not None:
            if offset + size > len(binary):
                raise bad_field(f"{where}.parameters.binary_data_size",
                                f"{size!r} bytes at offset {offset} do not fit the {len(binary)} binary bytes")
            values: memoryview | np.ndarray = binary[offset:offset + size]
            offset += size
            if t.datatype != "INT64":  # bytes of another type: read them as that type, the check says what to send
                if len(values) != count * dtype.itemsize:
                    raise bad_field(f"{where}.parameters.binary_data_size", f"{len(values)} bytes, shape {t.shape} "
                                    f"{t.datatype} needs {count * dtype.itemsize}")
                values = np.frombuffer(values, dtype)
        else:
            if "data" not in t.model_fields_set:
                raise bad_field(f"{where}.data", "missing (and no binary_data_size parameter)")
            flat = flatten(t.data, f"{where}.data")
            if len(flat) != count:
                raise bad_field(f"{where}.data", f"has {len(flat)} values, shape {t.shape} needs {count}")
            values = to_array(flat, t.datatype, f"{where}.data")
        inputs.append(Tensor(t.name, t.datatype, list(t.shape), values))
    if offset != len(binary):
        raise HttpError(400, f"{len(binary) - offset} binary bytes after the JSON part belong to no input")
    all_binary = bool(req.parameters and req.parameters.binary_data_output)
    binary_outputs = {o.name for o in req.outputs if o.parameters and o.parameters.binary_data}
    params: dict[str, Any] = {}
    if req.parameters:
        params = {"profile_last": req.parameters.profile_last}
        params |= {k: getattr(req.parameters, k) for k in PARAMETERS if getattr(req.parameters, k) is not None}
    call = InferCall(name, version, req.id or "", inputs, [o.name for o in req.outputs], params)
    return call, binary_outputs, all_binary


def infer_body(model: str, request_id: str, out: dict[str, np.ndarray], names: list[str], binary: set[str],
               all_binary: bool, columns: Sequence[str] = ()) -> Response:
    """The InferResponse as JSON (outputs as data), or JSON then bytes for the outputs asked for as binary.  Built
    with json.dumps rather than through the model: a logits output is a list of vocab x tokens floats."""
    doc: dict[str, Any] = {"model_name": model, "model_version": VERSION}
    if request_id:
        doc["id"] = request_id
    tail: list[bytes]
    doc["outputs"], tail = [], []
    for name in names:
        array = np.ascontiguousarray(out[name], "<f4")
        entry: dict[str, Any] = {"name": name, "datatype": "FP32", "shape": list(array.shape)}
        if name == PROFILE:
            entry["parameters"] = {"columns": ",".join(columns)}
        if all_binary or name in binary:
            raw = array.tobytes()
            entry.setdefault("parameters", {})["binary_data_size"] = len(raw)
            tail.append(raw)
        else:
            entry["data"] = array.ravel().tolist()
        doc["outputs"].append(entry)
    head = json.dumps(doc, separators=(",", ":")).encode()
    if not tail:
        return Response(head, media_type="application/json")
    return Response(b"".join([head, *tail]), media_type="application/octet-stream",
                    headers={"Inference-Header-Content-Length": str(len(head))})


def answer(model: BaseModel, status: int = 200) -> Response:
    return json_response(model.model_dump(exclude_none=True), status)


class KServeServer(Api):
    """KServe v2's server routes: metadata, liveness and readiness (the probes answer while draining, keyless)."""

    @route("GET", "/v2", "server metadata", response=ServerMetadata)
    async def server_metadata(self, request: Request) -> Response:
        return answer(ServerMetadata(name="posenc", version="0.1.0", extensions=[*EXTENSIONS, "binary_tensor_data"]))

    @route("GET", "/v2/health/live", "liveness", response=Live, draining_too=True, keyless=True)
    async def live(self, request: Request) -> Response:
        return answer(Live(live=True))

    @route("GET", "/v2/health/ready", "readiness: 503 until a model serves, and while draining", response=Ready,
           draining_too=True, keyless=True)
    async def ready(self, request: Request) -> Response:
        ok = self.front.ready()
        return answer(Ready(ready=ok), 200 if ok else 503)


class KServeModel(Api):
    """KServe v2's routes of one model, at /v2/models/{name} (KServeModelVersion: the same under a version)."""

    prefix = "/v2/models/{name}"

    def model_of(self, request: Request) -> LoadedModel:
        p = request.path_params
        return self.front.kserve._model(p["name"], p.get("version", ""))  # 404 for an unknown model or version

    @route("GET", "", "a model's inputs and outputs", response=ModelMetadata)
    async def metadata(self, request: Request) -> Response:
        m = self.model_of(request)
        inputs, outputs = io_tensors(m)
        return answer(ModelMetadata(name=m.name, versions=[VERSION], platform="onnxruntime_onnx",
                                    inputs=[TensorMetadata(name=n, datatype=d, shape=s) for n, d, s in inputs],
                                    outputs=[TensorMetadata(name=n, datatype=d, shape=s) for n, d, s in outputs]))

    @route("GET", "/ready", "whether the model is ready", response=ModelReady)
    async def model_ready(self, request: Request) -> Response:
        self.model_of(request)
        ok = self.front.ready()
        return answer(ModelReady(name=request.path_params["name"], ready=ok), 200 if ok else 503)

    @route("GET", "/config", "the model's Triton configuration (model_config.proto as JSON)")
    async def config(self, request: Request) -> Response:
        return json_response(json_format.MessageToDict(model_config(self.model_of(request)),
                                                       preserving_proto_field_name=True))

    @route("POST", "/infer", "logits and attention maps for token ids", request=InferRequest, response=InferResponse)
    async def infer(self, request: Request) -> Response:
        front, p = self.front, request.path_params
        body = await front.body(request)
        call, binary, all_binary = await front.off_loop(len(body), lambda: parse_infer(
            front, p["name"], p.get("version", ""), body, request.headers.get(HEADER)))
        deadline = front.deadline(request)

        def run() -> Response:  # the answer's body too is built in the thread: logits as JSON can be megabytes
            checked, out = front.kserve.infer(call, deadline)
            return infer_body(checked.model.name, call.id, out, checked.outputs, binary, all_binary,
                              profile_columns(checked.model))

        return await front.call(run)


class KServeModelVersion(KServeModel):
    """KServeModel's routes for one version of a model (posenc serves version 1 of each)."""

    prefix = "/v2/models/{name}/versions/{version}"
