"""GET /openapi.json: an OpenAPI 3.1 document of every HTTP route, built from the routes' declarations
(service.http.routing.Route: each handler's @route) and the pydantic models they parse and answer with (KServe v2
REST, OpenAI completions and chat, posenc.v1 as JSON), so the document and the code cannot disagree."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, Field
from pydantic.json_schema import models_json_schema
from starlette.requests import Request
from starlette.responses import Response

from service.http.front import Front, json_response
from service.http.routing import Api, Route, route

REF = "#/components/schemas/{model}"


class Error(BaseModel):
    """KServe v2 REST and posenc JSON errors."""

    error: str = Field(description="what to change; a 500 carries a request id that is in the server log")


class OpenAIErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = Field(None, description="the request field at fault")
    code: int | None = None


class OpenAIError(BaseModel):
    """Errors on the OpenAI routes, in the shape the openai SDK reads."""

    error: OpenAIErrorDetail


def document(routes: list[Route]) -> dict[str, Any]:
    """The document of these routes (service.http.app.own_spec: every route the app serves), in their order."""
    models = {m for r in routes for m in (r.request, r.response, *r.streamed) if isinstance(m, type)}
    models |= {Error, OpenAIError}
    keyed: list[tuple[type[BaseModel], Literal["validation", "serialization"]]] = [
        (m, "validation") for m in sorted(models, key=lambda m: m.__name__)]
    refs, defs = models_json_schema(keyed, ref_template=REF)
    ref = {m: refs[(m, "validation")] for m in models}
    paths: dict[str, dict[str, Any]] = {}
    for r in routes:
        op: dict[str, Any] = {"summary": r.summary, "operationId": _operation_id(r.method, r.path), "responses": {}}
        params = re.findall(r"{(\w+)}", r.path)
        if params:
            op["parameters"] = [{"name": p, "in": "path", "required": True, "schema": {"type": "string"}}
                                for p in params]
        if r.request is not None:
            op["requestBody"] = {"required": True, "content": {"application/json": {"schema": ref[r.request]}}}
        ok: dict[str, Any] = {"description": "success"}
        if isinstance(r.response, type):
            ok["content"] = {"application/json": {"schema": ref[r.response]}}
        elif isinstance(r.response, str):  # a static file: its media type
            ok["content"] = {r.response: {}}
        op["responses"]["200"] = ok
        error = ref[OpenAIError if r.openai else Error]
        op["responses"]["default"] = {"description": "an error: the status says which (docs/errors.md)",
                                      "content": {"application/json": {"schema": error}}}
        paths.setdefault(r.path, {})[r.method.lower()] = op
    return {"openapi": "3.1.0",
            "info": {"title": "posenc worker HTTP API", "version": "1",
                     "description": "KServe v2 REST (Open Inference Protocol), OpenAI-compatible completions and chat, "
                                    "posenc.v1 as JSON, and the viewer. The same models and limits as gRPC."},
            "paths": paths, "components": {"schemas": defs.get("$defs", {})}}


def _operation_id(method: str, path: str) -> str:
    return method.lower() + re.sub(r"[^A-Za-z0-9]+", "_", path).rstrip("_")


class Reference(Api):
    """GET /openapi.json: the document of the app's routes, built once when the app is."""

    def __init__(self, front: Front, routes: list[Route]):
        super().__init__(front)
        self.document = document(routes)

    @route("GET", "/openapi.json", "this document (OpenAPI 3.1)", response="application/json")
    async def openapi_json(self, request: Request) -> Response:
        return json_response(self.document)
