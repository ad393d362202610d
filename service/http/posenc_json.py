"""posenc.v1 as JSON under /v1/posenc/...: bodies are the proto messages' JSON form (google.protobuf.json_format,
field names as in the .proto; bytes fields base64, little-endian float32 as over gRPC), so both transports have
one schema.  Each route parses into the posenc.v1 request message and calls service.servicer.PosencApi, the
translation the gRPC servicer calls.  Generate streams JSON lines, or server-sent events for
`Accept: text/event-stream`."""

from __future__ import annotations

import json

from google.protobuf import json_format
from google.protobuf.message import Message
from starlette.requests import Request

from protos.posenc.v1 import posenc_pb2 as pb
from service.http.errors import HttpError, body_of, status_of, validated
from service.http.front import EventStream, Front, json_response, start_stream
from service.http.proto_models import model_for


def to_json(message: Message) -> dict:
    return json_format.MessageToDict(message, preserving_proto_field_name=True,
                                     always_print_fields_with_no_presence=True)


async def parse(front: Front, request: Request, message: Message) -> Message:
    """The body as the request message (off the event loop when it is big: Front.parsed)."""

    def to_message(doc: dict) -> Message:
        validated(model_for(message.DESCRIPTOR), doc)  # a bad field: 400 naming it
        try:
            return json_format.ParseDict(doc, message)
        except (json_format.ParseError, ValueError, TypeError, RecursionError) as err:
            raise HttpError(400, f"not a valid {message.DESCRIPTOR.full_name}: {err}") from None

    return await front.parsed(request, to_message)


def routes(front: Front) -> list:
    api = front.posenc

    def unary(make, call, takes_deadline: bool = True):
        async def handler(request: Request):
            message = await parse(front, request, make())
            args = (message, front.deadline(request)) if takes_deadline else (message,)
            # the answer's JSON is built in the thread too: attention maps as JSON can be megabytes
            return await front.call(lambda: json_response(to_json(call(*args))))

        return handler

    async def models(request: Request):
        return json_response(to_json(api.list_models(pb.ListModelsRequest())))

    async def generate(request: Request):
        message = await parse(front, request, pb.GenerateRequest())
        deadline = front.deadline(request)
        sse = "text/event-stream" in request.headers.get("accept", "")
        iterator, first, holder = await start_stream(front, lambda active: api.generate(message, deadline, active))
        if sse:
            def encode(item):
                return f"data: {json.dumps(to_json(item), separators=(',', ':'))}\n\n"
        else:
            def encode(item):
                return json.dumps(to_json(item), separators=(",", ":")) + "\n"

        def on_error(exc: BaseException) -> str:
            status, text = status_of(exc, "POST /v1/posenc/generate")
            return encode_error(body_of(status, text) | {"status": status}, sse)

        stream = EventStream(iterator, first, encode, "text/event-stream" if sse else "application/x-ndjson", on_error)
        holder.append(stream)
        return stream

    return [
        front.route("/v1/posenc/models", models),
        front.route("/v1/posenc/models", unary(pb.ListModelsRequest, lambda m: api.list_models(m), False),
                    ("POST",)),
        front.route("/v1/posenc/predict", unary(pb.PredictRequest, api.predict), ("POST",)),
        front.route("/v1/posenc/score", unary(pb.ScoreRequest, api.score), ("POST",)),
        front.route("/v1/posenc/compare", unary(pb.CompareRequest, api.compare), ("POST",)),
        front.route("/v1/posenc/encoding", unary(pb.EncodingRequest, api.encoding, False), ("POST",)),
        front.route("/v1/posenc/tokenize", unary(pb.TokenizeRequest, api.tokenize, False), ("POST",)),
        front.route("/v1/posenc/generate", generate, ("POST",)),
    ]


# (method, path, request message, response message, summary) of every route above, for GET /openapi.json
SPEC = [("GET", "/v1/posenc/models", None, pb.ListModelsResponse, "the served models"),
        ("POST", "/v1/posenc/models", pb.ListModelsRequest, pb.ListModelsResponse, "the served models"),
        ("POST", "/v1/posenc/predict", pb.PredictRequest, pb.PredictResponse,
         "top next tokens and attention maps"),
        ("POST", "/v1/posenc/score", pb.ScoreRequest, pb.ScoreResponse, "log-probability of a text"),
        ("POST", "/v1/posenc/compare", pb.CompareRequest, pb.CompareResponse,
         "one prompt through several models, and the same tokens permuted"),
        ("POST", "/v1/posenc/encoding", pb.EncodingRequest, pb.EncodingResponse,
         "a model's positional encoding, from its encoding graph"),
        ("POST", "/v1/posenc/tokenize", pb.TokenizeRequest, pb.TokenizeResponse, "a text in a model's tokens"),
        ("POST", "/v1/posenc/generate", pb.GenerateRequest, pb.GenerateResponse,
         "a continuation: one JSON line per token (server-sent events for Accept: text/event-stream)")]
SPEC = [(method, path, model_for(req.DESCRIPTOR) if req else None, model_for(resp.DESCRIPTOR), summary)
        for method, path, req, resp, summary in SPEC]


def encode_error(doc: dict, sse: bool) -> str:
    text = json.dumps(doc, separators=(",", ":"))
    return f"event: error\ndata: {text}\n\n" if sse else text + "\n"
