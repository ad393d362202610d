"""API keys at the door, and per-key limits: one key store shared by the gRPC port and the HTTP port.

With `--api-keys-file FILE` (alias `--api-keys`, POSENC_API_KEYS_FILE) every gRPC method and every HTTP route
needs `authorization: Bearer KEY` (gRPC metadata or HTTP header), except what probes and scrapers call without
one: grpc.health.v1, KServe's ServerLive/ServerReady and /v2/health/live, /v2/health/ready (and /metrics, which is
on its own port), and the viewer's static files (they hold no data; the page asks for a key when its calls get
401).  A call without a valid key is UNAUTHENTICATED / 401; a key over its limits is RESOURCE_EXHAUSTED / 429,
with `retry-after` (seconds) in the trailing metadata / headers.

The file holds one key per line: the key itself, or `sha256:<64 hex digits>` of it (so the file need not hold
secrets), optionally followed by that key's own limits (`requests_per_second=R max_concurrent=N`, overriding the
flags below for it); blank lines and lines starting with `#` are ignored (service.keyfile).  SIGHUP reads the file
again (KeyStore.reload) and swaps the whole key set at once: calls in flight go on, a removed key is refused from
then on, an added one accepted (a key removed while it has calls in flight and added back keeps counting them); a
file that no longer parses is refused with a logged reason and the old keys stay.  Reloads never overlap: a SIGHUP
during one makes it read the file again when it is done, so the newest file is the one in force.  The store keeps
only SHA-256 digests; a presented key is hashed and compared with every digest by hmac.compare_digest, all of them
each time, so neither the time nor the log says which key or how much of one matched.  No key, digest or header
value is ever logged.

Per-key limits (0 = none), counted in units of work: a call is one unit, and a call that carries several
prompts (an OpenAI completion with a list of prompts, a KServe ModelInfer with several rows) is one unit per
prompt or row.  `--key-requests-per-second R` is a token bucket per key (R units a second, bursts of up to
max(1, R); a call of more units than the burst is let in on a full bucket and leaves it in debt);
`--key-max-concurrent N` bounds a key's units in flight at once (a Generate stream or a streamed completion
counts until its last token), so one caller cannot hold every stream or the queue; a call of more prompts than N
is INVALID_ARGUMENT / 400 (it could never run).  The door takes one unit before the body is read; the operation
takes the rest once it knows how many prompts the call holds (`charge`, through a context variable the door
sets).  Refusals are counted in Prometheus (posenc_refusals_total{transport, reason}).
"""

from __future__ import annotations

import hmac
import json
import logging
import math
import threading
import time
from contextvars import ContextVar
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc

from service.errors import InvalidArgument, ResourceExhausted
from service.keyfile import Key, KeyFileError, OneAtATime, digest_of, parse_key_lines, parse_keys, read_key_file

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Iterator

    from starlette.types import ASGIApp, Receive, Scope, Send

    from service.metrics import Metrics

__all__ = ["KeyFileError", "KeyInterceptor", "KeyMiddleware", "KeyStore", "bearer", "charge", "parse_key_lines",
           "parse_keys"]

log = logging.getLogger(__name__)

MAX_HEADER = 8192  # a longer authorization value is refused without more ado
OPEN_METHODS = frozenset({"/grpc.health.v1.Health/Check", "/grpc.health.v1.Health/Watch",
                          "/inference.GRPCInferenceService/ServerLive", "/inference.GRPCInferenceService/ServerReady"})
OPEN_PATHS = frozenset({"/v2/health/live", "/v2/health/ready"})
# (key, refusal reason or None, message, retry-after seconds): what the door decides for a call
Admission = tuple[Key | None, str | None, str, float]


def bearer(value: bytes | str | None) -> bytes | None:
    """The token of an `authorization: Bearer TOKEN` value; None when there is none."""
    if value is None:
        return None
    if isinstance(value, str):
        value = value.encode("utf-8", "surrogateescape")
    if len(value) > MAX_HEADER or value[:7].lower() != b"bearer ":
        return None
    token = value[7:].strip(b" \t")
    return token or None


class KeyStore:
    """The accepted keys (service.keyfile.Key: digest, limits, rate bucket, calls in flight), swapped whole by
    reload()."""

    def __init__(self, digests: list[bytes], rate: float = 0.0, max_concurrent: int = 0,
                 metrics: Metrics | None = None, clock: Callable[[], float] = time.monotonic,
                 limits: list[dict[str, Any]] | None = None, path: Path | None = None):
        """`rate` and `max_concurrent` hold for every key but those whose `limits` entry sets its own."""
        self.rate, self.max_concurrent, self.metrics, self.clock, self.path = rate, max_concurrent, metrics, clock, path
        self._lock = threading.Lock()
        self.keys: tuple[Key, ...] = ()
        self._retired: dict[bytes, Key] = {}  # keys a reload removed while they had calls in flight
        self._reloads = OneAtATime()
        self._install(list(zip(digests, limits or [{}] * len(digests), strict=True)))

    def _install(self, entries: list[tuple[bytes, dict[str, Any]]]) -> tuple[int, int]:
        """Swap in the keys of `entries` at once: a key already accepted, or removed with calls still in flight,
        keeps its Key (bucket, calls in flight).  (added, removed) counts."""
        with self._lock:
            old = {k.digest: k for k in self.keys}
            known = {**self._retired, **old}
            keys: dict[bytes, Key]
            keys, now = {}, self.clock()
            for digest, own in entries:
                rate, concurrent = own.get("requests_per_second", self.rate), own.get("max_concurrent",
                                                                                      self.max_concurrent)
                key = keys.get(digest) or known.get(digest)
                if key is None:
                    key = Key(digest, rate, concurrent, now)
                else:
                    key.limit(rate, concurrent)
                keys[digest] = key
            self.keys = tuple(keys.values())
            self._retired = {d: k for d, k in known.items() if d not in keys and k.inflight > 0}
        return len(keys.keys() - old.keys()), len(old.keys() - keys.keys())

    @classmethod
    def from_file(cls, path: Path, **kwargs: Any) -> KeyStore:
        entries = read_key_file(path)
        store = cls([d for d, _ in entries], limits=[o for _, o in entries], path=Path(path), **kwargs)
        log.info("API keys: %d accepted (from %s); per key: %s requests/s, %s calls at once", len(store.keys),
                 path, store.rate or "any", store.max_concurrent or "any")
        return store

    def reload(self) -> bool:
        """Read the key file again (SIGHUP) and swap the keys in at once: a key no longer in it is refused from now
        on (calls it has in flight go on), a new one accepted.  A file that cannot be read or parsed changes
        nothing: the reason is logged (never a key) and the keys in force stay.  One at a time (OneAtATime): asked
        for during another, it returns False and that one reads the file again.  True when this call swapped keys."""
        path = self.path
        if path is None:
            return False
        if (swapped := self._reloads.run(lambda: self._read_and_install(path))) is None:
            log.info("API keys: a reload is running; it reads the file again when it is done")
        return bool(swapped)

    def _read_and_install(self, path: Path) -> bool:
        try:
            entries = read_key_file(path)
        except KeyFileError as err:
            log.error("API keys: reload refused, the %d keys in force stay: %s", len(self.keys), err)
            return False
        added, removed = self._install(entries)
        log.info("API keys reloaded from %s: %d accepted (%d added, %d removed)", path, len(self.keys), added,
                 removed)
        return True

    def identify(self, header: bytes | str | None) -> Key | None:
        """The key an authorization value carries, or None.  Every digest is compared."""
        token = bearer(header)
        if token is None:
            return None
        presented = digest_of(token)
        found = None
        for key in self.keys:  # one snapshot: a reload swaps the tuple, never changes it
            if hmac.compare_digest(key.digest, presented):
                found = key
        return found

    @staticmethod
    def _take(key: Key, count: int, taken: int, now: float) -> float | None:
        """`count` units against the key's rate, `taken` of them taken already (by the door): None when allowed,
        else the seconds until they would be (a refused call gives back what it took).  Holds the lock."""
        rate = key.rate
        if rate <= 0:
            return None
        tokens = min(key.burst, key.tokens + (now - key.refilled) * rate)
        key.refilled = now
        need = min(count, key.burst)  # a call bigger than the burst needs a full bucket, then owes the rest
        if tokens + taken >= need:
            key.tokens = tokens - (count - taken)
            return None
        key.tokens = tokens + taken
        return (need - tokens - taken) / rate

    @staticmethod
    def in_flight(key: Key) -> int:
        return key.inflight

    def admit(self, header: bytes | str | None, transport: str) -> Admission:
        """(key, refusal reason or None, message, retry-after seconds) for a call at the door: its key, and one unit
        against the key's rate; counts refusals.  The in-flight unit is taken by a Ticket."""
        key = self.identify(header)
        if key is None:
            reason = "missing" if bearer(header) is None and not header else "invalid"
            return self._refused(transport, reason, None, "a valid API key is needed: authorization: Bearer KEY",
                                 0.0)
        with self._lock:
            wait = self._take(key, 1, 0, self.clock())
        if wait is not None:
            return self._refused(transport, "rate", key, self.over_rate(key, wait), wait)
        return key, None, "", 0.0

    @staticmethod
    def over_rate(key: Key, wait: float) -> str:
        return f"this API key is over its {key.rate:g} requests per second; retry after {wait:.2f} s"

    def over_concurrency(self, key: Key, transport: str) -> Admission:
        return self._refused(transport, "concurrent", key, f"this API key has {key.concurrent} calls in "
                                                           "flight, its limit; retry when one ends", 1.0)

    def _refused(self, transport: str, reason: str, key: Key | None, message: str, wait: float) -> Admission:
        if self.metrics is not None:
            self.metrics.refused(transport, reason)
        return key, reason, message, wait


def retry_after(seconds: float) -> str:
    return str(max(1, math.ceil(seconds)))


class KeyLimited(ResourceExhausted):
    """A call whose prompts put its key over a limit: RESOURCE_EXHAUSTED / 429, with retry-after."""

    def __init__(self, message: str, retry_after: float):
        super().__init__(message)
        self.retry_after = retry_after


class Ticket:
    """What one call holds of its key: one unit in flight from the door, as many as its prompts once an operation
    knows them (`charge`), all given back when the call ends (`leave`, once)."""

    def __init__(self, store: KeyStore, key: Key, transport: str):
        self.store, self.key, self.transport = store, key, transport
        self.held, self.ended = 0, False

    def enter(self) -> bool:
        """The door's unit in flight, unless the key has max_concurrent units in flight already."""
        store = self.store
        with store._lock:
            if 0 < self.key.concurrent <= self.key.inflight:
                return False
            self.key.inflight += 1
            self.held = 1
            return True

    def leave(self) -> None:
        with self.store._lock:
            self.key.inflight -= self.held
            self.held, self.ended = 0, True

    def charge(self, count: int, what: str, param: str) -> None:
        """The call occupies `count` units (its prompts or rows): take those past the one the door took, against
        the key's rate and its units in flight; refused, it holds no more than before."""
        store, key = self.store, self.key
        limit = key.concurrent
        if count <= max(self.held, 1):
            return
        if 0 < limit < count:
            store._refused(self.transport, "concurrent", key, "", 0.0)
            err = InvalidArgument(f"{count} {what} in one request; this API key may have {limit} in flight at once: "
                                  f"send at most {limit} per request")
            err.param = param
            raise err
        with store._lock:
            if self.ended:  # the call is over (the client went away): nothing to hold
                return
            extra = count - self.held
            wait: float | None
            if 0 < limit < key.inflight + extra:
                reason, message, wait = "concurrent", (f"this API key has {key.inflight} of its {limit} units "
                                                       f"in flight; these {count} {what} need {extra} more: retry "
                                                       "when they end"), 1.0
            elif (wait := store._take(key, count, 1, store.clock())) is not None:
                reason, message = "rate", f"{store.over_rate(key, wait)} ({count} {what} count as {count} requests)"
            else:
                key.inflight += extra
                self.held = count
                return
        store._refused(self.transport, reason, key, message, wait)
        raise KeyLimited(message, wait)


_TICKET: ContextVar[Ticket | None] = ContextVar("posenc_key_ticket", default=None)


def charge(count: int, what: str = "prompts", param: str = "prompt") -> None:
    """The call being served (in this thread or task) carries `count` prompts or rows: with API keys, its key is
    charged one unit for each (KeyLimited or InvalidArgument when over a limit); without, nothing happens."""
    ticket = _TICKET.get()
    if ticket is not None:
        ticket.charge(count, what, param)


def _scoped(iterator: Iterator[Any], ticket: Ticket) -> Iterator[Any]:
    """A streamed answer whose every step runs with the call's ticket current (gRPC pulls it after the handler has
    returned, in a pool thread that serves other calls in between)."""
    try:
        while True:
            token = _TICKET.set(ticket)
            try:
                item = next(iterator)
            except StopIteration:
                return
            finally:
                _TICKET.reset(token)
            yield item
    finally:
        close = getattr(iterator, "close", None)
        if close is not None:
            close()


# gRPC ----------------------------------------------------------------------------------------------------------

_KINDS = {(False, False): ("unary_unary", grpc.unary_unary_rpc_method_handler),
          (False, True): ("unary_stream", grpc.unary_stream_rpc_method_handler),
          (True, False): ("stream_unary", grpc.stream_unary_rpc_method_handler),
          (True, True): ("stream_stream", grpc.stream_stream_rpc_method_handler)}


class KeyInterceptor(grpc.ServerInterceptor):
    """Every method but OPEN_METHODS needs a key in the `authorization` metadata; limits per key."""

    def __init__(self, store: KeyStore):
        self.store = store

    def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
                          details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        handler = continuation(details)
        if handler is None or details.method in OPEN_METHODS:
            return handler
        header = next((v for k, v in details.invocation_metadata or () if k == "authorization"), None)
        # the in-flight unit is taken when the handler runs (below): a call that never reaches it holds none
        key, reason, message, wait = self.store.admit(header, "grpc")
        attr, make = _KINDS[(handler.request_streaming, handler.response_streaming)]
        if reason is not None or key is None:  # no reason: a key
            code = grpc.StatusCode.UNAUTHENTICATED if key is None else grpc.StatusCode.RESOURCE_EXHAUSTED
            trailers = (("retry-after", retry_after(wait)),) if key is not None else ()

            def refuse(request: object, context: grpc.ServicerContext) -> None:
                if trailers:
                    context.set_trailing_metadata(trailers)
                context.abort(code, message)

            return make(refuse)  # the request is never parsed
        inner, store, streamed = getattr(handler, attr), self.store, handler.response_streaming

        def run(request: object, context: grpc.ServicerContext) -> Any:
            ticket = Ticket(store, key, "grpc")
            if not ticket.enter():
                _, _, message, wait = store.over_concurrency(key, "grpc")
                context.set_trailing_metadata((("retry-after", retry_after(wait)),))
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, message)
            if not context.add_callback(ticket.leave):  # the call had ended already
                ticket.leave()
            token = _TICKET.set(ticket)
            try:
                answer = inner(request, context)
            finally:
                _TICKET.reset(token)
            return _scoped(answer, ticket) if streamed else answer

        return make(run, request_deserializer=handler.request_deserializer,
                    response_serializer=handler.response_serializer)


# HTTP ----------------------------------------------------------------------------------------------------------


class KeyMiddleware:
    """ASGI: every path but OPEN_PATHS and `open_paths` (the viewer's static files) needs `Authorization: Bearer
    KEY`; 401 / 429 with a JSON error (the OpenAI error shape on /v1/ routes, {"error": message} elsewhere, as the
    other errors of the HTTP front)."""

    def __init__(self, app: ASGIApp, store: KeyStore, open_paths: Iterable[str] = frozenset()):
        self.app, self.store, self.open = app, store, OPEN_PATHS | frozenset(open_paths)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.open:
            return await self.app(scope, receive, send)
        header = next((v for k, v in scope.get("headers", ()) if k == b"authorization"), None)
        key, reason, message, wait = self.store.admit(header, "http")
        ticket = Ticket(self.store, key, "http") if reason is None and key is not None else None  # no reason: a key
        if ticket is not None and not ticket.enter():
            key, reason, message, wait = self.store.over_concurrency(ticket.key, "http")
        if reason is not None or ticket is None:
            status = 401 if key is None else 429
            return await self._refuse(scope, send, status, message, wait)
        token = _TICKET.set(ticket)  # the operations run with a copy of this context (starlette's thread pool)
        try:
            await self.app(scope, receive, send)
        finally:
            _TICKET.reset(token)
            ticket.leave()

    async def _refuse(self, scope: Scope, send: Send, status: int, message: str, wait: float) -> None:
        path = scope["path"]
        if path.startswith("/v1/") and not path.startswith("/v1/posenc/"):
            kind = "authentication_error" if status == 401 else "rate_limit_error"
            body: dict[str, object] = {"error": {"message": message, "type": kind, "param": None, "code": status}}
        else:
            body = {"error": message}
        data = json.dumps(body).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
        headers.append((b"www-authenticate", b"Bearer") if status == 401 else
                       (b"retry-after", retry_after(wait).encode()))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": data})
