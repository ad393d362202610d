"""HTTP statuses for the worker's errors: one table, the HTTP twin of the gRPC codes (ARCHITECTURE.md section 6).

Bodies are {"error": "message"} (KServe v2 REST and posenc JSON) or, on the OpenAI routes, the OpenAI shape
{"error": {"message", "type", "param", "code"}} that the openai SDK reads."""

from __future__ import annotations

import json
import logging
import uuid
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from service.errors import (
    Cancelled,
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    ServiceError,
    TooLarge,
    Unavailable,
)

log = logging.getLogger(__name__)

STATUS: dict[type[ServiceError], int] = {  # the first class that matches wins: subclasses first
    InvalidArgument: 400,
    TooLarge: 413,  # the answer would pass the message limit: ask for less
    NotFound: 404,
    FailedPrecondition: 422,  # the request is fine, the artifact cannot answer it (MLServer's mapping)
    ResourceExhausted: 429,  # queue full, too many streams
    Cancelled: 499,  # the client went away (nobody reads this; it is for the log and the metrics)
    Unavailable: 503,
    DeadlineExceeded: 504,
}

OPENAI_TYPE = {400: "invalid_request_error", 404: "not_found_error", 413: "invalid_request_error",
               422: "invalid_request_error", 429: "rate_limit_error", 503: "server_error", 504: "timeout",
               500: "server_error"}


class HttpError(Exception):
    """An error of the HTTP layer itself: malformed JSON, a bad field, a body over the size limit, no such route."""

    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.param = status, param


def bad_field(field: str, why: str) -> HttpError:
    return HttpError(400, f"field {field!r}: {why}", param=field)


M = TypeVar("M", bound=BaseModel)
UNION_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "bytes"}


def field_name(loc: tuple[int | str, ...]) -> str:
    """A pydantic error location as the body's own path: ('inputs', 0, 'shape') -> inputs[0].shape."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def field_error(err: ValidationError) -> HttpError:
    """The first field error of a body, as 400 naming the field (OpenAI's `param`) and what it got."""
    first = err.errors(include_url=False)[0]
    # a union's error is located at the member that failed (prompt.str, prompt.list[int]): name the field itself
    loc = tuple(p for p in first["loc"] if isinstance(p, int) or not (p in UNION_TAGS or "[" in p or "-" in p))
    name = field_name(loc) or "body"
    got = json.dumps(first.get("input"), default=str)
    got = got if len(got) <= 40 else got[:37] + "..."
    return bad_field(name, f"{first['msg']} (got {got})")


def validated(model: type[M], doc: Any) -> M:
    """A JSON body as its request model; a bad field is 400 naming it (the one place bodies are checked)."""
    try:
        return model.model_validate(doc)
    except ValidationError as err:
        raise field_error(err) from None


def status_of(exc: BaseException, route: str) -> tuple[int, str]:
    """(HTTP status, message) for any exception; an unexpected one is logged with a request id (500)."""
    if isinstance(exc, ValidationError):
        exc = field_error(exc)
    if isinstance(exc, HttpError):
        return exc.status, str(exc)
    if isinstance(exc, ServiceError):
        status = next((s for cls, s in STATUS.items() if isinstance(exc, cls)), 500)
        return status, str(exc)
    if isinstance(exc, TimeoutError):
        return 504, "deadline passed before the work finished"
    request_id = uuid.uuid4().hex[:12]
    log.error("internal error in %s (request id %s)", route, request_id, exc_info=exc)
    return 500, f"internal error (request id {request_id}); see the server log"


def body_of(status: int, message: str, openai: bool = False, param: str | None = None) -> dict[str, Any]:
    if not openai:
        return {"error": message}
    return {"error": {"message": message, "type": OPENAI_TYPE.get(status, "server_error"), "param": param,
                      "code": status}}
