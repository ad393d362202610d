"""posenc.v1 as JSON under /v1/posenc/...: bodies are the proto messages' JSON form (google.protobuf.json_format,
field names as in the .proto; bytes fields base64, little-endian float32 as over gRPC), so both transports have
one schema.  Each route parses into the posenc.v1 request message and calls service.servicer.PosencApi, the
translation the gRPC servicer calls.  Generate streams JSON lines, or server-sent events for
`Accept: text/event-stream`."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from google.protobuf import json_format
from google.protobuf.message import Message
from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import Response

from protos.posenc.v1 import posenc_pb2 as pb
from service.http.errors import HttpError, body_of, status_of, validated
from service.http.front import EventStream, Front, json_response, start_stream
from service.http.proto_models import model_for
from service.http.routing import Api, route


def to_json(message: Message) -> dict[str, Any]:
    doc: dict[str, Any] = json_format.MessageToDict(message, preserving_proto_field_name=True,
                                                    always_print_fields_with_no_presence=True)
    return doc


async def parse(front: Front, request: Request, message: Message) -> Message:
    """The body as the request message (off the event loop when it is big: Front.parsed)."""

    def to_message(doc: dict[str, Any]) -> Message:
        validated(model_for(message.DESCRIPTOR), doc)  # a bad field: 400 naming it
        try:
            return json_format.ParseDict(doc, message)
        except (json_format.ParseError, ValueError, TypeError, RecursionError) as err:
            raise HttpError(400, f"not a valid {message.DESCRIPTOR.full_name}: {err}") from None

    return await front.parsed(request, to_message)


def json_model(message: type[Message]) -> type[BaseModel]:
    """The pydantic model of a posenc.v1 message in its proto3 JSON form (the document's schema)."""
    return model_for(message.DESCRIPTOR)


class PosencJson(Api):
    """posenc.v1's calls as JSON: each parses its request message and calls PosencApi, as the gRPC servicer does."""

    def __init__(self, front: Front):
        super().__init__(front)
        self.api = front.posenc

    async def unary(self, request: Request, message: Message, call: Callable[..., Message],
                    takes_deadline: bool = True) -> Response:
        message = await parse(self.front, request, message)
        args = (message, self.front.deadline(request)) if takes_deadline else (message,)
        # the answer's JSON is built in the thread too: attention maps as JSON can be megabytes
        return await self.front.call(lambda: json_response(to_json(call(*args))))

    @route("GET", "/v1/posenc/models", "the served models", response=json_model(pb.ListModelsResponse))
    @route("POST", "/v1/posenc/models", "the served models", request=json_model(pb.ListModelsRequest),
           response=json_model(pb.ListModelsResponse))
    async def models(self, request: Request) -> Response:
        if request.method == "GET":
            return json_response(to_json(self.api.list_models(pb.ListModelsRequest())))
        return await self.unary(request, pb.ListModelsRequest(), self.api.list_models, takes_deadline=False)

    @route("POST", "/v1/posenc/predict", "top next tokens and attention maps", request=json_model(pb.PredictRequest),
           response=json_model(pb.PredictResponse))
    async def predict(self, request: Request) -> Response:
        return await self.unary(request, pb.PredictRequest(), self.api.predict)

    @route("POST", "/v1/posenc/score", "log-probability of a text", request=json_model(pb.ScoreRequest),
           response=json_model(pb.ScoreResponse))
    async def score(self, request: Request) -> Response:
        return await self.unary(request, pb.ScoreRequest(), self.api.score)

    @route("POST", "/v1/posenc/profile", "attention mass by distance per layer and head, reduced in the graph",
           request=json_model(pb.ProfileRequest), response=json_model(pb.ProfileResponse))
    async def profile(self, request: Request) -> Response:
        return await self.unary(request, pb.ProfileRequest(), self.api.profile)

    @route("POST", "/v1/posenc/compare", "one prompt through several models, and the same tokens permuted",
           request=json_model(pb.CompareRequest), response=json_model(pb.CompareResponse))
    async def compare(self, request: Request) -> Response:
        return await self.unary(request, pb.CompareRequest(), self.api.compare)

    @route("POST", "/v1/posenc/encoding", "a model's positional encoding, from its encoding graph",
           request=json_model(pb.EncodingRequest), response=json_model(pb.EncodingResponse))
    async def encoding(self, request: Request) -> Response:
        return await self.unary(request, pb.EncodingRequest(), self.api.encoding, takes_deadline=False)

    @route("POST", "/v1/posenc/tokenize", "a text in a model's tokens", request=json_model(pb.TokenizeRequest),
           response=json_model(pb.TokenizeResponse))
    async def tokenize(self, request: Request) -> Response:
        return await self.unary(request, pb.TokenizeRequest(), self.api.tokenize, takes_deadline=False)

    @route("POST", "/v1/posenc/generate",
           "a continuation: one JSON line per token (server-sent events for Accept: text/event-stream)",
           request=json_model(pb.GenerateRequest), response=json_model(pb.GenerateResponse))
    async def generate(self, request: Request) -> Response:
        front, api = self.front, self.api
        message = await parse(front, request, pb.GenerateRequest())
        deadline = front.deadline(request)
        sse = "text/event-stream" in request.headers.get("accept", "")
        iterator, first, holder = await start_stream(front, lambda active: api.generate(message, deadline, active))
        if sse:
            def encode(item: Message) -> str:
                return f"data: {json.dumps(to_json(item), separators=(',', ':'))}\n\n"
        else:
            def encode(item: Message) -> str:
                return json.dumps(to_json(item), separators=(",", ":")) + "\n"

        def on_error(exc: BaseException) -> str:
            status, text = status_of(exc, "POST /v1/posenc/generate")
            return encode_error(body_of(status, text) | {"status": status}, sse)

        stream = EventStream(iterator, first, encode, "text/event-stream" if sse else "application/x-ndjson", on_error)
        holder.append(stream)
        return stream


def encode_error(doc: dict[str, Any], sse: bool) -> str:
    text = json.dumps(doc, separators=(",", ":"))
    return f"event: error\ndata: {text}\n\n" if sse else text + "\n"
