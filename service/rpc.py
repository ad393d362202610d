"""gRPC plumbing shared by both servicers: request parsers that never raise, the guard that maps errors to status
codes and records metrics, unary/stream decorators, deadlines, the replica-name metadata, and wire helpers."""

from __future__ import annotations

import functools
import logging
import time
import uuid
from typing import TYPE_CHECKING, Any, Literal, Protocol, TypeVar

import grpc
from google.protobuf import message_factory

from protos.posenc.v1 import posenc_pb2 as pb
from service.auth import retry_after
from service.errors import InvalidArgument, ServiceError

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator
    from types import TracebackType

    from google.protobuf.descriptor import ServiceDescriptor
    from google.protobuf.message import Message

    from service.registry import Registry

log = logging.getLogger(__name__)


def deadline_of(context: grpc.ServicerContext) -> float | None:
    remaining = context.time_remaining()  # a huge number when the client set no deadline
    return None if remaining is None or remaining > 1e6 else time.monotonic() + remaining


INSTANCE_HEADER = "posenc-instance"


class Servicer(Protocol):
    """What the guard reads of a servicer (posenc.v1's, KServe's): its replica name and its registry."""

    instance: str
    registry: Registry


S = TypeVar("S", bound=Servicer)
R = TypeVar("R")


class Malformed:
    """A request body that does not parse as its message type (random bytes, invalid UTF-8 in a string field).

    gRPC's own handling of a failing deserializer is INTERNAL; posenc's contract says INVALID_ARGUMENT, so the
    deserializer returns this instead of raising and the guard turns it into the documented status."""

    def __init__(self, type_name: str, error: str):
        self.type_name, self.error = type_name, error


def safe_parser(message_class: type[Message]) -> Callable[[bytes], Message | Malformed]:
    def parse(data: bytes) -> Message | Malformed:
        try:
            return message_class.FromString(data)
        except Exception as err:  # google.protobuf.message.DecodeError and friends
            return Malformed(message_class.DESCRIPTOR.full_name, str(err) or type(err).__name__)

    return parse


def add_servicer(servicer: Servicer, service: ServiceDescriptor, server: grpc.Server) -> None:
    """Register every method of `service` (a ServiceDescriptor) like the generated add_*_to_server does, but with
    request parsers that never raise (see Malformed)."""
    handlers = {}
    for method in service.methods:
        if method.client_streaming:
            raise ValueError(f"{service.full_name}.{method.name}: client-streaming methods are not supported here")
        parse = safe_parser(message_factory.GetMessageClass(method.input_type))
        serialize = _serializer(message_factory.GetMessageClass(method.output_type))
        behavior = getattr(servicer, method.name)
        make = grpc.unary_stream_rpc_method_handler if method.server_streaming else grpc.unary_unary_rpc_method_handler
        handlers[method.name] = make(behavior, request_deserializer=parse, response_serializer=serialize)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))


def _serializer(message_class: type[Message]) -> Callable[[Message | bytes], bytes]:
    """A response serialiser that also takes a message already serialised (bytes) and sends it as it is."""
    serialize = message_class.SerializeToString

    def to_wire(message: Message | bytes) -> bytes:
        return message if isinstance(message, bytes) else serialize(message)

    return to_wire


class _Guard:
    """Maps exceptions to status codes (ServiceError by its class, anything else INTERNAL with a logged request
    id) and records every call's method, model, status and latency in the metrics."""

    def __init__(self, servicer: Servicer, rpc: str, request: object, context: grpc.ServicerContext,
                 stream: bool = False):
        self.servicer, self.rpc, self.context, self.stream = servicer, rpc, context, stream
        self.model = (getattr(request, "model", None) or getattr(request, "model_name", None)
                      or getattr(request, "name", ""))
        self.start = time.monotonic()

    def check(self, request: object) -> None:
        if isinstance(request, Malformed):
            raise InvalidArgument(f"request body is not a valid {request.type_name}: {request.error}")

    def __enter__(self) -> _Guard:
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

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> Literal[False]:
        message: str | None
        code, message = grpc.StatusCode.OK, None
        if exc_type is GeneratorExit:  # the client went away mid-stream
            code = grpc.StatusCode.CANCELLED
        elif isinstance(exc, ServiceError):
            code, message = exc.code, str(exc)
        elif isinstance(exc, TimeoutError):
            code, message = grpc.StatusCode.DEADLINE_EXCEEDED, "deadline passed before the work finished"
        elif exc is not None:
            request_id = uuid.uuid4().hex[:12]
            log.error("internal error in %s (request id %s)", self.rpc, request_id, exc_info=exc)
            code, message = grpc.StatusCode.INTERNAL, f"internal error (request id {request_id}); see the server log"
        registry = self.servicer.registry
        known = self.model if self.model in registry.served else ("unknown" if self.model else "")
        registry.metrics.observe(self.rpc, known, code.name, time.monotonic() - self.start)
        wait = getattr(exc, "retry_after", None)  # a key over its limits (service.auth.KeyLimited)
        if wait is not None:
            unary_header = ((INSTANCE_HEADER, self.servicer.instance),) if self.servicer.instance and not self.stream \
                else ()
            self.context.set_trailing_metadata((*unary_header, ("retry-after", retry_after(wait))))
        if message is not None:
            self.context.abort(code, message)  # raises: grpc ends the call with this status
        return False


def unary(method: Callable[[S, Any, grpc.ServicerContext], R]) -> Callable[[S, Any, grpc.ServicerContext], R]:
    @functools.wraps(method)
    def call(self: S, request: Any, context: grpc.ServicerContext) -> R:
        with _Guard(self, method.__name__, request, context) as guard:
            guard.check(request)
            return method(self, request, context)

    return call


def streaming(method: Callable[[S, Any, grpc.ServicerContext], Iterator[R]]
              ) -> Callable[[S, Any, grpc.ServicerContext], Iterator[R]]:
    @functools.wraps(method)
    def call(self: S, request: Any, context: grpc.ServicerContext) -> Iterator[R]:
        with _Guard(self, method.__name__, request, context, stream=True) as guard:
            guard.check(request)
            yield from method(self, request, context)

    return call


@functools.lru_cache(maxsize=4096)
def _token_wire(field: int, token: int, piece: str) -> bytes:
    """One element of a repeated Token field, serialised (tag, length, Token): cached, since a response repeats
    the same few hundred (id, piece) pairs and building a Token message per position costs ~1 us each."""
    return wire_field(field, pb.Token(id=token, piece=piece).SerializeToString())


def wire_field(field: int, data: bytes) -> bytes:
    """A length-delimited protobuf field (wire type 2) holding `data` as it is."""
    return wire_header(field, len(data)) + data


def wire_header(field: int, size: int) -> bytes:
    """The tag and length of a length-delimited protobuf field of `size` bytes."""
    return _varint(field << 3 | 2) + _varint(size)


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            return bytes(out)


def set_tokens(message: Message, field: str, ids: list[int], pieces: list[str]) -> None:
    """Append the tokens to message.<field> (a repeated Token) through the wire format: the same message as
    building each Token, several times cheaper for long prompts."""
    number = message.DESCRIPTOR.fields_by_name[field].number
    message.MergeFromString(b"".join([_token_wire(number, i, p) for i, p in zip(ids, pieces, strict=True)]))


def capped_deadline(context: grpc.ServicerContext, cap: float) -> float | None:
    """The client's deadline, capped by the server's --max-request-seconds (0 or less: no cap)."""
    client = deadline_of(context)
    if not cap or cap <= 0:
        return client
    capped = time.monotonic() + cap
    return capped if client is None else min(client, capped)

