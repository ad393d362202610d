"""API keys at the door, and per-key limits: one key store shared by the gRPC port and the HTTP port.

With `--api-keys-file FILE` (alias `--api-keys`, POSENC_API_KEYS_FILE) every gRPC method and every HTTP route
needs `authorization: Bearer KEY` (gRPC metadata or HTTP header), except what probes and scrapers call without
one: grpc.health.v1, KServe's ServerLive/ServerReady and /v2/health/live, /v2/health/ready (and /metrics, which is
on its own port).  A call without a valid key is UNAUTHENTICATED / 401; a key over its limits is
RESOURCE_EXHAUSTED / 429, with `retry-after` (seconds) in the trailing metadata / headers.

The file holds one key per line: the key itself, or `sha256:<64 hex digits>` of it (so the file need not hold
secrets), optionally followed by that key's own limits (`requests_per_second=R max_concurrent=N`, overriding the
flags below for it); blank lines and lines starting with `#` are ignored.  The store keeps only SHA-256
digests; a presented key is hashed and compared with every digest by hmac.compare_digest, all of them each time,
so neither the time nor the log says which key or how much of one matched.  No key, digest or header value is
ever logged.

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

import hashlib
import hmac
import json
import logging
import math
import threading
import time
from contextvars import ContextVar
from pathlib import Path

import grpc

from service.errors import InvalidArgument, ResourceExhausted

log = logging.getLogger(__name__)

MAX_HEADER = 8192  # a longer authorization value is refused without more ado
OPEN_METHODS = frozenset({"/grpc.health.v1.Health/Check", "/grpc.health.v1.Health/Watch",
                          "/inference.GRPCInferenceService/ServerLive", "/inference.GRPCInferenceService/ServerReady"})
OPEN_PATHS = frozenset({"/v2/health/live", "/v2/health/ready"})


class KeyFileError(ValueError):
    """A key file that cannot be used (the worker refuses to start: one line, exit 2); never quotes a key."""


def digest_of(key: bytes) -> bytes:
    return hashlib.sha256(key).digest()


OPTIONS = {"requests_per_second": float, "max_concurrent": int}  # a key's own limits, after it on its line


def parse_key_lines(text: str, where: str = "the key file") -> list[tuple[bytes, dict]]:
    """(SHA-256 digest, the key's own limits) for every key in a key file's text."""
    entries = []
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        first, *rest = line.split()
        if first.lower().startswith("sha256:"):
            hexed = first[7:]
            if len(hexed) != 64 or any(c not in "0123456789abcdefABCDEF" for c in hexed):
                raise KeyFileError(f"{where} line {n}: sha256: needs 64 hexadecimal digits")
            digest = bytes.fromhex(hexed)
        elif not all(33 <= ord(c) <= 126 for c in first):
            raise KeyFileError(f"{where} line {n}: a key is printable ASCII without spaces (it travels in a header)")
        else:
            digest = digest_of(first.encode())
        limits = {}
        for item in rest:
            name, _, value = item.partition("=")
            try:
                limits[name] = OPTIONS[name](value)
                ok = limits[name] >= 0 and limits[name] == limits[name]
            except (KeyError, ValueError):
                ok = False
            if not ok:
                raise KeyFileError(f"{where} line {n}: after the key only requests_per_second=R and "
                                   "max_concurrent=N (numbers >= 0) may follow")
        entries.append((digest, limits))
    if not entries:
        raise KeyFileError(f"{where} holds no key (one per line, or sha256:<hex>)")
    return entries


def parse_keys(text: str, where: str = "the key file") -> list[bytes]:
    """SHA-256 digests of the keys in a key file's text."""
    return [digest for digest, _ in parse_key_lines(text, where)]


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
    """The accepted keys (digests) and each key's rate bucket and calls in flight."""

    def __init__(self, digests: list[bytes], rate: float = 0.0, max_concurrent: int = 0, metrics=None,
                 clock=time.monotonic, limits: list[dict] | None = None):
        """`rate` and `max_concurrent` hold for every key but those whose `limits` entry sets its own."""
        self.digests = list(digests)
        self.rate, self.max_concurrent, self.metrics, self.clock = rate, max_concurrent, metrics, clock
        own = limits or [{}] * len(self.digests)
        self.rates = [o.get("requests_per_second", rate) for o in own]
        self.concurrent = [o.get("max_concurrent", max_concurrent) for o in own]
        self.bursts = [max(1.0, r) for r in self.rates]
        self._lock = threading.Lock()
        self._tokens = list(self.bursts)
        self._refilled = [clock()] * len(self.digests)
        self._inflight = [0] * len(self.digests)

    @classmethod
    def from_file(cls, path: Path, **kwargs) -> KeyStore:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as err:
            raise KeyFileError(f"cannot read the API key file {path}: {getattr(err, 'strerror', None) or err}") \
                from None
        entries = parse_key_lines(text, f"API key file {path}")
        store = cls([d for d, _ in entries], limits=[o for _, o in entries], **kwargs)
        log.info("API keys: %d accepted (from %s); per key: %s requests/s, %s calls at once", len(store.digests),
                 path, store.rate or "any", store.max_concurrent or "any")
        return store

    def identify(self, header: bytes | str | None) -> int | None:
        """The index of the key an authorization value carries, or None.  Every digest is compared."""
        token = bearer(header)
        if token is None:
            return None
        presented = digest_of(token)
        found = -1
        for i, d in enumerate(self.digests):
            if hmac.compare_digest(d, presented):
                found = i
        return found if found >= 0 else None

    def _take(self, key: int, count: int, taken: int) -> float | None:
        """`count` units against the key's rate, `taken` of them taken already (by the door): None when allowed,
        else the seconds until they would be (a refused call gives back what it took).  Holds the lock."""
        rate = self.rates[key]
        if rate <= 0:
            return None
        now = self.clock()
        tokens = min(self.bursts[key], self._tokens[key] + (now - self._refilled[key]) * rate)
        self._refilled[key] = now
        need = min(count, self.bursts[key])  # a call bigger than the burst needs a full bucket, then owes the rest
        if tokens + taken >= need:
            self._tokens[key] = tokens - (count - taken)
            return None
        self._tokens[key] = tokens + taken
        return (need - tokens - taken) / rate

    def in_flight(self, key: int) -> int:
        return self._inflight[key]

    def admit(self, header, transport: str) -> tuple[int | None, str | None, str, float]:
        """(key, refusal reason or None, message, retry-after seconds) for a call at the door: its key, and one unit
        against the key's rate; counts refusals.  The in-flight unit is taken by a Ticket."""
        key = self.identify(header)
        if key is None:
            reason = "missing" if bearer(header) is None and not header else "invalid"
            return self._refused(transport, reason, None, "a valid API key is needed: authorization: Bearer KEY",
                                 0.0)
        with self._lock:
            wait = self._take(key, 1, 0)
        if wait is not None:
            return self._refused(transport, "rate", key, self.over_rate(key, wait), wait)
        return key, None, "", 0.0

    def over_rate(self, key: int, wait: float) -> str:
        return f"this API key is over its {self.rates[key]:g} requests per second; retry after {wait:.2f} s"

    def over_concurrency(self, key: int, transport: str):
        return self._refused(transport, "concurrent", key, f"this API key has {self.concurrent[key]} calls in "
                                                           "flight, its limit; retry when one ends", 1.0)

    def _refused(self, transport, reason, key, message, wait):
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

    def __init__(self, store: KeyStore, key: int, transport: str):
        self.store, self.key, self.transport = store, key, transport
        self.held, self.ended = 0, False

    def enter(self) -> bool:
        """The door's unit in flight, unless the key has max_concurrent units in flight already."""
        store = self.store
        with store._lock:
            if 0 < store.concurrent[self.key] <= store._inflight[self.key]:
                return False
            store._inflight[self.key] += 1
            self.held = 1
            return True

    def leave(self) -> None:
        with self.store._lock:
            self.store._inflight[self.key] -= self.held
            self.held, self.ended = 0, True

    def charge(self, count: int, what: str, param: str) -> None:
        """The call occupies `count` units (its prompts or rows): take those past the one the door took, against
        the key's rate and its units in flight; refused, it holds no more than before."""
        store, key = self.store, self.key
        limit = store.concurrent[key]
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
            if 0 < limit < store._inflight[key] + extra:
                reason, message, wait = "concurrent", (f"this API key has {store._inflight[key]} of its {limit} units "
                                                       f"in flight; these {count} {what} need {extra} more: retry "
                                                       "when they end"), 1.0
            elif (wait := store._take(key, count, 1)) is not None:
                reason, message = "rate", f"{store.over_rate(key, wait)} ({count} {what} count as {count} requests)"
            else:
                store._inflight[key] += extra
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


def _scoped(iterator, ticket: Ticket):
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

    def intercept_service(self, continuation, details):
        handler = continuation(details)
        if handler is None or details.method in OPEN_METHODS:
            return handler
        header = next((v for k, v in details.invocation_metadata or () if k == "authorization"), None)
        # the in-flight unit is taken when the handler runs (below): a call that never reaches it holds none
        key, reason, message, wait = self.store.admit(header, "grpc")
        attr, make = _KINDS[(handler.request_streaming, handler.response_streaming)]
        if reason is not None:
            code = grpc.StatusCode.UNAUTHENTICATED if key is None else grpc.StatusCode.RESOURCE_EXHAUSTED
            trailers = (("retry-after", retry_after(wait)),) if key is not None else ()

            def refuse(request, context):
                if trailers:
                    context.set_trailing_metadata(trailers)
                context.abort(code, message)

            return make(refuse)  # the request is never parsed
        inner, store, streamed = getattr(handler, attr), self.store, handler.response_streaming

        def run(request, context):
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
    """ASGI: every path but OPEN_PATHS needs `Authorization: Bearer KEY`; 401 / 429 with a JSON error (the OpenAI
    error shape on /v1/ routes, {"error": message} elsewhere, as the other errors of the HTTP front)."""

    def __init__(self, app, store: KeyStore):
        self.app, self.store = app, store

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        header = next((v for k, v in scope.get("headers", ()) if k == b"authorization"), None)
        key, reason, message, wait = self.store.admit(header, "http")
        ticket = Ticket(self.store, key, "http") if reason is None else None
        if ticket is not None and not ticket.enter():
            key, reason, message, wait = self.store.over_concurrency(key, "http")
        if reason is not None:
            status = 401 if key is None else 429
            return await self._refuse(scope, send, status, message, wait)
        token = _TICKET.set(ticket)  # the operations run with a copy of this context (starlette's thread pool)
        try:
            await self.app(scope, receive, send)
        finally:
            _TICKET.reset(token)
            ticket.leave()

    async def _refuse(self, scope, send, status: int, message: str, wait: float) -> None:
        path = scope["path"]
        if path.startswith("/v1/") and not path.startswith("/v1/posenc/"):
            kind = "authentication_error" if status == 401 else "rate_limit_error"
            body = {"error": {"message": message, "type": kind, "param": None, "code": status}}
        else:
            body = {"error": message}
        data = json.dumps(body).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
        headers.append((b"www-authenticate", b"Bearer") if status == 401 else
                       (b"retry-after", retry_after(wait).encode()))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": data})
