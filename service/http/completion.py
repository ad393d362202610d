"""What /v1/completions and /v1/chat/completions share: one choice as the decode loop's tokens build it (text cut
at stop strings, log-probabilities, text offsets, finish reason), the usage count, and the stream of
(choice, new text, log-probabilities) from service.operations.generate that both routes answer from, unary or as
server-sent events.  A request's `intervention` extension (an object beside OpenAI's fields, as vLLM carries its
own; service.intervention.parse reads it) generates under it instead (service.intervened.generate)."""

from __future__ import annotations

import codecs
import json
import re
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict

from service import intervened, intervention
from service.generation import Emitted, Generation, StopScan
from service.http import errors
from service.http.errors import HttpError, bad_field, body_of, status_of
from service.http.front import EventStream, Front, start_stream
from service.intervention import Intervention
from service.sampling import SamplingParams
from service.tokenizer import Detokenizer, Tokenizer

REASONS: dict[str, Literal["stop", "length"]] = {"stop": "stop", "length": "length", "max_positions": "length"}
# posenc.v1's field names where OpenAI's API has its own
NAMES = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens"}
Prompts = list[tuple[str | None, list[int] | None]]  # each prompt: its text, or its token ids


M = TypeVar("M", bound=BaseModel)
L = TypeVar("L")
Item = tuple["Completion", str, L | None]  # (choice, new text, its tokens' log-probabilities in the route's form)
HELD = 16  # tokens that let out no text a streamed chunk with log-probabilities gathers before it goes anyway
_JSON = json.JSONEncoder(separators=(",", ":"))  # one encoder for every event (json.dumps makes one per call)


def validated(model: type[M], doc: dict[str, Any], messages: dict[str, str] | None = None) -> M:
    """The request as `model` (service.http.errors.validated: a bad field is 400 naming it, OpenAI's param), with
    `messages`' own words for the top-level fields whose pydantic message would not help."""
    try:
        return errors.validated(model, doc)
    except HttpError as err:
        field = re.split(r"[.\[]", err.param or "")[0]
        if messages is not None and field in messages:
            raise bad_field(field, messages[field]) from None
        raise


def sampling(req: Any, most: int, max_tokens: int | None, logprobs: int = 0,
             prompt_logprobs: bool = False, token_logprob: bool = False) -> SamplingParams:
    """The SamplingParams of an OpenAI request (completions and chat share the fields temperature, top_p, top_k,
    seed, stop, ignore_eos, min_tokens); `most` is the server's --max-new-tokens, what max_tokens: null asks for;
    `token_logprob` whether the response writes each token's log-probability."""
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    params = SamplingParams(max_new_tokens=most if max_tokens is None else max_tokens,
                            temperature=float(req.temperature), top_k=max(req.top_k, 0), top_p=float(req.top_p),
                            seed=req.seed, stop=tuple(s for s in stop if s), logprobs=logprobs,
                            prompt_logprobs=prompt_logprobs, ignore_eos=req.ignore_eos,
                            token_logprob=token_logprob, min_new_tokens=req.min_tokens)
    if len(stop) > len(params.stop):
        raise bad_field("stop", "must not hold an empty string")
    return params


INTERVENTION = ("posenc's extension: generate under a position intervention (docs/interventions.md): positions, "
                "shift, stretch, next_position, positional_off, ablate_heads, rope_scaling")


def intervention_of(obj: dict[str, Any] | None) -> Intervention:
    """The request's `intervention` object (400 naming `intervention.<field>`); `baseline` belongs to Predict,
    Score and Profile, not to a completion."""
    edit = intervention.parse(obj)
    if edit.baseline:
        raise bad_field("intervention.baseline", "a completion has no baseline run: it applies to posenc.v1 "
                        "Predict, Score and Profile (and /v1/posenc/predict, score, profile)")
    return edit


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    include_usage: bool = False


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
    try:
        return len(raw.decode("utf-8")), b""  # whole characters (most tokens): no decoder to make
    except UnicodeDecodeError:
        dec = codecs.getincrementaldecoder("utf-8")("replace")
        return len(dec.decode(raw)), dec.getstate()[0]


class Offsets:
    """text_offset, given as each token comes: where the token's text starts in the text a Detokenizer lets out.
    A token's text may come out after it (the bytes of a character not yet whole, a byte-fallback run held until
    it ends), so the bytes of the tokens still held back are kept here: a token whose text is not out yet gets the
    offset where its first byte's character starts (a `bytes:` piece: the start of the character it is part of),
    counting the held bytes before it as UTF-8 characters; a token that lets out text ending in its own text, the
    offset of that text; a token with no text (a special token the text skips) the offset where it sits."""

    def __init__(self, tokenizer: Tokenizer, silent: frozenset[int] = frozenset()):
        self.raw, self.silent = tokenizer.token_bytes, silent
        self.held = b""  # the bytes of the tokens whose text has not come out yet

    def place(self, token: int, end: int, delta: str, piece: str) -> int:
        """The offset of `token`, which let out `delta` (the text is `end` characters long with it) and which
        logprobs write as `piece`."""
        raw = b"" if token in self.silent else self.raw(token)
        before = end - len(delta) + (_utf8(self.held)[0] if self.held else 0)  # where the held bytes' text goes on
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


def _keeping_special(tokenizer: Tokenizer) -> Detokenizer:
    """The echo of token ids as it is returned: the tokenizer's decode with special tokens kept (<s> is text)."""
    return Detokenizer(tokenizer.decode, tokenizer.token_bytes, (), getattr(tokenizer, "byte_pieces", frozenset()))


class Completion:
    """One prompt's choice as it is built: text, log-probabilities, finish reason."""

    def __init__(self, index: int, gen: Generation, tokenizer: Tokenizer, *, sent: str | None = None,
                 echo: bool = False, logprobs: bool = False):
        self.index, self.gen = index, gen
        self.echo = (sent if sent is not None else tokenizer.decode(gen.prompt)) if echo else ""
        self.stops = StopScan(gen.params.stop)  # the stop strings in the completion's text, found as it grows
        self.text = ""  # the completion's text so far (Emitted.text)
        self.sent = 0  # how much of it a client has been given (it never sees a stop string, nor what follows)
        self.finish: Literal["stop", "length"] | None = None
        self.generated = 0
        self.last: Emitted | None = None  # the latest token (the chat route writes its own logprobs from it)
        # not text in a completion (skip_special_tokens)
        special: frozenset[int] = getattr(tokenizer, "special", frozenset())
        self.offsets = Offsets(tokenizer, special)
        self.lp: dict[str, list[Any]] | None = {key: [] for key in Logprobs.model_fields} if logprobs else None
        self.echo_lp: Logprobs | None = None
        if echo and self.lp is not None:
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

    @property
    def shown(self) -> str:
        """The completion's text sent so far (cut at a stop string)."""
        return self.text[:self.sent]

    def visible(self, item: Emitted) -> str:
        """The new text a client may see once `item` is in: the text is cut at the first stop string; mid-stream,
        a tail that may yet become one is held back.  The stop strings are found incrementally (StopScan): a token
        costs time in its own text and the stop strings' length, not the whole text's."""
        self.stops.feed(item.text[len(self.text):])  # Emitted.text only grows: what this token added
        self.text = item.text
        end = max(self.stops.end(bool(item.reason)), self.sent)  # never less than was sent (it only grows)
        new, self.sent = self.text[self.sent:end], end
        return new

    def take(self, item: Emitted) -> tuple[str, dict[str, list[Any]] | None]:
        """One token: (the new visible text, its log-probabilities as OpenAI's logprobs object, when asked)."""
        self.generated += 1
        self.last = item
        delta = self.visible(item)
        if item.reason:
            self.finish = REASONS.get(item.reason, "length")
        if self.lp is None:
            return delta, None
        eos = item.reason == "stop" and item.id in self.gen.eos and not self.gen.params.ignore_eos
        # the end of sequence sits after all the text
        start = len(item.text) if eos else self.offsets.place(item.id, len(item.text), item.delta, item.piece)
        one: dict[str, list[Any]] = {"tokens": [item.piece], "token_logprobs": [item.logprob],
                                     "top_logprobs": [top_texts(item.top)], "text_offset": [len(self.echo) + start]}
        for key, value in one.items():
            self.lp[key] += value
        return delta, one

    def choice(self) -> Choice:
        lp = None
        if self.lp is not None:
            lp = Logprobs(**self.lp) if self.echo_lp is None else Logprobs(
                **{k: getattr(self.echo_lp, k) + self.lp[k] for k in Logprobs.model_fields})
        return Choice(index=self.index, text=self.echo + self.shown, logprobs=lp, finish_reason=self.finish or "length")


def usage(choices: Iterable[Completion]) -> Usage:
    choices = list(choices)
    prompt = sum(len(c.gen.prompt) for c in choices)
    done = sum(c.generated for c in choices)
    return Usage(prompt_tokens=prompt, completion_tokens=done, total_tokens=prompt + done)


def events(front: Front, model: str, prompts: Prompts, params: SamplingParams,
           deadline: float | None, is_active: Callable[[], bool], *, echo: bool = False, logprobs: bool = False,
           names: dict[str, str] | None = None, edit: Intervention | None = None
           ) -> Iterator[tuple[Completion, str, dict[str, Any] | None]]:
    """(choice, new text, its log-probabilities) as the decode loop hands out tokens; an echo first.  One path for
    every OpenAI route: service.operations.generate with the request's SamplingParams, or under an intervention
    service.intervened.generate (each prompt in turn on the request's thread)."""
    tokenizer: Tokenizer | None = None
    choices: dict[int, Completion] = {}
    names = names or NAMES
    stream = intervened.generate(front.ops, model, prompts, params, edit, deadline, is_active, names=names,
                                 allow_zero_tokens=True) if edit is not None and edit.wanted else \
        front.ops.generate(model, prompts, params, deadline, is_active, names=names, allow_zero_tokens=True)
    for index, item in stream:
        if isinstance(item, Generation):
            tokenizer = tokenizer or front.ops.model(model).tokenizer
            c = choices[index] = Completion(index, item, tokenizer, sent=prompts[index][0], echo=echo,
                                            logprobs=logprobs)
            if params.max_new_tokens == 0:
                c.finish = "length"
            yield c, c.echo, None if c.echo_lp is None else c.echo_lp.model_dump()
        else:
            c = choices[index]
            yield c, *c.take(item)


def coalesced(stream: Iterator[Item[L]], join: Callable[[L, L], L]) -> Iterator[Item[L]]:
    """The stream's tokens as a stream's chunks carry them: a choice's consecutive tokens go in one item while its
    next token is already waiting (the decode loop ran ahead of the client), and a token that lets out no text (part
    of a character, a special token) waits for the next that does, as the stream without log-probabilities sends
    nothing for it; at most HELD tokens go in one item, and a choice's last token ends its item.  A choice's first
    item (its echo, the chat's role) goes alone.  The text and the log-probabilities (`join` puts two items'
    together) are the stream's, in fewer chunks; an error after some tokens comes after the item that holds them."""
    pending: Item[L] | None = None
    held = 0  # tokens in pending
    try:
        for c, text, lp in stream:
            if pending is not None and pending[0] is not c:  # another choice's item: this one's tokens go first
                yield pending
                pending, held = None, 0
            if c.last is None:  # the choice opens
                yield c, text, lp
                continue
            if pending is not None:
                old = pending[2]
                text, lp = pending[1] + text, lp if old is None else old if lp is None else join(old, lp)
            pending, held = (c, text, lp), held + 1
            if c.finish or held >= HELD or not c.gen.out.qsize() and (text or lp is None):
                yield pending
                pending, held = None, 0
    except Exception:
        if pending is not None:
            yield pending
        raise
    if pending is not None:
        yield pending


def extended(a: dict[str, list[Any]], b: dict[str, list[Any]]) -> dict[str, list[Any]]:
    """Completions' logprobs of consecutive tokens as one object (each array goes on)."""
    for key, values in a.items():
        values += b[key]
    return a


def gathered(stream: Iterator[tuple[Completion, str, dict[str, Any] | None]]) -> list[Completion]:
    """Every choice of a unary request, once its tokens are all in, by index."""
    choices: dict[int, Completion] = {}
    for c, _, _ in stream:
        choices[c.index] = c
    return [choices[i] for i in sorted(choices)]


async def sse(front: Front, route: str,
              make: Callable[[Callable[[], bool], dict[int, Completion]], Iterator[dict[str, Any]]]) -> EventStream:
    """A stream of server-sent events, `data: {chunk}` each and `data: [DONE]` last; an error after the first chunk
    is one more event in OpenAI's error shape.  `make(is_active, seen)` yields the chunks and puts each choice into
    `seen` (its index -> Completion), so the stream knows whether a token is waiting to be sent."""
    seen: dict[int, Completion] = {}
    iterator, first, holder = await start_stream(front, lambda active: make(active, seen))

    def encode(item: object) -> str:
        return f"data: {_JSON.encode(item)}\n\n"

    def on_error(exc: BaseException) -> str:
        status, message = status_of(exc, route)
        return encode(body_of(status, message, openai=True, param=getattr(exc, "param", None)))

    def ready() -> bool:
        return any(c.gen.out.qsize() for c in list(seen.values()))

    stream = EventStream(iterator, first, encode, "text/event-stream", on_error, tail="data: [DONE]\n\n",
                         ready=ready)
    holder.append(stream)
    return stream


def wants_usage(options: StreamOptions | None) -> bool:
    return options is not None and options.include_usage

