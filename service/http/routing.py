"""HTTP routes declared once.  A handler is an async method of a small API class (one per API: KServe REST,
OpenAI, chat and tokenize, posenc JSON, the viewer, the OpenAPI document) marked with @route, which says everything
about the route: its HTTP method and path, the request and response models, a summary, and its flags.  Both the
Starlette route table (service.http.app) and the OpenAPI document (service.http.openapi) are read from these
declarations, so a route cannot be served without being documented, nor documented without being served.

An API class holds what its handlers need (the Front, hence the worker's operations), so a handler can be called
alone: `await OpenAI(front).models(request)`."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

from pydantic import BaseModel
from starlette.routing import Route as StarletteRoute

from service.http.front import Front

Handler = Callable[..., Any]  # an API class's method answering a route

@dataclass(frozen=True)
class Route:
    """One HTTP method at one path, as the route table serves it and the OpenAPI document describes it."""

    method: str  # GET, POST
    path: str  # Starlette's path syntax; each {param} is a path parameter in the document
    summary: str  # the document's one-line description
    request: type[BaseModel] | None = None  # the JSON body's model (None: no body)
    response: type[BaseModel] | str | None = None  # the answer's model, a media type (a static file), or None
    streamed: tuple[type[BaseModel], ...] = ()  # models of a stream's items that `response` does not name
    openai: bool = False  # errors in OpenAI's shape {"error": {"message", "type", "param", "code"}}
    draining_too: bool = False  # answers while the server drains (health); other routes then get 503
    keyless: bool = False  # no API key asked and no unit of a key's limits taken (health, the viewer's files)
    handler: str = ""  # the name of the API class's method that answers it (filled in by Api.declarations)


def route(method: str, path: str, summary: str, **flags: Any) -> Callable[[Handler], Handler]:
    """Declare the decorated method as the handler of `method path` (the other fields of Route as keywords).  A
    handler may carry several declarations (the same answer at two paths, or GET and POST)."""
    declared = Route(method.upper(), path, summary, **flags)

    def mark(fn: Handler) -> Handler:
        # decorators apply from the bottom up: put this one first so the declarations read in source order
        marked = cast(Any, fn)  # a function object takes attributes
        marked.__routes__ = (declared, *getattr(fn, "__routes__", ()))
        return fn

    return mark


class Api:
    """A group of routes: its handlers are methods marked with @route.  `prefix` goes before every declared path
    (a subclass serves the same routes under another base)."""

    prefix = ""

    def __init__(self, front: Front):
        self.front = front

    @classmethod
    def declarations(cls) -> list[Route]:
        """Every route of this API in the order its class (base classes first) declares them."""
        found: dict[str, tuple[Route, ...]] = {}
        for klass in reversed(cls.__mro__):
            for name, fn in vars(klass).items():
                if hasattr(fn, "__routes__"):
                    found[name] = fn.__routes__  # an override that declares again replaces the base's routes
        return [dataclasses.replace(r, path=cls.prefix + r.path, handler=name)
                for name, routes in found.items() for r in routes]

    def routes(self) -> list[StarletteRoute]:
        """The Starlette routes: each handler wrapped by Front.route (errors, draining, in-flight count, metrics)."""
        return [self.front.route(r.path, getattr(self, r.handler), (r.method,), openai=r.openai,
                                 draining_too=r.draining_too) for r in self.declarations()]
