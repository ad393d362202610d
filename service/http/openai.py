"""OpenAI-compatible legacy completions: GET /v1/models, POST /v1/completions (JSON or server-sent events).

posenc's models are base language models: /v1/chat/completions answers 404 saying so.  Generation is posenc.v1
Generate (service.operations.generate): greedy text equals Generate's text for the same prompt.  Log-probabilities
come from one forward over prompt + completion (Operations.infer); a streamed chunk's top candidates from Predict
on its prefix.  Errors use OpenAI's shape {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
from starlette.requests import Request

from service.http.errors import HttpError, bad_field, body_of, status_of
from service.http.front import EventStream, Front, json_response, start_stream
from service.sampling import log_softmax

MAX_LOGPROBS = 5  # the API's cap on `logprobs`
REASONS = {"stop": "stop", "length": "length", "max_positions": "length"}


def _number(doc: dict, key: str, default, lo: float | None = None, integer: bool = False):
    value = doc.get(key)
    if value is None:
        return default
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds):
        raise bad_field(key, f"must be {'an integer' if integer else 'a number'}, got {json.dumps(value)[:40]}")
    if lo is not None and value < lo:
        raise bad_field(key, f"must be >= {lo}, got {value}")
    return value


@dataclass
class Params:
    model: str
    prompts: list[tuple[str | None, list[int] | None]]
    max_tokens: int
    temperature: float
    top_p: float
    seed: int | None
    stop: list[str]
    logprobs: int | None
    echo: bool
    stream: bool
    include_usage: bool

    @classmethod
    def parse(cls, doc: dict) -> Params:
        model = doc.get("model")
        if not isinstance(model, str) or not model:
            raise bad_field("model", "must name a served model (GET /v1/models lists them)")
        prompt = doc.get("prompt")
        if isinstance(prompt, str):
            prompts = [(prompt, None)]
        elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
            prompts = [(p, None) for p in prompt]
        elif isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
            prompts = [(None, prompt)]
        elif (isinstance(prompt, list) and prompt and all(isinstance(p, list) and p for p in prompt)
              and all(type(t) is int for p in prompt for t in p)):
            prompts = [(None, p) for p in prompt]
        else:
            raise bad_field("prompt", "must be a string, a list of strings, a list of token ids or a list of such "
                                      "lists (non-empty)")
        stop = doc.get("stop")
        stops = [stop] if isinstance(stop, str) else stop if stop is not None else []
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops) or len(stops) > 4:
            raise bad_field("stop", "must be a string or a list of at most 4 strings")
        logprobs = _number(doc, "logprobs", None, 0, integer=True)
        if logprobs is not None and logprobs > MAX_LOGPROBS:
            raise bad_field("logprobs", f"must be in [0, {MAX_LOGPROBS}], got {logprobs}")
        seed = _number(doc, "seed", None, 0, integer=True)
        if seed is not None and seed >= 2**64:
            raise bad_field("seed", "must be below 2**64")
        if _number(doc, "n", 1, integer=True) != 1 or _number(doc, "best_of", 1, integer=True) != 1:
            raise bad_field("n" if doc.get("n") not in (None, 1) else "best_of", "only 1 completion per prompt")
        for key in ("presence_penalty", "frequency_penalty"):
            if _number(doc, key, 0) != 0:
                raise bad_field(key, "is not supported (only 0)")
        if doc.get("logit_bias") or doc.get("suffix"):
            raise bad_field("logit_bias" if doc.get("logit_bias") else "suffix", "is not supported")
        flags = {}
        for key in ("echo", "stream"):
            flags[key] = doc.get(key) or False
            if not isinstance(flags[key], bool):
                raise bad_field(key, "must be true or false")
        options = doc.get("stream_options") or {}
        if not isinstance(options, dict):
            raise bad_field("stream_options", "must be an object")
        return cls(model, prompts, _number(doc, "max_tokens", 16, 0, integer=True),
                   float(_number(doc, "temperature", 1.0, 0)), float(_number(doc, "top_p", 1.0, 0)), seed, stops,
                   logprobs, flags["echo"], flags["stream"], options.get("include_usage") is True)


class Completion:
    """One prompt's completion, step by step (blocking: runs in the thread pool)."""

    def __init__(self, front: Front, p: Params, text: str | None, ids: list[int] | None, deadline, is_active):
        self.front, self.p, self.deadline, self.is_active = front, p, deadline, is_active
        with front.registry.acquire(p.model) as model:  # the operations' own tokens and limits
            self.prompt = front.ops.tokens(model, text, ids)
        self.prompt_text = text if text is not None else "".join(self.texts(self.prompt))
        self.generated: list[int] = []
        self.finish = "length"

    def texts(self, ids: list[int]) -> list[str]:
        return self.front.posenc.token_texts(self.p.model, ids)

    def visible(self, text: str, final: bool) -> str:
        """The text a client may see: cut at a stop string; mid-stream, without a trailing partial character or
        a tail that may yet become a stop string."""
        cuts = [text.find(s) for s in self.p.stop if s and s in text]
        if cuts:
            return text[:min(cuts)]
        if final:
            return text
        text = text.rstrip("\ufffd")
        for s in self.p.stop:
            for k in range(min(len(s) - 1, len(text)), 0, -1):
                if text.endswith(s[:k]):
                    text = text[:-k]
                    break
        return text

    def chunks(self) -> Iterator[tuple[str, list[int], list[float]]]:
        """(new visible text, the tokens that made it, their log-probabilities): the echo first, then each step."""
        if self.p.echo:
            yield self.prompt_text, [], []
        if self.p.max_tokens == 0:
            return
        emitted = ""
        top_p = self.p.top_p if self.p.top_p < 1 else 0.0
        stream = self.front.ops.generate(self.p.model, None, self.prompt, self.p.max_tokens, self.p.temperature, 0,
                                         top_p, self.p.seed, self.p.stop, self.deadline, self.is_active)
        for token, logprob, so_far, reason in stream:
            self.generated.append(token)
            shown = self.visible(so_far, bool(reason))
            delta = shown[len(emitted):] if shown.startswith(emitted) else ""
            emitted = shown if shown.startswith(emitted) else emitted
            if reason:
                self.finish = REASONS.get(reason, "length")
            yield delta, [token], [logprob]

    def logprobs(self, start: int, stop: int) -> dict:
        """OpenAI's logprobs object for positions [start, stop) of prompt + completion, from one forward."""
        ids = self.prompt + self.generated
        logits = self.front.ops.infer(self.p.model, np.asarray([ids[:max(stop, 1)]], np.int64), None, False,
                                      self.deadline)["logits"][0]
        logp = log_softmax(logits)
        tokens = self.texts(ids[start:stop])
        offset = 0 if self.p.echo else len(self.prompt_text)
        out = {"tokens": tokens, "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for k, pos in enumerate(range(start, stop)):
            out["text_offset"].append(offset)
            offset += len(tokens[k])
            if pos == 0:  # the first token has no prefix to be scored against
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
                continue
            row = logp[pos - 1]
            out["token_logprobs"].append(float(row[ids[pos]]))
            out["top_logprobs"].append(self.top(row))
        return out

    def top(self, row: np.ndarray) -> dict[str, float]:
        order = np.argsort(-row, kind="stable")[:self.p.logprobs]
        return dict(zip(self.texts([int(i) for i in order]), (float(row[i]) for i in order), strict=True))

    def run(self) -> dict:
        text = "".join(delta for delta, _, _ in self.chunks())
        choice = {"text": text, "logprobs": None, "finish_reason": self.finish}
        if self.p.logprobs is not None:
            start = 0 if self.p.echo else len(self.prompt)
            choice["logprobs"] = self.logprobs(start, len(self.prompt) + len(self.generated))
        return choice


def routes(front: Front) -> list:
    created = int(time.time())

    def header(p: Params) -> dict:
        return {"id": f"cmpl-{uuid.uuid4().hex[:24]}", "object": "text_completion", "created": int(time.time()),
                "model": p.model}

    def usage(prompt: int, completion: int) -> dict:
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def complete_all(p: Params, deadline) -> dict:
        out, used = header(p), [0, 0]
        out["choices"] = []
        for index, (text, ids) in enumerate(p.prompts):
            c = Completion(front, p, text, ids, deadline, lambda: True)
            out["choices"].append({"index": index, **c.run()})
            used[0] += len(c.prompt)
            used[1] += len(c.generated)
        out["usage"] = usage(*used)
        return out

    def chunk_stream(p: Params, deadline, is_active) -> Iterator[dict]:
        base, used = header(p), [0, 0]
        for index, (text, ids) in enumerate(p.prompts):
            c = Completion(front, p, text, ids, deadline, is_active)
            for delta, tokens, logprobs in c.chunks():
                choice = {"index": index, "text": delta, "logprobs": None, "finish_reason": None}
                if p.logprobs is not None:
                    if tokens:  # one generated token: its candidates from Predict on its prefix
                        choice["logprobs"] = stream_logprobs(c, tokens[0], logprobs[0])
                    else:  # the echoed prompt
                        choice["logprobs"] = c.logprobs(0, len(c.prompt))
                yield base | {"choices": [choice]}
            used[0] += len(c.prompt)
            used[1] += len(c.generated)
            yield base | {"choices": [{"index": index, "text": "", "logprobs": None, "finish_reason": c.finish}]}
        if p.include_usage:
            yield base | {"choices": [], "usage": usage(*used)}

    def stream_logprobs(c: Completion, token: int, logprob: float) -> dict:
        prefix = c.prompt + c.generated[:-1]
        top = {}
        if c.p.logprobs:
            predicted = front.ops.predict(c.p.model, None, prefix, c.p.logprobs, deadline=c.deadline)
            top = dict(zip(c.texts([t for t, _, _ in predicted.top]), (lp for _, _, lp in predicted.top),
                           strict=True))
        offset = len(c.prompt_text) if not c.p.echo else len("".join(c.texts(c.prompt)))
        offset += len("".join(c.texts(c.generated[:-1])))
        return {"tokens": c.texts([token]), "token_logprobs": [logprob], "top_logprobs": [top],
                "text_offset": [offset]}

    async def completions(request: Request):
        p = Params.parse(await front.json(request))
        deadline = front.deadline(request)
        if not p.stream:
            return json_response(await front.call(complete_all, p, deadline))
        iterator, first, holder = await start_stream(front, lambda active: chunk_stream(p, deadline, active))

        def encode(item) -> str:
            return f"data: {json.dumps(item, separators=(',', ':'))}\n\n"

        def on_error(exc: BaseException) -> str:
            status, message = status_of(exc, "POST /v1/completions")
            return encode(body_of(status, message, openai=True))

        stream = EventStream(iterator, first, encode, "text/event-stream", on_error, tail="data: [DONE]\n\n")
        holder.append(stream)
        return stream

    async def models(request: Request):
        return json_response({"object": "list", "data": [
            {"id": name, "object": "model", "created": created, "owned_by": "posenc"}
            for name in sorted(front.registry.models)]})

    async def model(request: Request):
        name = request.path_params["name"]
        front.registry.get(name)  # 404 for an unknown model
        return json_response({"id": name, "object": "model", "created": created, "owned_by": "posenc"})

    async def chat(request: Request):
        raise HttpError(404, "posenc serves base language models, not chat models: there is no "
                             "/v1/chat/completions; send a prompt to /v1/completions")

    return [front.route("/v1/models", models, openai=True),
            front.route("/v1/models/{name}", model, openai=True),
            front.route("/v1/completions", completions, ("POST",), openai=True),
            front.route("/v1/chat/completions", chat, ("POST",), openai=True)]
