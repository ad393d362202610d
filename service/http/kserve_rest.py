"""KServe v2 REST (Open Inference Protocol, HTTP binding) with Triton's binary tensor extension.

Inference builds the same kv.ModelInferRequest that gRPC ModelInfer receives and calls the same
KServeServicer.infer, so names, shapes, dtypes, limits and errors are those of the gRPC front.  Tensor data comes
as JSON (`data`, row-major, nested lists accepted) or as bytes after the JSON part (`binary_data_size`, with the
`Inference-Header-Content-Length` header); outputs are JSON unless `binary_data` asks for bytes
(docs/design.md, "KServe v2 on the wire")."""

from __future__ import annotations

import json

import numpy as np
from google.protobuf import json_format
from starlette.requests import Request
from starlette.responses import Response

from protos.inference import grpc_service_pb2 as kv
from service.http.errors import HttpError, bad_field
from service.http.front import Front, json_response
from service.kserve import EXTENSIONS, VERSION, io_tensors, model_config

HEADER = "inference-header-content-length"
DTYPES = {"BOOL": np.bool_, "INT8": np.int8, "INT16": np.int16, "INT32": np.int32, "INT64": np.int64,
          "UINT8": np.uint8, "UINT16": np.uint16, "UINT32": np.uint32, "UINT64": np.uint64, "FP16": np.float16,
          "FP32": np.float32, "FP64": np.float64}


def flatten(data, where: str) -> list:
    """A row-major flat list of the scalars in (possibly nested) lists, without recursion."""
    if not isinstance(data, list):
        data = [data]
    out, stack = [], [iter(data)]
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


def to_array(values: list, datatype: str, where: str) -> np.ndarray:
    dtype = np.dtype(DTYPES[datatype])
    if dtype.kind in "iu" and any(isinstance(x, (bool, float)) for x in values):
        raise bad_field(where, f"{datatype} data must be integers")
    if dtype.kind == "b" and any(not isinstance(x, bool) for x in values):
        raise bad_field(where, "BOOL data must be true or false")
    try:
        return np.asarray(values, dtype)
    except (OverflowError, ValueError, TypeError) as err:
        raise bad_field(where, f"not {datatype} values: {err}") from None


def parse_infer(front: Front, name: str, version: str, body: bytes, header_length: str | None) -> tuple:
    """(kv.ModelInferRequest, binary output names, whether every output is binary) from a REST body."""
    if header_length is not None:
        if not header_length.isdigit() or int(header_length) > len(body):
            raise HttpError(400, f"header Inference-Header-Content-Length {header_length!r} is not a length within "
                                 f"the {len(body)}-byte body")
        split = int(header_length)
        head, binary = body[:split], memoryview(body)[split:]
    else:
        head, binary = body, memoryview(b"")
    try:
        doc = json.loads(head)
    except (UnicodeDecodeError, ValueError, RecursionError) as err:
        raise HttpError(400, f"inference request is not valid JSON: {err}") from None
    if not isinstance(doc, dict):
        raise HttpError(400, "inference request must be a JSON object")
    inputs, outputs = doc.get("inputs"), doc.get("outputs", [])
    params = doc.get("parameters") or {}
    if not isinstance(inputs, list) or not inputs:
        raise bad_field("inputs", "must be a non-empty list of tensors")
    if not isinstance(outputs, list) or not isinstance(params, dict):
        raise bad_field("outputs" if not isinstance(outputs, list) else "parameters", "has the wrong type")
    request = kv.ModelInferRequest(model_name=name, model_version=version, id=str(doc.get("id") or ""))
    offset, limit = 0, front.limits.max_message_bytes
    for i, t in enumerate(inputs):
        where = f"inputs[{i}]"
        if not isinstance(t, dict):
            raise bad_field(where, "must be an object with name, shape, datatype and data")
        tname, shape, datatype = t.get("name"), t.get("shape"), t.get("datatype")
        if not isinstance(tname, str):
            raise bad_field(f"{where}.name", "must be a string")
        if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 2**31
                                                  for d in shape):
            raise bad_field(f"{where}.shape", f"must be a list of non-negative integers, got {shape!r}")
        if not isinstance(datatype, str) or datatype not in DTYPES:
            raise bad_field(f"{where}.datatype", f"{datatype!r} is not one of {', '.join(DTYPES)}")
        count = int(np.prod(shape, dtype=object))
        itemsize = np.dtype(DTYPES[datatype]).itemsize
        if count * itemsize > limit:
            raise HttpError(413, f"input {tname!r} of shape {shape} is over the {limit}-byte message limit")
        tparams = t.get("parameters") or {}
        size = tparams.get("binary_data_size") if isinstance(tparams, dict) else None
        if size is not None:
            if not isinstance(size, int) or isinstance(size, bool) or size < 0 or offset + size > len(binary):
                raise bad_field(f"{where}.parameters.binary_data_size",
                                f"{size!r} bytes at offset {offset} do not fit the {len(binary)} binary bytes")
            raw = bytes(binary[offset:offset + size])
            offset += size
        else:
            if "data" not in t:
                raise bad_field(f"{where}.data", "missing (and no binary_data_size parameter)")
            values = flatten(t["data"], f"{where}.data")
            if len(values) != count:
                raise bad_field(f"{where}.data", f"has {len(values)} values, shape {shape} needs {count}")
            raw = to_array(values, datatype, f"{where}.data").astype(np.dtype(DTYPES[datatype]).newbyteorder("<"),
                                                                     copy=False).tobytes()
        request.inputs.append(kv.ModelInferRequest.InferInputTensor(name=tname, datatype=datatype, shape=shape))
        request.raw_input_contents.append(raw)
    if offset != len(binary):
        raise HttpError(400, f"{len(binary) - offset} binary bytes after the JSON part belong to no input")
    all_binary = params.get("binary_data_output") is True
    binary_outputs = set()
    for i, o in enumerate(outputs):
        if not isinstance(o, dict) or not isinstance(o.get("name"), str):
            raise bad_field(f"outputs[{i}]", "must be an object with a name")
        request.outputs.add(name=o["name"])
        oparams = o.get("parameters") or {}
        if isinstance(oparams, dict) and oparams.get("binary_data") is True:
            binary_outputs.add(o["name"])
    return request, binary_outputs, all_binary


def infer_body(response: kv.ModelInferResponse, binary: set[str], all_binary: bool) -> Response:
    doc = {"model_name": response.model_name, "model_version": response.model_version}
    if response.id:
        doc["id"] = response.id
    doc["outputs"], tail = [], []
    for tensor, raw in zip(response.outputs, response.raw_output_contents, strict=True):
        entry = {"name": tensor.name, "datatype": tensor.datatype, "shape": list(tensor.shape)}
        if all_binary or tensor.name in binary:
            entry["parameters"] = {"binary_data_size": len(raw)}
            tail.append(raw)
        else:
            entry["data"] = np.frombuffer(raw, DTYPES[tensor.datatype]).tolist()
        doc["outputs"].append(entry)
    head = json.dumps(doc, separators=(",", ":")).encode()
    if not tail:
        return Response(head, media_type="application/json")
    return Response(b"".join([head, *tail]), media_type="application/octet-stream",
                    headers={"Inference-Header-Content-Length": str(len(head))})


def routes(front: Front) -> list:
    def model_of(request: Request):
        p = request.path_params
        return front.kserve._model(p["name"], p.get("version", ""))

    async def server_metadata(request):
        return json_response({"name": "posenc", "version": "0.1.0",
                              "extensions": [*EXTENSIONS, "binary_tensor_data"]})

    async def live(request):
        return json_response({"live": True})

    async def ready(request):
        ok = front.ready()
        return json_response({"ready": ok}, 200 if ok else 503)

    async def model_ready(request):
        model_of(request)  # 404 for an unknown model or version
        ok = front.ready()
        return json_response({"name": request.path_params["name"], "ready": ok}, 200 if ok else 503)

    async def metadata(request):
        m = model_of(request)
        inputs, outputs = io_tensors(m)
        return json_response({"name": m.name, "versions": [VERSION], "platform": "onnxruntime_onnx",
                              "inputs": [{"name": n, "datatype": d, "shape": s} for n, d, s in inputs],
                              "outputs": [{"name": n, "datatype": d, "shape": s} for n, d, s in outputs]})

    async def config(request):
        return json_response(json_format.MessageToDict(model_config(model_of(request)),
                                                       preserving_proto_field_name=True))

    async def infer(request):
        p = request.path_params
        body = await front.body(request)
        req, binary, all_binary = parse_infer(front, p["name"], p.get("version", ""), body,
                                              request.headers.get(HEADER))
        response = await front.call(front.kserve.infer, req, front.deadline(request))
        return infer_body(response, binary, all_binary)

    out = [front.route("/v2", server_metadata), front.route("/v2/health/live", live, draining_too=True),
           front.route("/v2/health/ready", ready, draining_too=True)]
    for base in ("/v2/models/{name}", "/v2/models/{name}/versions/{version}"):
        out += [front.route(base, metadata), front.route(f"{base}/ready", model_ready),
                front.route(f"{base}/config", config), front.route(f"{base}/infer", infer, ("POST",))]
    return out
