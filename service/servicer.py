"""posenc.v1 servicer: converts protobuf <-> plain types and maps service errors to status codes."""

from __future__ import annotations

import functools
import logging
import time
import uuid

import grpc
import numpy as np
from google.protobuf import message_factory

from model import tokenizer
from protos.posenc.v1 import posenc_pb2 as pb
from protos.posenc.v1 import posenc_pb2_grpc
from service.api import Models
from service.errors import InvalidArgument, ServiceError

log = logging.getLogger(__name__)

ATTENTION = {pb.ATTENTION_NONE: "none", pb.ATTENTION_LAST_ROW: "last_row", pb.ATTENTION_FULL: "full"}


def deadline_of(context: grpc.ServicerContext) -> float | None:
    remaining = context.time_remaining()  # a huge number when the client set no deadline
    return None if remaining is None or remaining > 1e6 else time.monotonic() + remaining


INSTANCE_HEADER = "posenc-instance"


class Malformed:
    """A request body that does not parse as its message type (random bytes, invalid UTF-8 in a string field).

    gRPC's own handling of a failing deserializer is INTERNAL; posenc's contract says INVALID_ARGUMENT, so the
    deserializer returns this instead of raising and the guard turns it into the documented status."""

    def __init__(self, type_name: str, error: str):
        self.type_name, self.error = type_name, error


def safe_parser(message_class):
    def parse(data: bytes):
        try:
            return message_class.FromString(data)
        except Exception as err:  # google.protobuf.message.DecodeError and friends
            return Malformed(message_class.DESCRIPTOR.full_name, str(err) or type(err).__name__)

    return parse


def add_servicer(servicer, service, server: grpc.Server) -> None:
    """Register every method of `service` (a ServiceDescriptor) like the generated add_*_to_server does, but with
    request parsers that never raise (see Malformed)."""
    handlers = {}
    for method in service.methods:
        if method.client_streaming:
            raise ValueError(f"{service.full_name}.{method.name}: client-streaming methods are not supported here")
        parse = safe_parser(message_factory.GetMessageClass(method.input_type))
        serialize = message_factory.GetMessageClass(method.output_type).SerializeToString
        behavior = getattr(servicer, method.name)
        make = grpc.unary_stream_rpc_method_handler if method.server_streaming else grpc.unary_unary_rpc_method_handler
        handlers[method.name] = make(behavior, request_deserializer=parse, response_serializer=serialize)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))


class _Guard:
    """Maps exceptions to status codes (ServiceError by its class, anything else INTERNAL with a logged request
    id) and records every call's method, model, status and latency in the metrics."""

    def __init__(self, servicer, rpc: str, request, context, stream: bool = False):
        self.servicer, self.rpc, self.context, self.stream = servicer, rpc, context, stream
        self.model = (getattr(request, "model", None) or getattr(request, "model_name", None)
                      or getattr(request, "name", ""))
        self.start = time.monotonic()

    def check(self, request) -> None:
        if isinstance(request, Malformed):
            raise InvalidArgument(f"request body is not a valid {request.type_name}: {request.error}")

    def __enter__(self):
        # Which replica answered: clients behind DNS round-robin (docker compose --scale) can tell them apart.
        # A stream names it up front; a unary answer in its trailing metadata, which goes out with the status
        # (send_initial_metadata is a round through gRPC's core of its own: ~0.15 ms of every unary call).
        if self.servicer.instance:
            header = ((INSTANCE_HEADER, self.servicer.instance),)
            if self.stream:
                self.context.send_initial_metadata(header)
            else:
                self.context.set_trailing_metadata(header)
        return self

    def __exit__(self, exc_type, exc, tb):
        code, message = grpc.StatusCode.OK, None
        if exc_type is GeneratorExit:  # the client went away mid-stream
            code = grpc.StatusCode.CANCELLED
        elif isinstance(exc, ServiceError):
            code, message = exc.code, str(exc)
        elif isinstance(exc, TimeoutError):
            code, message = grpc.StatusCode.DEADLINE_EXCEEDED, "deadline passed before the work finished"
        elif exc is not None:
            request_id = uuid.uuid4().hex[:12]
            log.error("internal error in %s (request id %s)", self.rpc, request_id, exc_info=(exc_type, exc, tb))
            code, message = grpc.StatusCode.INTERNAL, f"internal error (request id {request_id}); see the server log"
        models = self.servicer.models
        known = self.model if self.model in models.models else ("unknown" if self.model else "")
        models.metrics.observe(self.rpc, known, code.name, time.monotonic() - self.start)
        if message is not None:
            self.context.abort(code, message)  # raises: grpc ends the call with this status
        return False


def unary(method):
    @functools.wraps(method)
    def call(self, request, context):
        with _Guard(self, method.__name__, request, context) as guard:
            guard.check(request)
            return method(self, request, context)

    return call


def streaming(method):
    @functools.wraps(method)
    def call(self, request, context):
        with _Guard(self, method.__name__, request, context, stream=True) as guard:
            guard.check(request)
            yield from method(self, request, context)

    return call


def prompt_of(prompt: pb.Prompt) -> tuple[str | None, list[int] | None]:
    kind = prompt.WhichOneof("input")
    if kind == "text":
        return prompt.text, None
    if kind == "tokens":
        return None, list(prompt.tokens.ids)
    return None, []


@functools.lru_cache(maxsize=4096)
def _token_wire(field: int, token: int, piece: str) -> bytes:
    """One element of a repeated Token field, serialised (tag, length, Token): cached, since a response repeats
    the same few hundred (id, piece) pairs and building a Token message per position costs ~1 us each."""
    return wire_field(field, pb.Token(id=token, piece=piece).SerializeToString())


def wire_field(field: int, data: bytes) -> bytes:
    """A length-delimited protobuf field (wire type 2) holding `data` as it is."""
    return _varint(field << 3 | 2) + _varint(len(data)) + data


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            return bytes(out)


def set_tokens(message, field: str, ids: list[int], pieces: list[str]) -> None:
    """Append the tokens to message.<field> (a repeated Token) through the wire format: the same message as
    building each Token, several times cheaper for long prompts."""
    number = message.DESCRIPTOR.fields_by_name[field].number
    message.MergeFromString(b"".join([_token_wire(number, i, p) for i, p in zip(ids, pieces, strict=True)]))


def candidates(top: list[tuple[int, float, float]]) -> list[pb.Candidate]:
    return [pb.Candidate(token=pb.Token(id=t, piece=tokenizer.display(t)), probability=p, logprob=lp)
            for t, p, lp in top]


class PosencServicer(posenc_pb2_grpc.PosencServicer):
    def __init__(self, models: Models, instance: str = ""):
        self.models, self.instance = models, instance

    def deadline(self, context: grpc.ServicerContext) -> float | None:
        """The client's deadline, capped by the server's --max-request-seconds."""
        client = deadline_of(context)
        cap = self.models.limits.max_request_s
        if not cap or cap <= 0:
            return client
        capped = time.monotonic() + cap
        return capped if client is None else min(client, capped)

    @unary
    def ListModels(self, request, context):
        out = pb.ListModelsResponse()
        for name, m in sorted(self.models.models.items()):
            s = m.meta["sizes"]
            out.models.append(pb.ModelInfo(
                name=name, variant=m.meta["variant"], vocab_size=s["vocab_size"], d_model=s["d_model"],
                n_heads=s["n_heads"], n_layers=s["n_layers"], parameters=s.get("parameters", 0),
                max_positions=m.max_positions or 0, trained_context=m.meta.get("trained_context", 0),
                heldout_loss=m.meta.get("heldout_loss") or 0.0, sha256=m.sha256))
        return out

    @unary
    def Predict(self, request, context):
        text, ids = prompt_of(request.prompt)
        p = self.models.predict(request.model, text, ids, request.top_k, ATTENTION.get(request.attention, "none"),
                                list(request.layers), list(request.heads), self.deadline(context))
        out = pb.PredictResponse(model=request.model)
        set_tokens(out, "tokens", p.ids, p.pieces)
        out.top.extend(candidates(p.top))
        for layer, head, amap in p.attention:
            out.attention.add(layer=layer, head=head, shape=amap.shape, data=amap.astype("<f4", copy=False).tobytes())
        r = p.result
        out.timing.CopyFrom(pb.Timing(queue_ms=r.queue_ms, compute_ms=r.compute_ms, total_ms=p.total_ms,
                                      batch_size=r.batch_size))
        return out

    @unary
    def Score(self, request, context):
        text, ids = prompt_of(request.prompt)
        toks, logprobs = self.models.score(request.model, text, ids, self.deadline(context))
        total = float(sum(logprobs))
        nats = -total / len(logprobs)
        out = pb.ScoreResponse(model=request.model, logprobs=logprobs, total_logprob=total, nats_per_token=nats,
                               perplexity=float(np.exp(nats)))
        set_tokens(out, "tokens", toks, tokenizer.pieces(toks))
        return out

    @unary
    def Compare(self, request, context):
        text, ids = prompt_of(request.prompt)
        ptext, pids = prompt_of(request.permuted) if request.HasField("permuted") else (None, None)
        toks, perm, rows = self.models.compare(text, ids, ptext, pids, list(request.models), request.top_k,
                                               self.deadline(context))
        out = pb.CompareResponse()
        set_tokens(out, "tokens", toks, tokenizer.pieces(toks))
        set_tokens(out, "permuted_tokens", perm, tokenizer.pieces(perm))
        for r in rows:
            out.models.append(pb.ModelComparison(
                model=r.model, variant=r.variant, top=candidates(r.top), permuted_top=candidates(r.permuted_top),
                total_variation=r.total_variation, kl_divergence=r.kl, js_divergence=r.js,
                top1_changed=r.top1_changed, error=r.error))
        return out

    @unary
    def Encoding(self, request, context):
        tensors, note = self.models.encoding(request.model, request.length)
        out = pb.EncodingResponse(model=request.model, variant=self.models.models[request.model].meta["variant"],
                                  note=note)
        for name, value in tensors:
            out.tensors.append(pb.Tensor(name=name, shape=list(value.shape),
                                         data=np.ascontiguousarray(value, "<f4").tobytes()))
        return out

    @streaming
    def Generate(self, request, context):
        text, ids = prompt_of(request.prompt)
        seed = request.seed if request.HasField("seed") else None
        stream = self.models.generate(request.model, text, ids, request.max_new_tokens or 32, request.temperature,
                                      request.top_k, request.top_p, seed, list(request.stop), self.deadline(context),
                                      context.is_active)
        for token, logprob, so_far, reason in stream:
            yield pb.GenerateResponse(token=pb.Token(id=token, piece=tokenizer.display(token)), logprob=logprob,
                                      text=so_far, finish_reason=reason)
