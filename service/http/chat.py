"""OpenAI-compatible chat: POST /v1/chat/completions (JSON or server-sent events), and vLLM's POST /v1/tokenize and
POST /v1/detokenize.

A chat completion is a completion (service.http.completion: the same SamplingParams, decode loop, stop strings,
seed, ignore_eos) of the prompt the model's own chat template writes for the messages (service.chat_template,
rendered as transformers' apply_chat_template renders it, add_generation_prompt true), tokenized without adding
special tokens.  A turn ends at the model's end-of-sequence ids (model.json's tokenizer entry:
generation_config.json's eos_token_id list, else config.json's), finish_reason "stop"; or at a stop string, or at
max_tokens ("length").  logprobs: true gives OpenAI's chat form, choices[].logprobs.content[] with each token's
text, log-probability, UTF-8 bytes and its top_logprobs candidates.  posenc's extension `intervention`
(service.http.completion.intervention_of) generates under a position intervention, positions counted over the
rendered prompt's tokens."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any, Literal, cast, get_args

from pydantic import BaseModel, ConfigDict, Field
from starlette.requests import Request
from starlette.responses import Response

from service import chat_template
from service.generation import Emitted
from service.http.completion import (
    INTERVENTION,
    NAMES,
    Completion,
    StreamOptions,
    Usage,
    coalesced,
    events,
    intervention_of,
    sampling,
    sse,
    usage,
    validated,
    wants_usage,
)
from service.http.errors import HttpError, bad_field
from service.http.front import Front, json_response
from service.http.routing import Api, route
from service.intervention import Intervention
from service.operations import MAX_LOGPROBS
from service.sampling import SamplingParams
from service.tokenizer import HFTokenizer

Role = Literal["system", "developer", "user", "assistant", "tool"]
ROLES = get_args(Role)


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal["text"] = Field(description="only text parts")
    text: str


class Message(BaseModel):
    """One message; keys beyond these (tool_call_id, tool_calls, ...) reach the template as they are."""

    model_config = ConfigDict(extra="allow", strict=True)
    role: Role = Field(description=" | ".join(ROLES))
    content: str | list[TextPart] | None = Field(None, description="a string, or text parts (joined by newlines)")
    name: str | None = None


class ChatRequest(BaseModel):
    """POST /v1/chat/completions: OpenAI's fields, vLLM's top_k, ignore_eos and add_generation_prompt.  Unknown
    fields are ignored; fields posenc cannot honour are refused, naming them."""

    model_config = ConfigDict(extra="ignore", strict=True)
    model: str = Field(min_length=1, description="a served model with a chat template")
    messages: list[Message] = Field(min_length=1, description="the conversation, rendered by the model's template")
    max_tokens: int | None = Field(None, ge=0, description="tokens to generate (null: up to the server's "
                                                            "--max-new-tokens)")
    max_completion_tokens: int | None = Field(None, ge=0, description="OpenAI's newer name for max_tokens; wins")
    temperature: float = Field(1.0, ge=0, description="0 = greedy")
    top_p: float = Field(1.0, ge=0, le=1, description="nucleus in (0, 1]; 0 = the smallest nucleus: greedy")
    top_k: int = Field(-1, ge=-1, description="vLLM's: -1 or 0 = off")
    seed: int | None = Field(None, ge=0, lt=2**64)
    stop: str | list[str] | None = Field(None, description="up to the server's --max-stop-strings strings")
    logprobs: bool = Field(False, description="each generated token's log-probability")
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS,
                                     description=f"top candidates per token (needs logprobs: true), at most "
                                                 f"{MAX_LOGPROBS}")
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = Field(False, description="vLLM's: run past the end of the turn")
    min_tokens: int = Field(0, ge=0, description="vLLM's: no end of sequence before this many tokens (at most "
                                                   "max_tokens)")
    add_generation_prompt: bool = Field(True, description="vLLM's: the template opens the assistant's turn")
    n: int = Field(1, ge=1, le=1, description="only 1")
    presence_penalty: float = Field(0.0, ge=0, le=0, description="only 0")
    frequency_penalty: float = Field(0.0, ge=0, le=0, description="only 0")
    logit_bias: dict[str, float] | None = Field(None, max_length=0, description="not supported")
    tools: list[Any] | None = Field(None, max_length=0, description="not supported")
    user: str | None = None
    intervention: dict[str, Any] | None = Field(None, description=INTERVENTION)


class ChatMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class TopLogprob(BaseModel):
    token: str = Field(description="the token's text as completions' logprobs write it (bytes:\\xNN for part of a "
                                   "character)")
    logprob: float
    bytes: list[int] | None = Field(description="the token's UTF-8 bytes")


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None


class ChatChoice(BaseModel):
    index: int
    message: ChatMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length"]


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChunkChoice(BaseModel):
    index: int
    delta: Delta
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None = None


class ChatCompletionChunk(BaseModel):
    """One server-sent event of a streamed chat completion: the role first, then the content as it comes, then the
    finish reason; with stream_options.include_usage, a last chunk with no choices and the usage (every chunk
    before it carries usage: null, as OpenAI's do)."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None


class TokenizeRequest(BaseModel):
    """POST /v1/tokenize, as vLLM has it: `prompt` (add_special_tokens default true) or `messages` rendered by the
    chat template (add_generation_prompt default true, add_special_tokens default false)."""

    model_config = ConfigDict(extra="ignore", strict=True)
    model: str = Field(min_length=1)
    prompt: str | None = None
    messages: list[Message] | None = Field(None, min_length=1)
    add_special_tokens: bool | None = Field(None, description="the tokenizer's own special tokens (a BOS)")
    add_generation_prompt: bool = True
    return_token_strs: bool = Field(False, description="also each token's vocabulary string")


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int | None = Field(description="the most positions (prompt + completion) a request gets")
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    model: str = Field(min_length=1)
    tokens: list[int] = Field(description="token ids of the model's vocabulary")


class DetokenizeResponse(BaseModel):
    prompt: str = Field(description="the tokenizer's decode of the ids, special tokens kept")


def conversation(messages: list[Message]) -> list[dict[str, Any]]:
    """The messages as the template sees them: text parts joined by newlines, null keys dropped."""
    out: list[dict[str, Any]] = []
    for m in messages:
        d = m.model_dump(exclude_none=True)
        if isinstance(m.content, list):
            d["content"] = "\n".join(p.text for p in m.content)
        out.append(d)
    return out


def chat_prompt(front: Front, name: str, messages: list[Message], add_generation_prompt: bool,
                add_special_tokens: bool = False) -> list[int]:
    """The prompt's token ids: the model's template over the messages, tokenized (special tokens not added again:
    the template writes them)."""
    m = front.ops.model(name)  # 404 for an unknown model
    try:
        template = chat_template.of_model(m.meta.tokenizer)
    except ValueError as err:
        raise HttpError(400, f"model {name!r}: {err}", param="model") from None
    if template is None or not isinstance(m.tokenizer, HFTokenizer):
        raise bad_field("model", f"model {name!r} has no chat template (its Hugging Face folder had none: "
                                 "tokenizer_config.json's chat_template or chat_template.jinja); send a prompt to "
                                 "/v1/completions")
    text = template.render(conversation(messages), add_generation_prompt)
    ids: list[int] = m.tokenizer.tok.encode(text, add_special_tokens=add_special_tokens).ids
    return ids


def _bytes(token: str) -> list[int]:
    if token.startswith("bytes:"):  # part of a character: its byte as completions' logprobs write it
        return list(token[6:].encode("ascii").decode("unicode_escape").encode("latin-1"))
    return list(token.encode("utf-8"))


def token_logprob(item: Emitted) -> dict[str, Any]:
    """A choice's latest token in OpenAI's chat logprobs form."""
    top = [{"token": t, "logprob": lp, "bytes": _bytes(t)} for t, lp in item.top]
    return {"token": item.piece, "logprob": item.logprob, "bytes": _bytes(item.piece), "top_logprobs": top}


class Chat(Api):
    """OpenAI's chat completions, and vLLM's tokenize and detokenize."""

    @route("POST", "/v1/chat/completions", "a chat completion with the model's own chat template (stream: true sends "
           "server-sent events of ChatCompletionChunk)", request=ChatRequest, response=ChatCompletion,
           streamed=(ChatCompletionChunk,), openai=True)
    async def completions(self, request: Request) -> Response:
        front = self.front
        req, params, edit = await front.parsed(request, self.parse)  # validated and rendered off the loop when big
        deadline = front.deadline(request)
        if not req.stream:  # the answer runs, and its JSON is written, in a thread: never on the event loop
            return await front.call(lambda: json_response(self.complete(req, params, edit, deadline)))
        return await sse(front, "POST /v1/chat/completions",
                         lambda active, seen: self.chunks(req, params, edit, deadline, active, seen))

    @route("POST", "/v1/tokenize", "token ids of a prompt, or of messages as the chat template writes them (vLLM's)",
           request=TokenizeRequest, response=TokenizeResponse, openai=True)
    async def tokenize(self, request: Request) -> Response:
        req = await self.front.parsed(request, lambda doc: validated(TokenizeRequest, doc))
        return await self.front.call(lambda: json_response(self.tokens(req)))

    @route("POST", "/v1/detokenize", "the text of token ids (vLLM's)", request=DetokenizeRequest,
           response=DetokenizeResponse, openai=True)
    async def detokenize(self, request: Request) -> Response:
        req = await self.front.parsed(request, lambda doc: validated(DetokenizeRequest, doc))
        return await self.front.call(lambda: json_response(self.text(req)))

    def parse(self, doc: dict[str, Any]) -> tuple[ChatRequest, SamplingParams, Intervention]:
        req = validated(ChatRequest, doc)
        if req.top_logprobs is not None and not req.logprobs:
            raise bad_field("top_logprobs", "needs logprobs: true")
        most = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        params = sampling(req, self.front.limits.max_new_tokens, most,
                          logprobs=(req.top_logprobs or 0) if req.logprobs else 0, token_logprob=req.logprobs)
        return req, params, intervention_of(req.intervention)

    @staticmethod
    def header(req: ChatRequest) -> dict[str, Any]:
        return {"id": f"chatcmpl-{uuid.uuid4().hex[:24]}", "created": int(time.time()), "model": req.model}

    def run(self, req: ChatRequest, params: SamplingParams, edit: Intervention, deadline: float | None,
            is_active: Callable[[], bool]) -> Iterator[tuple[Completion, str, dict[str, Any] | None]]:
        ids = chat_prompt(self.front, req.model, req.messages, req.add_generation_prompt)
        names = NAMES | {"max_new_tokens": "max_completion_tokens" if req.max_completion_tokens is not None
                         else "max_tokens", "logprobs": "top_logprobs", "prompt": "messages"}  # messages: the prompt
        for c, text, _ in events(self.front, req.model, [(None, ids)], params, deadline, is_active, names=names,
                                 edit=edit):
            yield c, text, token_logprob(c.last) if req.logprobs and c.last is not None else None

    def complete(self, req: ChatRequest, params: SamplingParams, edit: Intervention,
                 deadline: float | None) -> dict[str, Any]:
        choices: dict[int, Completion] = {}
        content: dict[int, list[Any]] = {}  # each token's dict, which ChatLogprobs validates as a TokenLogprob
        for c, _, lp in self.run(req, params, edit, deadline, lambda: True):
            choices[c.index] = c
            if lp is not None:
                content.setdefault(c.index, []).append(lp)
        ordered = [choices[i] for i in sorted(choices)]
        out = ChatCompletion(**self.header(req), usage=usage(ordered), choices=[
            ChatChoice(index=c.index, message=ChatMessage(content=c.shown), finish_reason=c.finish or "length",
                       logprobs=ChatLogprobs(content=content.get(c.index, [])) if req.logprobs else None)
            for c in ordered])
        return out.model_dump(mode="json")

    def chunks(self, req: ChatRequest, params: SamplingParams, edit: Intervention, deadline: float | None,
               is_active: Callable[[], bool], seen: dict[int, Completion]) -> Iterator[dict[str, Any]]:
        base = self.header(req) | {"object": "chat.completion.chunk"}
        if wants_usage(req.stream_options):  # OpenAI's: every chunk has usage, null but in the last
            base["usage"] = None
        tokens = ((c, text, None if lp is None else [lp])
                  for c, text, lp in self.run(req, params, edit, deadline, is_active))
        for c, text, lps in coalesced(tokens, lambda a, b: a + b):
            seen[c.index] = c
            if c.last is None:  # the choice opens: the role first, as OpenAI's streams do
                yield base | {"choices": [{"index": c.index, "delta": {"role": "assistant", "content": ""},
                                           "logprobs": None, "finish_reason": None}]}
            elif text or lps is not None:
                yield base | {"choices": [{"index": c.index, "delta": {"content": text},
                                           "logprobs": None if lps is None else {"content": lps},
                                           "finish_reason": None}]}
            if c.finish:
                yield base | {"choices": [{"index": c.index, "delta": {}, "logprobs": None,
                                           "finish_reason": c.finish}]}
        if wants_usage(req.stream_options):
            yield base | {"choices": [], "usage": usage(seen.values()).model_dump()}

    def tokens(self, req: TokenizeRequest) -> dict[str, Any]:
        if (req.prompt is None) == (req.messages is None):
            raise bad_field("prompt" if req.prompt is None else "messages", "give either prompt or messages")
        m = self.front.ops.model(req.model)  # 404 for an unknown model
        tok, prompt = m.tokenizer, req.prompt or ""  # a prompt is given when messages are not (above)
        if req.messages is not None:
            ids = chat_prompt(self.front, req.model, req.messages, req.add_generation_prompt,
                              bool(req.add_special_tokens))
        elif req.add_special_tokens is False and isinstance(tok, HFTokenizer):
            ids = tok.tok.encode(prompt, add_special_tokens=False).ids
        else:
            ids = tok.encode(prompt)  # the tokenizer's own special tokens (byte models have none)
        strs = None
        if req.return_token_strs:  # (id_to_token is None only for an id outside the vocabulary: these are in it)
            strs = cast("list[str]", [tok.tok.id_to_token(i) if isinstance(tok, HFTokenizer) else tok.display(i)
                                      for i in ids])
        return TokenizeResponse(count=len(ids), max_model_len=self.front.ops.position_limit(m), tokens=ids,
                                token_strs=strs).model_dump(mode="json")

    def text(self, req: DetokenizeRequest) -> dict[str, Any]:
        m = self.front.ops.model(req.model)
        bad = next((t for t in req.tokens if not 0 <= t < m.vocab_size), None)
        if bad is not None:
            raise bad_field("tokens", f"{bad} is not a token id of model {req.model!r} (0 to {m.vocab_size - 1})")
        return DetokenizeResponse(prompt=m.tokenizer.decode(req.tokens)).model_dump(mode="json")
