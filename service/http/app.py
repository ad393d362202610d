"""The HTTP front: one Starlette app (KServe v2 REST, OpenAI completions, posenc JSON, the viewer) served by
uvicorn in a thread of the worker's process, started and stopped by service.server.Server.

Same models, engines and limits as gRPC: every route calls service.operations through the same translation
the gRPC servicers use (service.servicer.PosencApi, service.kserve.KServeServicer.infer)."""

from __future__ import annotations

import contextlib
import logging
import socket
import ssl
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import anyio.to_thread
import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response

from service.auth import KeyMiddleware, KeyStore
from service.errors import Unavailable
from service.http.chat import Chat
from service.http.connections import ConnectionAge
from service.http.errors import body_of
from service.http.front import Front, json_response
from service.http.kserve_rest import KServeModel, KServeModelVersion, KServeServer
from service.http.openai import OpenAI
from service.http.openapi import Reference
from service.http.posenc_json import PosencJson
from service.http.routing import Api, Route
from service.http.static import Viewer
from service.http.studies import Studies

if TYPE_CHECKING:
    from starlette.types import ASGIApp, ExceptionHandler

    from service.kserve import KServeServicer
    from service.operations import Operations
    from service.settings import Settings

log = logging.getLogger(__name__)
CUT_SECONDS = 5.0  # after the grace period, how long cut-off streams have to end (a step and a write)

# The APIs the front serves, each a class of handlers declared with @route (service.http.routing); the route table
# and GET /openapi.json (service.http.openapi.Reference, always added last) are made from their declarations.
APIS: tuple[type[Api], ...] = (KServeServer, KServeModel, KServeModelVersion, OpenAI, Chat, PosencJson, Studies,
                               Viewer)


def own_spec(apis: Sequence[type[Api]] = APIS) -> list[Route]:
    """Every route the app serves, as declared, /openapi.json last: what the OpenAPI document describes."""
    every: tuple[type[Api], ...] = (*apis, Reference)
    return [r for api in every for r in api.declarations()]


def build_app(front: Front, workers: int, apis: Sequence[type[Api]] = APIS) -> Starlette:
    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        # Blocking operations run in anyio's thread pool: as many at once as the gRPC server has workers.
        anyio.to_thread.current_default_thread_limiter().total_tokens = max(workers, 4)
        yield

    async def not_found(request: Request, exc: HTTPException) -> Response:
        front.metrics.observe_http("unmatched", request.method, exc.status_code, 0.0)
        what = "no such route" if exc.status_code == 404 else f"method {request.method} not allowed here"
        openai_style = request.url.path.startswith("/v1/") and not request.url.path.startswith("/v1/posenc/")
        return json_response(body_of(exc.status_code, f"{what}: {request.method} {request.url.path}", openai_style),
                             exc.status_code)

    handlers = [*(api(front) for api in apis), Reference(front, own_spec(apis))]
    routes = [r for api in handlers for r in api.routes()]
    # starlette calls a status code's handler with its HTTPException, though its type names any Exception
    on_status = cast("dict[Any, ExceptionHandler]", {404: not_found, 405: not_found})
    return Starlette(routes=routes, lifespan=lifespan, exception_handlers=on_status)


def listen(host: str, port: int) -> socket.socket:
    """The listening socket, bound here so a taken port is an OSError with a reason (uvicorn's own binding exits
    the process).  Created with proto IPPROTO_TCP: asyncio turns Nagle off (TCP_NODELAY) only for sockets that
    say so, and with Nagle on, a small answer written as headers then body waits out the client's delayed ACK
    (~40 ms per request, measured)."""
    sock = None
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                                             proto=socket.IPPROTO_TCP, flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as err:
        if sock is not None:
            sock.close()
        raise OSError(f"cannot listen for HTTP on {host}:{port}: {err.strerror or err}") from None
    sock.set_inheritable(True)
    return sock


class HttpServer:
    """uvicorn on its own thread and event loop; stop() drains: readiness turns 503, requests and streams in
    flight finish (up to the grace period), then the listener closes."""

    def __init__(self, front: Front, host: str, port: int, workers: int = 16, tls_cert: Path | None = None,
                 tls_key: Path | None = None, tls_client_ca: Path | None = None, max_connection_age_s: float = 0.0,
                 auth: KeyStore | None = None, apis: Sequence[type[Api]] = APIS):
        self.front = front
        tls: dict[str, Any] = {}
        if tls_cert is not None:
            tls = {"ssl_certfile": str(tls_cert), "ssl_keyfile": str(tls_key)}
            if tls_client_ca is not None:
                tls |= {"ssl_ca_certs": str(tls_client_ca), "ssl_cert_reqs": ssl.CERT_REQUIRED}
        app: ASGIApp = build_app(front, workers, apis)
        if auth is not None:
            # API keys and per-key limits (service.auth), before any route; the routes declared keyless (health,
            # the viewer's files) stay open, so the viewer's page loads and asks for a key when its API calls get 401
            app = KeyMiddleware(app, auth, open_paths={r.path for r in own_spec(apis) if r.keyless})
        app = ConnectionAge(app, max_connection_age_s)  # keep-alive bounded, as gRPC's
        self.config = uvicorn.Config(app, host=host, port=port, log_config=None,
                                     access_log=False, server_header=False, lifespan="on",
                                     timeout_graceful_shutdown=1, **tls)
        self.server = uvicorn.Server(self.config)
        self.socket = listen(host, port)
        self.port = self.socket.getsockname()[1]
        self.scheme = "https" if tls else "http"
        self.thread: threading.Thread | None = None

    def start(self, timeout: float = 30.0) -> HttpServer:
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.socket]}, name="http",
                                       daemon=True)
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the HTTP server did not start on port {self.port} (see the log)")
            time.sleep(0.01)
        log.info("HTTP on %s://%s:%d", self.scheme, self.config.host, self.port)
        return self

    def stop(self, grace: float = 10.0) -> None:
        """Drain: new requests get 503 while those in flight finish, up to `grace` seconds; then the streams still
        open are cut off (each ends with a 503 error item, its generator stopped at its next step in its own
        thread), and after a few more seconds uvicorn cancels whatever is left (a client that stopped reading)."""
        front = self.front
        front.draining = True
        deadline = time.monotonic() + grace
        while front.inflight > 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        if front.inflight > 0:
            streams = list(front.streams)
            log.warning("HTTP: %d requests still in flight after %.1f s; cutting off %d streams", front.inflight,
                        grace, len(streams))
            for stream in streams:
                stream.cut(Unavailable(f"server is shutting down: the stream was cut off after {grace:g} s"))
            deadline = time.monotonic() + CUT_SECONDS
            while front.inflight > 0 and time.monotonic() < deadline:
                time.sleep(0.02)
        self.server.should_exit = True  # uvicorn cancels what is left after its own 1 s
        if self.thread is not None:
            self.thread.join(timeout=10)
        self.socket.close()
        log.info("HTTP closed, %d requests in flight", self.front.inflight)  # each cut-off one settled: 0


def http_server(ops: Operations, kserve: KServeServicer, ready: Callable[[], bool], s: Settings,
                auth: KeyStore | None = None) -> HttpServer:
    """The HTTP front for service.server.Server: its settings (host, http_port, workers, TLS) and its parts."""
    return HttpServer(Front(ops, kserve, ready, s.instance, s.studies_dir), s.host, s.http_port, s.workers,
                      s.tls_cert, s.tls_key, s.tls_client_ca, s.max_connection_age_s, auth)
