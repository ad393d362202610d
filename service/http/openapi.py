"""GET /openapi.json: an OpenAPI 3.1 document of every HTTP route, built from the pydantic models the routes parse
and answer with (KServe v2 REST, OpenAI completions and chat, posenc.v1 as JSON), so the document and the code cannot
disagree.  Each front module lists its routes as SPEC rows: (method, path, request model, response model, summary)."""

from __future__ import annotations

import re
from typing import Any

from pydantic import BaseModel, Field
from pydantic.json_schema import models_json_schema

from service.http import chat, kserve_rest, openai, posenc_json

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


# The OpenAI routes, with the request and response models service.http.openai and .chat parse and answer with
OPENAI = [("GET", "/v1/models", None, openai.ModelList, "the served models, OpenAI's list"),
          ("GET", "/v1/models/{name}", None, openai.ModelCard, "one served model"),
          ("POST", "/v1/completions", openai.CompletionRequest, openai.CompletionResponse,
           "a completion (stream: true sends server-sent events of chunks, each a CompletionResponse)"),
          *chat.SPEC]
# Models a route answers with that no row names: the chunks of a streamed chat completion
STREAMED = (chat.ChatCompletionChunk,)


def rows(extra: list[tuple] = ()) -> list[tuple]:
    """Every documented route: (method, path, request model, response model, summary)."""
    return [*kserve_rest.SPEC, *OPENAI, *posenc_json.SPEC, *extra]


def document(extra: list[tuple] = ()) -> dict[str, Any]:
    table = rows(extra)
    models = {m for _, _, req, resp, _ in table for m in (req, resp) if isinstance(m, type)} | {Error, OpenAIError,
                                                                                                  *STREAMED}
    keyed = [(m, "validation") for m in sorted(models, key=lambda m: m.__name__)]
    refs, defs = models_json_schema(keyed, ref_template=REF)
    ref = {m: refs[(m, "validation")] for m in models}
    paths: dict[str, dict] = {}
    for method, path, req, resp, summary in table:
        is_openai = path.startswith("/v1/") and not path.startswith("/v1/posenc/")
        op: dict[str, Any] = {"summary": summary, "operationId": _operation_id(method, path), "responses": {}}
        params = re.findall(r"{(\w+)}", path)
        if params:
            op["parameters"] = [{"name": p, "in": "path", "required": True, "schema": {"type": "string"}}
                                for p in params]
        if req is not None:
            op["requestBody"] = {"required": True, "content": {"application/json": {"schema": ref[req]}}}
        ok: dict[str, Any] = {"description": "success"}
        if isinstance(resp, type):
            ok["content"] = {"application/json": {"schema": ref[resp]}}
        elif isinstance(resp, str):  # a static file: its media type
            ok["content"] = {resp: {}}
        op["responses"]["200"] = ok
        error = ref[OpenAIError if is_openai else Error]
        op["responses"]["default"] = {"description": "an error: the status says which (docs/errors.md)",
                                      "content": {"application/json": {"schema": error}}}
        paths.setdefault(path, {})[method.lower()] = op
    return {"openapi": "3.1.0",
            "info": {"title": "posenc worker HTTP API", "version": "1",
                     "description": "KServe v2 REST (Open Inference Protocol), OpenAI-compatible completions and chat, "
                                    "posenc.v1 as JSON, and the viewer. The same models and limits as gRPC."},
            "paths": paths, "components": {"schemas": defs.get("$defs", {})}}


def _operation_id(method: str, path: str) -> str:
    return method.lower() + re.sub(r"[^A-Za-z0-9]+", "_", path).rstrip("_")
