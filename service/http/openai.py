"""OpenAI-compatible legacy completions: GET /v1/models, POST /v1/completions (JSON or server-sent events).

posenc's models are base language models: /v1/chat/completions answers 404 saying so.  A completion is posenc.v1
Generate (service.operations.generate, the same SamplingParams) cut before the first stop string.  Everything a
completion reports is computed once, in the decode loop: each token's log-probability and top candidates come from
the logits the loop samples from, the echoed prompt's from the prefill it runs anyway; a list of prompts enters
the loop together.  Text is the tokenizer's decode of prompt + completion less the prompt's (service.tokenizer's
Detokenizer); the echo of token ids is their decode with special tokens kept (as vLLM and OpenAI echo them).
logprobs.tokens are each token's text there (`bytes:\\xNN` for part of a character), text_offset where it starts
in the returned text (Offsets), and top_logprobs one entry per text, the highest log-probability of the tokens that
write it.  Every parameter is checked before the first byte of a stream; errors use OpenAI's shape
{"error": {"message", "type", "param", "code"}}, param = the HTTP field."""

from __future__ import annotations

import codecs
import json
import time
import uuid
from collections.abc import Iterable, Iterator
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.requests import Request

from service.decoder import Emitted, Generation
from service.http.errors import HttpError, bad_field, body_of, status_of
from service.http.front import EventStream, Front, json_response, start_stream
from service.sampling import SamplingParams
from service.tokenizer import Detokenizer

REASONS = {"stop": "stop", "length": "length", "max_positions": "length"}
NAMES = {"max_new_tokens": "max_tokens"}  # posenc.v1's field names where OpenAI's API has its own


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    include_usage: bool = False


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
    n: int = Field(1, ge=1, le=1, description="only 1")
    best_of: int | None = Field(None, ge=1, le=1, description="only 1")
    presence_penalty: float = Field(0.0, ge=0, le=0, description="only 0")
    frequency_penalty: float = Field(0.0, ge=0, le=0, description="only 0")
    logit_bias: dict[str, float] | None = Field(None, max_length=0, description="not supported")
    suffix: str | None = Field(None, max_length=0, description="not supported")
    user: str | None = None


class Logprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class Choice(BaseModel):
    index: int
    text: str
    logprobs: Logprobs | None = None
    finish_reason: Literal["stop", "length"] | None = None


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionResponse(BaseModel):
    """A completion, and each chunk of a streamed one (its choices carry the new text only)."""

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


def parse(doc: dict, most: int) -> tuple[CompletionRequest, list[tuple[str | None, list[int] | None]],
                                        SamplingParams]:
    """The request, its prompts and its SamplingParams; `most` is the server's --max-new-tokens, what max_tokens:
    null asks for (the model's position limit ends a generation sooner, as finish_reason "length")."""
    try:
        req = CompletionRequest.model_validate(doc)
    except ValidationError as err:
        first = err.errors()[0]
        field = str(first["loc"][0]) if first["loc"] else None
        if field == "prompt":
            raise bad_field("prompt", "must be a string, a list of strings, a list of token ids or a list of such "
                                      "lists (non-empty)") from None
        shown = json.dumps(first.get("input"), default=str)[:40]
        raise bad_field(field, f"{first['msg']} (got {shown})") from None
    p = req.prompt
    if isinstance(p, str):
        prompts = [(p, None)]
    elif p and all(isinstance(x, str) for x in p):
        prompts = [(x, None) for x in p]
    elif p and all(isinstance(x, int) for x in p):
        prompts = [(None, list(p))]
    elif p and all(isinstance(x, list) and x for x in p):
        prompts = [(None, list(x)) for x in p]
    else:
        raise bad_field("prompt", "must be a string, a list of strings, a list of token ids or a list of such "
                                  "lists (non-empty)")
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    params = SamplingParams(max_new_tokens=most if req.max_tokens is None else req.max_tokens,
                            temperature=float(req.temperature), top_k=max(req.top_k, 0), top_p=float(req.top_p),
                            seed=req.seed,
                            stop=tuple(s for s in stop if s), logprobs=req.logprobs or 0,
                            prompt_logprobs=req.echo and req.logprobs is not None, ignore_eos=req.ignore_eos)
    if len(stop) > len(params.stop):
        raise bad_field("stop", "must not hold an empty string")
    return req, prompts, params


def top_texts(top: Iterable[tuple[str, float]]) -> dict[str, float]:
    """Top candidates as OpenAI's top_logprobs map them: one entry per text, the highest log-probability among the
    tokens that write it (`<0x33>` and `3` both write "3"), as vLLM keeps it; so the greedy token's text is the
    map's most likely key (lm-evaluation-harness's is_greedy check)."""
    out: dict[str, float] = {}
    for text, logprob in top:
        if text not in out or logprob > out[text]:
            out[text] = logprob
    return out


def _utf8(raw: bytes) -> tuple[int, bytes]:
    """(the characters UTF-8 makes of these bytes so far, each byte that cannot start one counted as one; the
    bytes of a character not yet whole at the end)."""
    dec = codecs.getincrementaldecoder("utf-8")("replace")
    return len(dec.decode(raw)), dec.getstate()[0]


class Offsets:
    """text_offset, given as each token comes: where the token's text starts in the text a Detokenizer lets out.
    A token's text may come out after it (the bytes of a character not yet whole, a byte-fallback run held until
    it ends), so the bytes of the tokens still held back are kept here: a token whose text is not out yet gets the
    offset where its first byte's character starts (a `bytes:` piece: the start of the character it is part of),
    counting the held bytes before it as UTF-8 characters; a token that lets out text ending in its own text, the
    offset of that text; a token with no text (a special token the text skips) the offset where it sits."""

    def __init__(self, tokenizer, silent: frozenset[int] = frozenset()):
        self.raw, self.silent = tokenizer.token_bytes, silent
        self.held = b""  # the bytes of the tokens whose text has not come out yet

    def place(self, token: int, end: int, delta: str, piece: str) -> int:
        """The offset of `token`, which let out `delta` (the text is `end` characters long with it) and which
        logprobs write as `piece`."""
        raw = b"" if token in self.silent else self.raw(token)
        before = end - len(delta) + _utf8(self.held)[0]  # where the held bytes' text goes on
        if not raw:
            return before
        if delta and delta.endswith(piece) and not piece.startswith("bytes:"):
            at = end - len(piece)
        else:
            at = before
        if delta or piece == delta:  # text came out (a piece that adds nothing is out too): only the bytes of an
            self.held = _utf8(self.held + raw)[1]  # unfinished character stay held
        else:
            self.held += raw
        return at


def _keeping_special(tokenizer) -> Detokenizer:
    """The echo of token ids as it is returned: the tokenizer's decode with special tokens kept (<s> is text)."""
    return Detokenizer(tokenizer.decode, tokenizer.token_bytes, (), getattr(tokenizer, "byte_pieces", frozenset()))


class Completion:
    """One prompt's choice as it is built: text, log-probabilities, finish reason."""

    def __init__(self, index: int, req: CompletionRequest, sent: str | None, gen: Generation, tokenizer):
        self.index, self.req, self.gen = index, req, gen
        self.echo = (sent if sent is not None else tokenizer.decode(gen.prompt)) if req.echo else ""
        self.shown = ""  # the completion's text sent so far (cut at a stop string)
        self.finish: str | None = None
        self.generated = 0
        special = getattr(tokenizer, "special", frozenset())  # not text in a completion (skip_special_tokens)
        self.offsets = Offsets(tokenizer, special)
        self.lp = {key: [] for key in Logprobs.model_fields} if req.logprobs is not None else None
        self.echo_lp = None
        if req.echo and self.lp is not None:
            self.echo_lp = self.prompt_logprobs(tokenizer.detokenizer() if sent is not None else
                                                _keeping_special(tokenizer),
                                                Offsets(tokenizer, special if sent is not None else frozenset()))

    def prompt_logprobs(self, detok: Detokenizer, offsets: Offsets) -> Logprobs:
        """The prompt's tokens as the echoed text holds them, scored by the prefill (the first has no prefix).  A
        string is echoed as sent: a special token its tokenizer adds (a BOS) is no text there, and sits where the
        text after it starts; token ids are echoed as their decode with special tokens kept."""
        out = Logprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
        end = 0
        for token, (logprob, top) in zip(self.gen.prompt, self.gen.prompt_logprobs, strict=True):
            out.top_logprobs.append(None if logprob is None else top_texts((detok.peek(t), lp) for t, lp in top))
            out.token_logprobs.append(logprob)
            delta, piece = detok.push(token)
            end += len(delta)
            out.tokens.append(piece)
            out.text_offset.append(offsets.place(token, end, delta, piece))
        return out

    def visible(self, text: str, final: bool) -> str:
        """The text a client may see: cut at a stop string; mid-stream, without a tail that may yet become one."""
        stops = self.gen.params.stop
        cuts = [text.find(s) for s in stops if s in text]
        if cuts:
            return text[:min(cuts)]
        if not final:
            for s in stops:
                for k in range(min(len(s) - 1, len(text)), 0, -1):
                    if text.endswith(s[:k]):
                        return text[:-k]
        return text

    def take(self, item: Emitted) -> tuple[str, dict | None]:
        """One token: (the new visible text, its log-probabilities as OpenAI's logprobs object, when asked)."""
        self.generated += 1
        shown = self.visible(item.text, bool(item.reason))
        delta = shown[len(self.shown):] if shown.startswith(self.shown) else ""
        self.shown = shown if shown.startswith(self.shown) else self.shown
        if item.reason:
            self.finish = REASONS.get(item.reason, "length")
        if self.lp is None:
            return delta, None
        eos = item.reason == "stop" and item.id in self.gen.eos and not self.gen.params.ignore_eos
        # the end of sequence sits after all the text
        start = len(item.text) if eos else self.offsets.place(item.id, len(item.text), item.delta, item.piece)
        one = {"tokens": [item.piece], "token_logprobs": [item.logprob], "top_logprobs": [top_texts(item.top)],
               "text_offset": [len(self.echo) + start]}
        for key, value in one.items():
            self.lp[key] += value
        return delta, one

    def choice(self) -> Choice:
        lp = None
        if self.lp is not None:
            lp = Logprobs(**self.lp) if self.echo_lp is None else Logprobs(
                **{k: getattr(self.echo_lp, k) + self.lp[k] for k in Logprobs.model_fields})
        return Choice(index=self.index, text=self.echo + self.shown, logprobs=lp, finish_reason=self.finish or "length")


def routes(front: Front) -> list:
    created = int(time.time())

    def header(req: CompletionRequest) -> dict:
        return {"id": f"cmpl-{uuid.uuid4().hex[:24]}", "created": int(time.time()), "model": req.model}

    def usage(choices: list[Completion]) -> Usage:
        prompt = sum(len(c.gen.prompt) for c in choices)
        done = sum(c.generated for c in choices)
        return Usage(prompt_tokens=prompt, completion_tokens=done, total_tokens=prompt + done)

    def events(req, prompts, params, deadline, is_active) -> Iterator[tuple[Completion, str, dict | None]]:
        """(choice, new text, its log-probabilities) as the decode loop hands out tokens; the echo first."""
        tokenizer = None
        choices: dict[int, Completion] = {}
        for index, item in front.ops.generate(req.model, prompts, params, deadline, is_active, names=NAMES,
                                              allow_zero_tokens=True):
            if isinstance(item, Generation):
                tokenizer = tokenizer or front.registry.get(req.model).tokenizer
                c = choices[index] = Completion(index, req, prompts[index][0], item, tokenizer)
                if params.max_new_tokens == 0:
                    c.finish = "length"
                yield c, c.echo, None if c.echo_lp is None else c.echo_lp.model_dump()
            else:
                c = choices[index]
                yield c, *c.take(item)

    def complete(req, prompts, params, deadline) -> dict:
        choices: dict[int, Completion] = {}
        for c, _, _ in events(req, prompts, params, deadline, lambda: True):
            choices[c.index] = c
        ordered = [choices[i] for i in sorted(choices)]
        out = CompletionResponse(**header(req), choices=[c.choice() for c in ordered], usage=usage(ordered))
        return out.model_dump(mode="json")

    def chunks(req, prompts, params, deadline, is_active, seen: dict) -> Iterator[dict]:
        base = header(req) | {"object": "text_completion"}
        for c, text, lp in events(req, prompts, params, deadline, is_active):
            seen[c.index] = c
            if text or lp is not None:
                yield base | {"choices": [{"index": c.index, "text": text, "finish_reason": None,
                                           "logprobs": lp}]}
            if c.finish:
                yield base | {"choices": [{"index": c.index, "text": "", "logprobs": None,
                                           "finish_reason": c.finish}]}
        if req.stream_options is not None and req.stream_options.include_usage:
            yield base | {"choices": [], "usage": usage(list(seen.values())).model_dump()}

    async def completions(request: Request):
        req, prompts, params = parse(await front.json(request), front.limits.max_new_tokens)
        deadline = front.deadline(request)
        if not req.stream:
            return json_response(await front.call(complete, req, prompts, params, deadline))
        seen: dict[int, Completion] = {}  # the choices so far: their streams say whether a token is waiting
        iterator, first, holder = await start_stream(front, lambda active: chunks(req, prompts, params, deadline,
                                                                                  active, seen))

        def encode(item) -> str:
            return f"data: {json.dumps(item, separators=(',', ':'))}\n\n"

        def on_error(exc: BaseException) -> str:
            status, message = status_of(exc, "POST /v1/completions")
            return encode(body_of(status, message, openai=True, param=getattr(exc, "param", None)))

        def ready() -> bool:
            return any(c.gen.out.qsize() for c in list(seen.values()))

        stream = EventStream(iterator, first, encode, "text/event-stream", on_error, tail="data: [DONE]\n\n",
                             ready=ready)
        holder.append(stream)
        return stream

    def card(name: str) -> dict:
        m = front.registry.get(name)  # 404 for an unknown model
        limit = front.ops.position_limit(m)
        return ModelCard(id=name, created=created, max_model_len=limit).model_dump()

    async def models(request: Request):
        return json_response(ModelList(data=[card(n) for n in sorted(front.registry.models)]).model_dump())

    async def model(request: Request):
        return json_response(card(request.path_params["name"]))

    async def chat(request: Request):
        raise HttpError(404, "posenc serves base language models, not chat models: there is no "
                             "/v1/chat/completions; send a prompt to /v1/completions")

    return [front.route("/v1/models", models, openai=True),
            front.route("/v1/models/{name}", model, openai=True),
            front.route("/v1/completions", completions, ("POST",), openai=True),
            front.route("/v1/chat/completions", chat, ("POST",), openai=True)]

