"""What every HTTP route shares: the worker's operations, the error table, in-flight counting for the drain, the
deadline, bodies under the size limit, JSON and streamed responses, and per-route metrics.

Handlers are async and run on uvicorn's one event loop; the operations block on the engines' futures, so they run in
the thread pool (starlette's run_in_threadpool, --workers threads at once), and a stream pulls each item from its
blocking iterator in threads of its own (up to --max-streams at once), so unary calls waiting for a thread never
hold up a stream."""

from __future__ import annotations

import json
import math
import re
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from json import detect_encoding
from typing import TYPE_CHECKING, Any, TypeVar

import anyio.to_thread
from anyio import CapacityLimiter
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from service.auth import retry_after
from service.errors import Unavailable
from service.http.errors import HttpError, body_of, field_name, status_of
from service.kserve import KServeServicer
from service.operations import Operations
from service.servicer import PosencApi

if TYPE_CHECKING:
    from pathlib import Path

    from starlette.types import Receive, Scope, Send

TIMEOUT_HEADER = "x-request-timeout"  # seconds; the HTTP twin of a gRPC deadline
# A body under this many bytes is parsed and validated on the event loop (well under a millisecond: a thread hop
# would cost more); a bigger one in the thread pool (8.6 MB of JSON held the loop for 0.31 s).
PARSE_INLINE = 64 * 1024
_END = object()
T = TypeVar("T")


def json_object(data: bytes, what: str = "request body") -> dict[str, Any]:
    """A body as a JSON object; anything else is 400 saying what it is, and so is a string that is not Unicode
    text (lone_surrogate), so no route hands one on (the tokenizers library raises TypeError on it)."""
    try:
        value = json.loads(data)
    except (UnicodeDecodeError, ValueError, RecursionError) as err:  # JSONDecodeError is a ValueError
        raise HttpError(400, f"{what} is not valid JSON: {err}") from None
    if not isinstance(value, dict):
        raise HttpError(400, f"{what} must be a JSON object, got {type(value).__name__}")
    if not detect_encoding(data).startswith("utf-8") or (
            (b"\\" in data or b"\xed" in data) and _MAYBE_SURROGATE.search(data)):
        lone_surrogate(value)
    return value


# JSON escapes (or raw UTF-8-style bytes, which json.loads lets through) of the UTF-16 surrogates U+D800..U+DFFF: a
# body without any holds none, and the walk below is skipped (a pair, e.g. "\ud83d\ude00" for an emoji, is one
# character once parsed; json.dumps writes every character past U+FFFF so by default).  Two one-byte searches go
# first: on an 8 MB body of numbers they cost 0.1 ms, this pattern 120 ms (json.loads itself 350 ms).
_MAYBE_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]")
_SURROGATE = re.compile("[\ud800-\udfff]")
_NESTED = {str, list, dict}  # what json.loads makes that may hold a string


def lone_surrogate(doc: dict[str, Any]) -> None:
    """400 naming the first field (in the body's order) whose string, or one of whose keys, holds a lone UTF-16
    surrogate (an escaped "\\ud800" without its other half): not a Unicode character, so not text UTF-8 can carry;
    JSON's parser lets it through where protobuf, gRPC and the tokenizers library refuse it."""
    stack: list[tuple[tuple[int | str, ...], Any]] = [((), doc)]
    while stack:
        loc, value = stack.pop()
        found: re.Match[str] | None = None
        if isinstance(value, str):
            found = _SURROGATE.search(value)
        elif isinstance(value, dict):
            found = next((m for m in map(_SURROGATE.search, value) if m), None)  # a key
            stack += [(loc + (k,), v) for k, v in reversed(value.items()) if type(v) in _NESTED]
        elif isinstance(value, list):
            nested = [i for i, v in enumerate(value) if type(v) in _NESTED]  # (a tensor's numbers are skipped)
            stack += [(loc + (i,), value[i]) for i in reversed(nested)]
        if found is not None:
            where = field_name(loc) or "body"
            raise HttpError(400, f"field {where!r}: {'a key ' if isinstance(value, dict) else ''}holds "
                                 f"U+{ord(found.group()):04X}, half of a UTF-16 surrogate pair without its other "
                                 "half, which is not a character (text must be Unicode; an escaped pair such as "
                                 "\\ud83d\\ude00 is one character)", param=where)


class Front:
    """The HTTP front's view of the worker: the same operations, limits and metrics as the gRPC servicers."""

    def __init__(self, ops: Operations, kserve: KServeServicer, ready: Callable[[], bool], instance: str = "",
                 studies: Path | None = None):
        self.ops, self.registry, self.limits = ops, ops.registry, ops.registry.limits
        self.metrics = ops.registry.metrics
        self.posenc = PosencApi(ops)
        self.kserve = kserve
        self.instance = instance
        self.studies = studies  # --studies-dir: the results files GET /v1/posenc/studies lists (service.http.studies)
        self._ready = ready
        self.draining = False  # set by stop(): readiness answers 503 while in-flight work finishes
        self.inflight = 0  # requests and open streams; touched only on the event loop
        self.streams: set[EventStream] = set()  # the open streams, which stop() cuts off past the grace period
        self._stream_threads: CapacityLimiter | None = None

    def stream_threads(self) -> CapacityLimiter:
        """The streams' own thread limit (made on the event loop, at first use)."""
        if self._stream_threads is None:
            self._stream_threads = CapacityLimiter(self.limits.max_streams)
        return self._stream_threads

    def ready(self) -> bool:
        return self._ready() and not self.draining

    def deadline(self, request: Request) -> float | None:
        """The client's X-Request-Timeout (seconds), capped by --max-request-seconds like a gRPC deadline."""
        cap = self.limits.max_request_s
        raw = request.headers.get(TIMEOUT_HEADER)
        client = None
        if raw is not None:
            try:
                seconds = float(raw)
            except ValueError:
                seconds = math.nan
            if not seconds > 0 or not math.isfinite(seconds):
                raise HttpError(400, f"header {TIMEOUT_HEADER} must be a positive number of seconds, got {raw!r}")
            client = time.monotonic() + seconds
        if not cap or cap <= 0:
            return client
        capped = time.monotonic() + cap
        return capped if client is None else min(client, capped)

    async def body(self, request: Request) -> bytes:
        """The request body, refused with 413 past the server's message size limit (before reading it all)."""
        limit = self.limits.max_message_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise HttpError(413, f"request body of {declared} bytes is over the {limit}-byte message limit")
        chunks: list[bytes] = []
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise HttpError(413, f"request body is over the {limit}-byte message limit")
            chunks.append(chunk)
        return b"".join(chunks)

    async def json(self, request: Request) -> dict[str, Any]:
        """The body as a JSON object (400 when it is not one), parsed off the event loop when it is big."""
        return await self.parsed(request, lambda doc: doc)

    async def parsed(self, request: Request, then: Callable[[dict[str, Any]], T]) -> T:
        """`then` (the route's validation: 400 naming a bad field) of the body as a JSON object; for a body of
        PARSE_INLINE bytes or more both run in the thread pool, so a big body never holds the event loop (health
        checks, other requests' reads, streams' writes)."""
        data = await self.body(request)
        return await self.off_loop(len(data), lambda: then(json_object(data)))

    @staticmethod
    async def off_loop(size: int, fn: Callable[[], T]) -> T:
        """fn() on the event loop for a body under PARSE_INLINE bytes (no thread hop), else in the thread pool."""
        return fn() if size < PARSE_INLINE else await run_in_threadpool(fn)

    @staticmethod
    async def call(fn: Callable[..., T], *args: Any) -> T:
        return await run_in_threadpool(fn, *args)

    def route(self, path: str, handler: Callable[[Request], Awaitable[Response]], methods: tuple[str, ...] = ("GET",),
              openai: bool = False, draining_too: bool = False) -> Route:
        """A route whose errors become statuses from one table, counted while in flight, timed in the metrics.
        While draining, only routes marked draining_too (health) answer; others get 503 before doing anything,
        as gRPC's stop() refuses new calls."""

        async def endpoint(request: Request) -> Response:
            start = time.monotonic()
            self.inflight += 1

            def done(status: int) -> None:
                self.inflight -= 1
                self.metrics.observe_http(path, request.method, status, time.monotonic() - start)

            try:
                if self.draining and not draining_too:
                    raise Unavailable("server is shutting down")
                response = await handler(request)
            except Exception as exc:  # noqa: BLE001 - every exception becomes a status (500s logged with an id)
                status, message = status_of(exc, f"{request.method} {path}")
                response = JSONResponse(body_of(status, message, openai, getattr(exc, "param", None)), status)
                if (wait := getattr(exc, "retry_after", None)) is not None:  # a key over its limits (KeyLimited)
                    response.headers["retry-after"] = retry_after(wait)
            except BaseException:  # cancelled: the client went away, or the server's shutdown cut the request off
                done(499)
                raise
            if self.instance:
                response.headers["posenc-instance"] = self.instance
            if isinstance(response, EventStream):
                self.streams.add(response)
                response.limiter = self.stream_threads()

                def closed(status: int, stream: EventStream = response) -> None:
                    self.streams.discard(stream)
                    done(status)

                response.on_close = closed
            else:
                done(response.status_code)
            return response

        return Route(path, endpoint, methods=list(methods))


def json_response(value: object, status: int = 200) -> Response:
    # allow_nan=False: a NaN in an answer is a bug that should surface as a 500 with a request id, not bad JSON
    return Response(json.dumps(value, separators=(",", ":"), allow_nan=False), status,
                    media_type="application/json")


class EventStream(StreamingResponse):
    """Items of a blocking iterator (started already: its first item is in hand) as a streamed body.

    Each next() runs in a thread of the streams' own limit (Front.stream_threads); when the client goes away,
    starlette cancels the body, the step in flight finishes, and the iterator is closed (Pulled: in that step's
    thread; its stream slot and model are released); `active` turns false so an operation that checks is_active
    stops at its next step.  `ready` (optional) says whether the iterator's
    next item is already there: such items go out with the one before, one hop to the thread pool and one write
    for all of them (a decode loop that runs ahead of the network sends several tokens at once)."""

    def __init__(self, iterator: Iterator[Any], first: object, encode: Callable[[Any], str], media_type: str,
                 on_error: Callable[[BaseException], str], tail: str = "", ready: Callable[[], bool] | None = None):
        self.iterator, self.first, self.encode, self.on_error, self.tail = iterator, first, encode, on_error, tail
        self.ready = ready
        self._error: Exception | None = None
        self.active = True
        self.cut_off: Exception | None = None  # why the server ended the stream early (cut)
        self.limiter: CapacityLimiter | None = None  # the threads pulls run in (Front.stream_threads)
        self.on_close: Callable[[int], None] = lambda status: None
        super().__init__(self._body(), media_type=media_type, headers={"cache-control": "no-cache"})

    def is_active(self) -> bool:
        return self.active

    def cut(self, reason: Exception) -> None:
        """End the stream early, from any thread: the operation stops at its next step (it checks is_active), and
        the body ends with `reason` as its error item and the tail, so the client reads a whole answer."""
        self.cut_off = reason
        self.active = False

    def _pull(self) -> list[object]:
        """The next item (blocking), then every item already there (up to 64); _END last when the iterator ends.
        An error after some items is kept for the next pull, so the items before it go out first."""
        items = [next(self.iterator, _END)]
        try:
            while items[-1] is not _END and len(items) < 64 and self.ready is not None and self.ready():
                items.append(next(self.iterator, _END))
        except Exception as exc:  # noqa: BLE001 - raised at the next pull, after these items are sent
            self._error = exc
        return items

    async def _body(self) -> AsyncIterator[str]:
        try:
            done = self.first is _END
            if not done:
                yield self.encode(self.first)
            while not done:
                if self._error is not None:
                    raise self._error
                items = await anyio.to_thread.run_sync(self._pull, limiter=self.limiter)
                text = "".join(self.encode(i) for i in items if i is not _END)
                if text:
                    yield text
                done = items[-1] is _END
        except Exception as exc:  # noqa: BLE001 - mid-stream: the status is sent; the error goes in the body
            yield self.on_error(self.cut_off or exc)
        if self.tail:
            yield self.tail

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:  # the end, the client gone, or the server's shutdown cancelling the response mid-pull
            self.active = False
            try:
                close = getattr(self.iterator, "close", None)
                if close is not None:
                    close()
            finally:
                self.on_close(self.status_code)


class Pulled:
    """A blocking iterator that is pulled in the thread pool and closed from the event loop.  When the response
    ends while a next() is still running in its thread (starlette cancels the body when the client goes away,
    uvicorn when its graceful shutdown times out), closing the generator there would raise "generator already
    executing": the close waits for that next() to return and happens in its thread."""

    def __init__(self, iterator: Iterator[Any]):
        self.iterator = iterator
        self._lock = threading.Lock()
        self._running = self._closing = False

    def __iter__(self) -> Pulled:
        return self

    def __next__(self) -> Any:
        with self._lock:
            if self._closing:
                raise StopIteration
            self._running = True
        try:
            return next(self.iterator)
        finally:
            with self._lock:
                self._running = False
                closing = self._closing
            if closing:
                self._close()

    def close(self) -> None:
        with self._lock:
            self._closing = True
            if self._running:
                return  # the running next() closes it when it returns
        self._close()

    def _close(self) -> None:
        close = getattr(self.iterator, "close", None)
        if close is not None:
            close()


async def start_stream(front: Front, make: Callable[[Callable[[], bool]], Iterator[Any]]
                       ) -> tuple[Iterator[Any], object, list[EventStream]]:
    """Start a blocking stream and take its first item, so errors before the first item (unknown model, bad
    field, too many streams) are HTTP statuses rather than a 200 with an error inside.  `make` gets the
    is_active callable; the returned holder list receives the EventStream once it exists."""
    holder: list[EventStream] = []
    iterator = Pulled(make(lambda: not holder or holder[0].is_active()))
    try:
        first = await anyio.to_thread.run_sync(next, iterator, _END, limiter=front.stream_threads())
    except BaseException:
        iterator.close()
        raise
    return iterator, first, holder


END = _END
