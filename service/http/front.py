"""What every HTTP route shares: the worker's operations, the error table, in-flight counting for the drain, the
deadline, bodies under the size limit, JSON and streamed responses, and per-route metrics.

Handlers are async and run on uvicorn's one event loop; the operations block on scheduler futures, so they run in
the thread pool (starlette's run_in_threadpool), and a stream pulls each item from its blocking iterator there."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Awaitable, Callable, Iterator

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from service.errors import Unavailable
from service.http.errors import HttpError, body_of, status_of
from service.kserve import KServeServicer
from service.operations import Operations
from service.servicer import PosencApi

TIMEOUT_HEADER = "x-request-timeout"  # seconds; the HTTP twin of a gRPC deadline
_END = object()


class Front:
    """The HTTP front's view of the worker: the same operations, limits and metrics as the gRPC servicers."""

    def __init__(self, ops: Operations, kserve: KServeServicer, ready: Callable[[], bool], instance: str = ""):
        self.ops, self.registry, self.limits = ops, ops.registry, ops.registry.limits
        self.metrics = ops.registry.metrics
        self.posenc = PosencApi(ops)
        self.kserve = kserve
        self.instance = instance
        self._ready = ready
        self.draining = False  # set by stop(): readiness answers 503 while in-flight work finishes
        self.inflight = 0  # requests and open streams; touched only on the event loop

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
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise HttpError(413, f"request body is over the {limit}-byte message limit")
            chunks.append(chunk)
        return b"".join(chunks)

    async def json(self, request: Request) -> dict:
        data = await self.body(request)
        try:
            value = json.loads(data)
        except (UnicodeDecodeError, ValueError, RecursionError) as err:  # JSONDecodeError is a ValueError
            raise HttpError(400, f"request body is not valid JSON: {err}") from None
        if not isinstance(value, dict):
            raise HttpError(400, f"request body must be a JSON object, got {type(value).__name__}")
        return value

    @staticmethod
    async def call(fn, *args):
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
            if self.instance:
                response.headers["posenc-instance"] = self.instance
            if isinstance(response, EventStream):
                response.on_close = done
            else:
                done(response.status_code)
            return response

        return Route(path, endpoint, methods=list(methods))


def json_response(value, status: int = 200) -> Response:
    # allow_nan=False: a NaN in an answer is a bug that should surface as a 500 with a request id, not bad JSON
    return Response(json.dumps(value, separators=(",", ":"), allow_nan=False), status,
                    media_type="application/json")


class EventStream(StreamingResponse):
    """Items of a blocking iterator (started already: its first item is in hand) as a streamed body.

    Each next() runs in the thread pool; when the client goes away, starlette cancels the body, the step in
    flight finishes, and the iterator is closed (its stream slot and model are released); `active` turns false so
    an operation that checks is_active stops at its next step.  `ready` (optional) says whether the iterator's
    next item is already there: such items go out with the one before, one hop to the thread pool and one write
    for all of them (a decode loop that runs ahead of the network sends several tokens at once)."""

    def __init__(self, iterator: Iterator, first, encode: Callable[[object], str], media_type: str,
                 on_error: Callable[[BaseException], str], tail: str = "", ready: Callable[[], bool] | None = None):
        self.iterator, self.first, self.encode, self.on_error, self.tail = iterator, first, encode, on_error, tail
        self.ready, self._error = ready, None
        self.active = True
        self.on_close: Callable[[int], None] = lambda status: None
        super().__init__(self._body(), media_type=media_type, headers={"cache-control": "no-cache"})

    def is_active(self) -> bool:
        return self.active

    def _pull(self) -> list:
        """The next item (blocking), then every item already there (up to 64); _END last when the iterator ends.
        An error after some items is kept for the next pull, so the items before it go out first."""
        items = [next(self.iterator, _END)]
        try:
            while items[-1] is not _END and len(items) < 64 and self.ready is not None and self.ready():
                items.append(next(self.iterator, _END))
        except Exception as exc:  # noqa: BLE001 - raised at the next pull, after these items are sent
            self._error = exc
        return items

    async def _body(self):
        try:
            done = self.first is _END
            if not done:
                yield self.encode(self.first)
            while not done:
                if self._error is not None:
                    raise self._error
                items = await run_in_threadpool(self._pull)
                text = "".join(self.encode(i) for i in items if i is not _END)
                if text:
                    yield text
                done = items[-1] is _END
        except Exception as exc:  # noqa: BLE001 - mid-stream: the status is sent; the error goes in the body
            yield self.on_error(exc)
        if self.tail:
            yield self.tail

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.active = False
            close = getattr(self.iterator, "close", None)
            if close is not None:
                close()
            self.on_close(self.status_code)


async def start_stream(front: Front, make: Callable[[Callable[[], bool]], Iterator]) -> tuple[Iterator, object, list]:
    """Start a blocking stream and take its first item, so errors before the first item (unknown model, bad
    field, too many streams) are HTTP statuses rather than a 200 with an error inside.  `make` gets the
    is_active callable; the returned holder list receives the EventStream once it exists."""
    holder: list[EventStream] = []
    iterator = make(lambda: not holder or holder[0].is_active())
    try:
        first = await run_in_threadpool(next, iterator, _END)
    except BaseException:
        close = getattr(iterator, "close", None)
        if close is not None:
            close()
        raise
    return iterator, first, holder


END = _END
