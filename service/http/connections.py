"""HTTP keep-alive with a bounded age: the twin of gRPC's max_connection_age for the HTTP port.

Behind a Kubernetes Service (kube-proxy balances per connection) or a DNS name, a client that keeps one HTTP/1.1
connection open sends every request to the replica it first reached, so replicas added later get none of its
calls.  This ASGI middleware answers the first request that arrives on a connection older than the age with
`Connection: close`: the answer is whole, uvicorn closes the connection after it, and the client's next request
opens a new connection, which the Service may send anywhere.  A connection is known by the client's address and
port (uvicorn gives one ASGI scope per request, none per connection); idle connections are closed by uvicorn's
keep-alive timeout, so an entry older than the age plus a minute belongs to a connection that is gone.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send


class ConnectionAge:
    def __init__(self, app: ASGIApp, max_age_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.app, self.max_age_s, self.clock = app, max_age_s, clock
        self.born: dict[tuple[Any, ...], float] = {}
        self._pruned = clock()

    def _prune(self, now: float) -> None:
        if now - self._pruned < 10.0:
            return
        self._pruned = now
        horizon = now - self.max_age_s - 60.0
        for key in [k for k, t in self.born.items() if t < horizon]:
            del self.born[key]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self.max_age_s <= 0 or not scope.get("client"):
            return await self.app(scope, receive, send)
        key = tuple(scope["client"])
        now = self.clock()
        self._prune(now)
        born = self.born.setdefault(key, now)
        if now - born < self.max_age_s:
            return await self.app(scope, receive, send)
        del self.born[key]  # the connection closes after this answer; the address may come back as a new one

        async def send_closing(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"connection"]
                message = {**message, "headers": [*headers, (b"connection", b"close")]}
            await send(message)

        return await self.app(scope, receive, send_closing)
