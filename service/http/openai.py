"""OpenAI-compatible API: GET /v1/models, POST /v1/completions (JSON or server-sent events).  The chat and
tokenize routes are in service.http.chat.

A completion is posenc.v1 Generate (service.operations.generate, the same SamplingParams) cut before the first stop
string.  Everything a completion reports is computed once, in the decode loop: each token's log-probability and
top candidates come from the logits the loop samples from, the echoed prompt's from the prefill it runs anyway; a
list of prompts enters the loop together.  Text is the tokenizer's decode of prompt + completion less the prompt's
(service.tokenizer's Detokenizer); the echo of token ids is their decode with special tokens kept (as vLLM and
OpenAI echo them).  logprobs.tokens are each token's text there (`bytes:\\xNN` for part of a character),
text_offset where it starts in the returned text (service.http.completion.Offsets), and top_logprobs one entry per
text, the highest log-probability of the tokens that write it.  Every parameter is checked before the first byte
of a stream; errors use OpenAI's shape {"error": {"message", "type", "param", "code"}}, param = the HTTP field.
posenc's extension `intervention` (service.http.completion.intervention_of) generates under a position
intervention."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any, Literal, cast

from pydantic import BaseModel, ConfigDict, Field
from starlette.requests import Request
from starlette.responses import Response

from service.http.completion import (
    INTERVENTION,
    Choice,
    Completion,
    Prompts,
    StreamOptions,
    Usage,
    coalesced,
    events,
    extended,
    gathered,
    intervention_of,
    sampling,
    sse,
    usage,
    validated,
    wants_usage,
)
from service.http.errors import bad_field
from service.http.front import Front, json_response
from service.http.routing import Api, route
from service.intervention import Intervention
from service.sampling import SamplingParams

PROMPTS = "must be a string, a list of strings, a list of token ids or a list of such lists (non-empty)"


class CompletionRequest(BaseModel):
    """POST /v1/completions: OpenAI's fields, vLLM's top_k and ignore_eos.  Unknown fields are ignored (as OpenAI's
    server does with `user`); fields posenc cannot honour are refused, naming them."""

    model_config = ConfigDict(extra="ignore", strict=True)
    model: str = Field(min_length=1, description="a served model (GET /v1/models lists them)")
    prompt: str | list[str] | list[int] | list[list[int]] = Field(
        description="a string, a list of strings, a list of token ids or a list of such lists")
    max_tokens: int | None = Field(16, ge=0, description="tokens to generate per prompt (0: echo and score the "
                                                          "prompt; null: up to the server's --max-new-tokens)")
    temperature: float = Field(1.0, ge=0, description="0 = greedy")
    top_p: float = Field(1.0, ge=0, le=1, description="nucleus in (0, 1]; 0 = the smallest nucleus: greedy")
    top_k: int = Field(-1, ge=-1, description="vLLM's: -1 or 0 = off")
    seed: int | None = Field(None, ge=0, lt=2**64)
    stop: str | list[str] | None = Field(None, description="up to the server's --max-stop-strings strings")
    logprobs: int | None = Field(None, ge=0, description="top candidates per token, at most 5")
    echo: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = Field(False, description="vLLM's: run past the model's end of sequence")
    min_tokens: int = Field(0, ge=0, description="vLLM's: no end of sequence before this many tokens (at most "
                                                   "max_tokens)")
    n: int = Field(1, ge=1, le=1, description="only 1")
    best_of: int | None = Field(None, ge=1, le=1, description="only 1")
    presence_penalty: float = Field(0.0, ge=0, le=0, description="only 0")
    frequency_penalty: float = Field(0.0, ge=0, le=0, description="only 0")
    logit_bias: dict[str, float] | None = Field(None, max_length=0, description="not supported")
    suffix: str | None = Field(None, max_length=0, description="not supported")
    user: str | None = None
    intervention: dict[str, Any] | None = Field(None, description=INTERVENTION)


class CompletionResponse(BaseModel):
    """A completion, and each chunk of a streamed one (its choices carry the new text only; with
    stream_options.include_usage every chunk but the last, which has no choices, carries usage: null)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[Choice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "posenc"
    max_model_len: int | None = Field(None, description="the most positions (prompt + completion) a request gets")


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


Parsed = tuple[CompletionRequest, Prompts, SamplingParams, Intervention]


def parse(doc: dict[str, Any], most: int) -> Parsed:
    """The request, its prompts, its SamplingParams and its intervention; `most` is the server's --max-new-tokens,
    what max_tokens: null asks for (the model's position limit ends a generation sooner, as finish_reason
    "length")."""
    req = validated(CompletionRequest, doc, {"prompt": PROMPTS})
    p = req.prompt
    prompts: Prompts
    if isinstance(p, str):
        prompts = [(p, None)]
    elif p and all(isinstance(x, str) for x in p):
        prompts = [(x, None) for x in cast("list[str]", p)]
    elif p and all(isinstance(x, int) for x in p):
        prompts = [(None, list(cast("list[int]", p)))]
    elif p and all(isinstance(x, list) and x for x in p):
        prompts = [(None, list(x)) for x in cast("list[list[int]]", p)]
    else:
        raise bad_field("prompt", PROMPTS)
    params = sampling(req, most, req.max_tokens, logprobs=req.logprobs or 0,
                      prompt_logprobs=req.echo and req.logprobs is not None, token_logprob=req.logprobs is not None)
    return req, prompts, params, intervention_of(req.intervention)


class OpenAI(Api):
    """OpenAI's model list and completions (chat and tokenize: service.http.chat.Chat)."""

    def __init__(self, front: Front):
        super().__init__(front)
        self.created = int(time.time())  # the models' `created`: when this front was built

    def card(self, name: str) -> ModelCard:
        m = self.front.ops.model(name)  # 404 for an unknown model
        return ModelCard(id=name, created=self.created, max_model_len=self.front.ops.position_limit(m))

    @route("GET", "/v1/models", "the served models, OpenAI's list", response=ModelList, openai=True)
    async def models(self, request: Request) -> Response:
        return json_response(ModelList(data=[self.card(n) for n in sorted(self.front.registry.models)]).model_dump())

    @route("GET", "/v1/models/{name}", "one served model", response=ModelCard, openai=True)
    async def model(self, request: Request) -> Response:
        return json_response(self.card(request.path_params["name"]).model_dump())

    @route("POST", "/v1/completions",
           "a completion (stream: true sends server-sent events of chunks, each a CompletionResponse)",
           request=CompletionRequest, response=CompletionResponse, openai=True)
    async def completions(self, request: Request) -> Response:
        front = self.front
        parsed = await front.parsed(request, lambda doc: parse(doc, front.limits.max_new_tokens))
        deadline = front.deadline(request)
        if not parsed[0].stream:  # the answer runs, and its JSON is written, in a thread: never on the event loop
            return await front.call(lambda: json_response(self.complete(parsed, deadline)))
        return await sse(front, "POST /v1/completions",
                         lambda active, seen: self.chunks(parsed, deadline, active, seen))

    @staticmethod
    def header(req: CompletionRequest) -> dict[str, Any]:
        return {"id": f"cmpl-{uuid.uuid4().hex[:24]}", "created": int(time.time()), "model": req.model}

    def run(self, parsed: Parsed, deadline: float | None,
            is_active: Callable[[], bool]) -> Iterator[tuple[Completion, str, dict[str, Any] | None]]:
        req, prompts, params, edit = parsed
        return events(self.front, req.model, prompts, params, deadline, is_active, echo=req.echo,
                      logprobs=req.logprobs is not None, edit=edit)

    def complete(self, parsed: Parsed, deadline: float | None) -> dict[str, Any]:
        req = parsed[0]
        ordered = gathered(self.run(parsed, deadline, lambda: True))
        out = CompletionResponse(**self.header(req), choices=[c.choice() for c in ordered], usage=usage(ordered))
        return out.model_dump(mode="json")

    def chunks(self, parsed: Parsed, deadline: float | None, is_active: Callable[[], bool],
               seen: dict[int, Completion]) -> Iterator[dict[str, Any]]:
        req = parsed[0]
        base = self.header(req) | {"object": "text_completion"}
        if wants_usage(req.stream_options):  # OpenAI's: every chunk has usage, null but in the last
            base["usage"] = None
        for c, text, lp in coalesced(self.run(parsed, deadline, is_active), extended):
            seen[c.index] = c
            if text or lp is not None:
                yield base | {"choices": [{"index": c.index, "text": text, "finish_reason": None,
                                           "logprobs": lp}]}
            if c.finish:
                yield base | {"choices": [{"index": c.index, "text": "", "logprobs": None,
                                           "finish_reason": c.finish}]}
        if wants_usage(req.stream_options):
            yield base | {"choices": [], "usage": usage(seen.values()).model_dump()}
