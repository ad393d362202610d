"""KServe v2 `inference.GRPCInferenceService` (tritonclient-compatible) on the worker's port.

ModelInfer takes input_ids INT64 [batch, seq] and an optional attention_mask INT64 [batch, seq] (0 = left
padding) and returns logits FP32 [batch, seq, vocab] and attentions FP32 [batch, layers, heads, seq, seq], raw,
one buffer per output in the order of `outputs` (docs/design.md, "KServe v2 on the wire").  Prefill only: the
KV cache is posenc.v1's Generate.
"""

from __future__ import annotations

import numpy as np

from protos.inference import config, grpc_service_pb2_grpc, model_config_pb2
from protos.inference import grpc_service_pb2 as kv
from service.artifacts import LoadedModel
from service.errors import InvalidArgument, NotFound, TooLarge
from service.operations import Operations
from service.rpc import capped_deadline, unary

VERSION = "1"
EXTENSIONS = ["model_configuration"]


def io_tensors(m: LoadedModel) -> tuple[list[tuple[str, str, list[int]]], list[tuple[str, str, list[int]]]]:
    """(name, datatype, full shape with -1 for variable dims) of the inputs and outputs ModelInfer exposes."""
    inputs = [("input_ids", "INT64", [-1, -1]), ("attention_mask", "INT64", [-1, -1])]
    outputs = [("logits", "FP32", [-1, -1, m.vocab_size]),
               ("attentions", "FP32", [-1, m.n_layers, m.n_heads, -1, -1])]
    return inputs, outputs


def model_config(m: LoadedModel) -> model_config_pb2.ModelConfig:
    """What ModelInfer takes and returns, from the builder config.pbtxt is written with (export triton)."""
    inputs, outputs = io_tensors(m)
    return config.model_config(m.name, m.meta["variant"], [config.Tensor(*t) for t in inputs],
                               [config.Tensor(*t) for t in outputs])


def decode_input(request: kv.ModelInferRequest, index: int) -> np.ndarray:
    tensor = request.inputs[index]
    if tensor.datatype != "INT64":
        raise InvalidArgument(f"input {tensor.name!r} must be INT64, got {tensor.datatype}")
    shape = list(tensor.shape)
    if len(shape) != 2 or min(shape) < 1:
        raise InvalidArgument(f"input {tensor.name!r} must have shape [batch, seq] with both >= 1, got {shape}")
    count = shape[0] * shape[1]
    if request.raw_input_contents:
        if len(request.raw_input_contents) != len(request.inputs):
            raise InvalidArgument(f"{len(request.raw_input_contents)} raw buffers for {len(request.inputs)} inputs")
        raw = request.raw_input_contents[index]
        if len(raw) != count * 8:
            raise InvalidArgument(f"input {tensor.name!r}: {len(raw)} bytes of raw data, expected {count * 8} "
                                  f"for shape {shape} INT64")
        values = np.frombuffer(raw, "<i8")
    else:
        values = np.asarray(tensor.contents.int64_contents, np.int64)
        if values.size != count:
            raise InvalidArgument(f"input {tensor.name!r}: {values.size} int64_contents, expected {count}")
    return values.reshape(shape).astype(np.int64)


class KServeServicer(grpc_service_pb2_grpc.GRPCInferenceServiceServicer):
    def __init__(self, ops: Operations, ready: callable, instance: str = ""):
        self.ops, self.registry, self.ready, self.instance = ops, ops.registry, ready, instance

    def _model(self, name: str, version: str = "") -> LoadedModel:
        if version not in ("", VERSION):
            raise NotFound(f"model {name!r} has no version {version!r}; served version: {VERSION}")
        return self.registry.get(name)

    @unary
    def ServerLive(self, request, context):
        return kv.ServerLiveResponse(live=True)

    @unary
    def ServerReady(self, request, context):
        return kv.ServerReadyResponse(ready=self.ready())

    @unary
    def ModelReady(self, request, context):
        return kv.ModelReadyResponse(ready=self.ready() and request.name in self.registry.models
                                     and request.version in ("", VERSION))

    @unary
    def ServerMetadata(self, request, context):
        return kv.ServerMetadataResponse(name="posenc", version="0.1.0", extensions=EXTENSIONS)

    @unary
    def ModelMetadata(self, request, context):
        m = self._model(request.name, request.version)
        inputs, outputs = io_tensors(m)
        T = kv.ModelMetadataResponse.TensorMetadata
        return kv.ModelMetadataResponse(name=m.name, versions=[VERSION], platform="onnxruntime_onnx",
                                        inputs=[T(name=n, datatype=d, shape=s) for n, d, s in inputs],
                                        outputs=[T(name=n, datatype=d, shape=s) for n, d, s in outputs])

    @unary
    def ModelConfig(self, request, context):
        return kv.ModelConfigResponse(config=model_config(self._model(request.name, request.version)))

    @unary
    def ModelInfer(self, request, context):
        return self.infer(request, capped_deadline(context, self.registry.limits.max_request_s))

    def infer(self, request: kv.ModelInferRequest, deadline: float | None) -> kv.ModelInferResponse:
        """ModelInfer without gRPC: the KServe v2 REST front builds the same request message and calls this."""
        m = self._model(request.model_name, request.model_version)
        names = [t.name for t in request.inputs]
        unknown = sorted(set(names) - {"input_ids", "attention_mask"})
        if unknown or "input_ids" not in names or len(set(names)) != len(names):
            raise InvalidArgument(f"inputs must be input_ids and optionally attention_mask, got {names}")
        ids = decode_input(request, names.index("input_ids"))
        if "attention_mask" in names:
            mask = decode_input(request, names.index("attention_mask"))
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
        cap = self.registry.limits.max_prompt_tokens
        if S > cap or (m.max_positions is not None and S > m.max_positions):
            limit = min(cap, m.max_positions or cap)
            raise InvalidArgument(f"sequence of {S} exceeds the limit of {limit} tokens for model {m.name}")
        wanted = [o.name for o in request.outputs] or ["logits", "attentions"]
        bad = sorted(set(wanted) - {"logits", "attentions"})
        if bad:
            raise InvalidArgument(f"unknown output {bad[0]!r}; this model returns logits and attentions")
        size = 4 * B * S * (m.vocab_size * ("logits" in wanted) + m.n_layers * m.n_heads * S * ("attentions" in wanted))
        if size > self.registry.limits.max_message_bytes * 0.9:
            raise TooLarge(f"response would be {size} bytes, over the {self.registry.limits.max_message_bytes}"
                                    "-byte message limit; request only the logits output or send fewer tokens")
        # Through the model's scheduler like every other request: batched with them, queue-limited, deadline-bound.
        out = self.ops.infer(m.name, ids, mask, "attentions" in wanted, deadline)
        resp = kv.ModelInferResponse(model_name=m.name, model_version=VERSION, id=request.id)
        for name in wanted:
            array = np.ascontiguousarray(out[name], "<f4")
            resp.outputs.append(kv.ModelInferResponse.InferOutputTensor(name=name, datatype="FP32",
                                                                        shape=list(array.shape)))
            resp.raw_output_contents.append(array.tobytes())
        return resp
