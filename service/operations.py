"""What the worker does for a request, in plain Python types: predict, generate, score, compare, encoding, infer.
Every front (posenc.v1 and KServe v2 over gRPC, HTTP) calls these and only translates; every limit and error lives
here (as service.errors classes) or in the registry and the engines below them."""

from __future__ import annotations

import math
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from service.artifacts import LoadedModel
from service.engine import Engine
from service.errors import Cancelled, FailedPrecondition, InvalidArgument, TooLarge
from service.generation import Emitted, Generation, NextTokens
from service.jobs import WHOLE_MAP_CELLS, Job, MapRequest, Result, awaited
from service.maps_window import query_rows, select
from service.registry import Registry, Served
from service.sampling import SamplingParams, divergences, log_softmax, permutation, top_of
from service.settings import Limits
from service.tokenizer import Tokenizer

MAX_LOGPROBS = 5  # top candidates a token may report (the cap of OpenAI's `logprobs`)


@dataclass
class Predicted:
    ids: list[int]
    pieces: list[str]
    top: list[tuple[int, float, float]]  # (token id, probability, log-probability)
    attention: list[tuple[int, int, np.ndarray]] = field(default_factory=list)  # (layer, head, map)
    result: Result | None = None
    total_ms: float = 0.0
    tokenizer: Any = None  # the model's (service.tokenizer): pieces of the candidates
    query_start: int = 0  # the prompt position of the maps' first row (service.maps_window)
    sink_layers: frozenset[int] = frozenset()  # the answering model's layers with attention sinks (model.json)
    mixer_maps: list[tuple[int, int, np.ndarray]] = field(default_factory=list)  # (layer, mixer head, exact matrix)


@dataclass
class Comparison:
    model: str
    variant: str
    top: list[tuple[int, float, float]] = field(default_factory=list)
    permuted_top: list[tuple[int, float, float]] = field(default_factory=list)
    total_variation: float = 0.0
    kl: float = 0.0
    js: float = 0.0
    top1_changed: bool = False
    error: str = ""
    tokenizer: Any = None  # the row model's (service.tokenizer)


class Operations:
    def __init__(self, registry: Registry):
        self.registry = registry

    @property
    def limits(self) -> Limits:
        return self.registry.limits

    def tokens(self, model: LoadedModel, text: str | None, ids: list[int] | None, extra: int = 0) -> list[int]:
        """The prompt's tokens, checked against the server's limits and this model's vocabulary and positions."""
        toks = self._plain_tokens(text, ids, model)
        limit = self.position_limit(model)
        if limit is not None and len(toks) + extra > limit:
            raise InvalidArgument(f"prompt of {len(toks)} tokens exceeds model {model.name}'s max_positions={limit}"
                                  + (" (its own max_position_embeddings; the worker's --long-context 1 allows "
                                     "longer)" if limit != model.max_positions else ""))
        return toks

    def position_limit(self, model: LoadedModel) -> int | None:
        """The most positions (prompt + completion) a request on this model gets: the artifact's max_positions (a
        learned table), or for an imported model the length it is made for unless --long-context 1 (running past it
        stays possible, by choice): max_position_embeddings, times the factor of a RoPE scaling that extends it
        (model.json's max_model_len, as vLLM derives it); None = the server's prompt limit only."""
        if model.max_positions is not None:
            return model.max_positions
        imported = model.meta.source is not None and model.meta.source.kind == "huggingface"
        if imported and not self.limits.long_context:
            return model.meta.max_model_len or model.meta.trained_context or None
        return None

    def model(self, name: str) -> LoadedModel:
        """The named model's artifact (its tokenizer, sizes, metadata) for a front that needs no engine call:
        NOT_FOUND naming the served models, UNAVAILABLE while shutting down."""
        return self.registry.get(name)

    @staticmethod
    def run(engine: Engine, ids: list[int], state: list[np.ndarray] | None, attention: MapRequest,
            deadline: float | None, want_state: bool = True, last_only: bool = False,
            reduce: Callable[[np.ndarray, int], list[Any]] | None = None, whole: bool = False) -> Result:
        """One job through the model's engine, awaited (whole: its maps need the prompt in one call, Job.whole)."""
        return awaited(engine.submit(Job(np.asarray(ids, np.int64), state, attention, deadline, want_state, last_only,
                                         reduce=reduce, whole=whole)), deadline)

    # --- Predict ----------------------------------------------------------------------------------------

    def predict(self, name: str, text: str | None, ids: list[int] | None, top_k: int = 5,
                attention: MapRequest = MapRequest.NONE,
                layers: list[int] | None = None, heads: list[int] | None = None,
                deadline: float | None = None, query_start: int = 0, query_count: int = 0) -> Predicted:
        start = time.monotonic()
        with self.registry.acquire(name) as served:
            model = served.model
            top_k = top_k or 5
            if not 1 <= top_k <= min(self.limits.max_top_k, model.vocab_size):
                cap = min(self.limits.max_top_k, model.vocab_size)
                raise InvalidArgument(f"top_k must be in [1, {cap}], got {top_k}")
            layers = self._indices(layers, model.n_layers, "layer")
            heads = self._indices(heads, model.n_heads, "head")
            toks = self.tokens(model, text, ids)
            rows = query_rows(attention, query_start, query_count, len(toks))
            self._check_maps(model, attention, len(toks))
            result = self._maps_run(served, toks, attention, deadline)
            logp = log_softmax(result.logits[-1])
            order = np.argsort(-logp, kind="stable")[:top_k]
            top = [(int(i), float(math.exp(logp[i])), float(logp[i])) for i in order]
            maps = select(result, layers, heads, rows, attention)
            return Predicted(toks, model.tokenizer.pieces(toks), top, maps, result, (time.monotonic() - start) * 1000,
                             model.tokenizer, rows.start, model.meta.sink_layers)

    def _check_maps(self, model: LoadedModel, attention: MapRequest, length: int, mixer: int = 0) -> None:
        """Refuse maps whose computation passes the message limit: the exact graph computes every layer's and head's
        probabilities (and `mixer` matrices more in the maps graph) for every query row of its call (4 bytes x layers
        x heads x rows x keys), whichever are asked for; the answer is never larger.  Last row: one row (_maps_run)."""
        if attention is MapRequest.NONE:
            return
        cell, budget = 4 * (model.n_layers * model.n_heads + mixer), int(self.limits.max_message_bytes * 0.9)

        def one_row(kind: MapRequest) -> bool:
            return kind is MapRequest.LAST_ROW and not model.whole_prompts

        rows = 1 if one_row(attention) else length
        if cell * rows * length <= budget:
            return
        fits = budget // cell if one_row(attention) else math.isqrt(budget // cell)  # the longest that fits
        last = attention is MapRequest.FULL and one_row(MapRequest.LAST_ROW) and cell * length <= budget
        raise TooLarge(f"attention maps of a {length}-token prompt take {cell * rows * length} bytes to compute "
                       f"({model.n_layers} layers x {model.n_heads} heads{f' + {mixer} mixer matrices' * bool(mixer)}"
                       f" x {rows} query rows x {length} keys x 4 "
                       "bytes: every layer and head is computed, whichever are asked for), over the "
                       f"{budget} bytes the server's --max-message-bytes allows; ask for "
                       + ("attention=LAST_ROW or " if last else "") + f"a prompt of at most {fits} tokens")

    def _maps_run(self, served: Served, toks: list[int], attention: MapRequest, deadline: float | None) -> Result:
        """Predict's call.  The last row's maps come from a call of the last token alone on the cache of the others
        (a cached forward equals the whole one), so that call computes one query row of maps, not the prompt's; a
        model whose RoPE frequencies follow the length runs its prompt whole (model.whole_prompts), as does a model
        whose Mamba-2 rows span only their call's keys (ModelJson.whole_maps), up to WHOLE_MAP_CELLS."""
        engine, whole = served.engine, served.model.meta.whole_maps and len(toks) ** 2 <= WHOLE_MAP_CELLS
        if attention is not MapRequest.LAST_ROW or len(toks) == 1 or served.model.whole_prompts or whole:
            return self.run(engine, toks, None, attention, deadline, want_state=False, last_only=True, whole=whole)
        head = self.run(engine, toks[:-1], None, MapRequest.NONE, deadline, last_only=True)
        tail = self.run(engine, toks[-1:], head.state, attention, deadline, want_state=False, last_only=True)
        return Result(tail.logits, tail.attentions, tail.state, head.queue_ms, head.compute_ms + tail.compute_ms,
                      tail.batch_size)

    @staticmethod
    def _indices(values: list[int] | None, n: int, what: str) -> list[int]:
        if not values:
            return list(range(n))
        bad = [v for v in values if not 0 <= v < n]
        if bad:
            raise InvalidArgument(f"{what} index {bad[0]} is out of range [0, {n})")
        return list(dict.fromkeys(values))

    # --- Compare ----------------------------------------------------------------------------------------

    def compare(self, text: str | None, ids: list[int] | None, permuted_text: str | None,
                permuted_ids: list[int] | None, names: list[str] | None = None, top_k: int = 5,
                deadline: float | None = None) -> tuple[list[int], list[int], list[Comparison], Tokenizer]:
        """Every named model (default: all) on the prompt and on the same tokens in another order, side by side.

        All jobs are queued before any is awaited, so the models' engines run them in parallel.  A model that
        cannot take the prompt (beyond its positions) reports that in its row; the others still answer."""
        names = list(dict.fromkeys(names)) if names else sorted(self.registry.models)
        with ExitStack() as stack:
            chosen = [stack.enter_context(self.registry.acquire(n)) for n in names]
            return self._compare(chosen, text, ids, permuted_text, permuted_ids, top_k, deadline)

    def _compare(self, chosen: list[Served], text: str | None, ids: list[int] | None,
                 permuted_text: str | None, permuted_ids: list[int] | None, top_k: int, deadline: float | None
                 ) -> tuple[list[int], list[int], list[Comparison], Tokenizer]:
        """Each model tokenizes the prompts with its own tokenizer.  Returns the first model's tokens of both
        prompts (and its tokenizer, for their pieces) and a row per model."""
        top_k = top_k or 5
        if not 1 <= top_k <= self.limits.max_top_k:
            raise InvalidArgument(f"top_k must be in [1, {self.limits.max_top_k}], got {top_k}")
        permuted_text, permuted_ids = permutation(text, ids, permuted_text, permuted_ids)
        pending: list[tuple[LoadedModel, list[Future[Result]] | None, str]] = []
        shown: tuple[list[int], list[int], Tokenizer] | None = None
        for served in chosen:
            model = served.model
            try:  # limits: the server's, this model's vocabulary and positions
                toks, perm = self.tokens(model, text, ids), self.tokens(model, permuted_text, permuted_ids)
            except InvalidArgument as err:
                pending.append((model, None, str(err)))
                continue
            shown = shown or (toks, perm, model.tokenizer)
            jobs = [served.engine.submit(Job(np.asarray(t, np.int64), None, deadline=deadline, want_state=False,
                                               last_only=True))
                    for t in (toks, perm)]
            pending.append((model, jobs, ""))
        if shown is None:  # no model could take it: the first one's reason
            raise InvalidArgument(pending[0][2])
        out = []
        for model, futures, error in pending:
            row = Comparison(model.name, model.meta.variant, error=error, tokenizer=model.tokenizer)
            if futures is not None:
                logp, logq = (log_softmax(awaited(j, deadline).logits[-1]) for j in futures)
                row.top, row.permuted_top = top_of(logp, top_k), top_of(logq, top_k)
                row.total_variation, row.kl, row.js = divergences(logp, logq)
                row.top1_changed = row.top[0][0] != row.permuted_top[0][0]
            out.append(row)
        return shown[0], shown[1], out, shown[2]

    def _plain_tokens(self, text: str | None, ids: list[int] | None, model: LoadedModel) -> list[int]:
        """Tokens (text encoded with the model's tokenizer) checked against its vocabulary and the server's limits
        (not the model's positions)."""
        toks = model.tokenizer.encode(text) if text is not None else list(ids or [])
        vocab = model.vocab_size
        bad = [i for i in toks if not 0 <= i < vocab]
        if bad:
            raise InvalidArgument(f"token id {bad[0]} is outside the vocabulary [0, {vocab})")
        if not toks:
            raise InvalidArgument("empty prompt: give text or at least one token id")
        if len(toks) > self.limits.max_prompt_tokens:
            raise InvalidArgument(f"prompt of {len(toks)} tokens exceeds the server's limit of "
                                  f"{self.limits.max_prompt_tokens} tokens")
        return toks

    # --- Encoding ---------------------------------------------------------------------------------------

    def encoding(self, name: str, length: int) -> tuple[list[tuple[str, np.ndarray]], str]:
        """The artifact's encoding graph at positions 0..length-1: [(output name, array)], and a note."""
        with self.registry.acquire(name) as served:
            model = served.model
            spec = model.meta.encoding
            if spec is None:
                raise FailedPrecondition(f"model {name!r} was exported before encoding graphs existed; re-export it "
                                         "(make models) to see its encoding")
            cap = min(model.max_positions or self.limits.max_prompt_tokens, self.limits.max_prompt_tokens)
            if not 1 <= length <= cap:
                raise InvalidArgument(f"length must be in [1, {cap}] for model {name!r}, got {length}")
            outputs = spec.outputs
            size = 0
            for o in outputs:
                cells = 1
                for d in o.shape:
                    cells *= length if isinstance(d, str) else int(d)
                size += 4 * cells
            if size > self.limits.max_message_bytes * 0.9:
                raise TooLarge(f"the encoding at length {length} would take {size} bytes, over the "
                                        f"{self.limits.max_message_bytes}-byte message limit; ask for a shorter length")
            if model.encoding is None:
                return [], spec.note
            names = [o.name for o in outputs]
            values = model.encoding.run(names, {"positions": np.arange(length, dtype=np.int64)})
            return list(zip(names, values, strict=True)), spec.note

    # --- Score ------------------------------------------------------------------------------------------

    def score(self, name: str, text: str | None, ids: list[int] | None,
              deadline: float | None = None) -> tuple[list[int], list[float], Any]:
        """The tokens, each one's log-probability given its prefix (tokens[1:]), and the model's tokenizer."""
        with self.registry.acquire(name) as served:
            model = served.model
            toks = self.tokens(model, text, ids)
            if len(toks) < 2:
                raise InvalidArgument("score needs at least two tokens (each is scored given its prefix)")
            result = self.run(served.engine, toks, None, MapRequest.NONE, deadline, want_state=False,
                              reduce=NextTokens(toks))
            return toks, [lp for lp, _ in result.reduced or []], model.tokenizer

    # --- Generate ---------------------------------------------------------------------------------------

    def generate(self, name: str, prompts: list[tuple[str | None, list[int] | None]], params: SamplingParams,
                 deadline: float | None = None, is_active: Callable[[], bool] = lambda: True,
                 names: dict[str, str] | None = None,
                 allow_zero_tokens: bool = False) -> Iterator[tuple[int, Generation | Emitted]]:
        """Every prompt's completion, the prompts together: yields (prompt index, its Generation) once its prompt
        has run (prompt ids; prompt log-probabilities when asked), then (prompt index, Emitted) per token, each
        prompt's tokens in order (prompts interleave).

        The prompts run through the model's engine together (batched with other requests); every later token
        comes from the model's decode batch (service/batch.py), one onnxruntime call per step for all active
        streams.  `names` maps parameter names to the caller's, so errors name the field the caller sent."""
        names = names or {}
        with ExitStack() as stack:
            cap = self.limits.max_prompts
            if not 1 <= len(prompts) <= cap:
                raise _named(InvalidArgument(f"{len(prompts)} prompts in one request; the server takes 1 to {cap} "
                                             "(--max-prompts)"), names.get("prompt", "prompt"))
            for _ in prompts:
                stack.enter_context(self.registry.stream_slot())
            served = stack.enter_context(self.registry.acquire(name))
            model = served.model
            params.check(max_new_tokens=self.limits.max_new_tokens,
                         max_stop=self.limits.max_stop_strings,
                         max_logprobs=MAX_LOGPROBS, vocab=model.vocab_size, names=names,
                         allow_zero_tokens=allow_zero_tokens)
            try:
                toks = [self.tokens(model, text, ids) for text, ids in prompts]
            except InvalidArgument as err:
                raise _named(err, names.get("prompt", "prompt")) from None
            yield from self._generate(served, toks, params, deadline, is_active)

    def _generate(self, served: Served, toks: list[list[int]], params: SamplingParams, deadline: float | None,
                  is_active: Callable[[], bool]) -> Iterator[tuple[int, Generation | Emitted]]:
        model, engine = served.model, served.engine
        limit = self.position_limit(model)
        signal = threading.Event()  # set by the decode loop after every token of these streams
        eos = model.meta.tokenizer.eos
        gens = [Generation(t, params, model.tokenizer.detokenizer(t), eos, limit, deadline,
                           is_active=is_active, signal=signal) for t in toks]
        if not is_active():
            raise Cancelled("client cancelled the stream")
        futures: deque[Future[Result]] = deque()  # each popped as its stream starts
        try:
            for t, g in zip(toks, gens, strict=True):  # every prompt queued before any is awaited: batched
                futures.append(engine.submit(Job(np.asarray(t, np.int64), None, MapRequest.NONE, deadline,
                                                          params.max_new_tokens > 0, not params.prompt_logprobs,
                                                          reduce=g.reduce if params.prompt_logprobs else None)))
            live = []  # the streams in the decode loop: read until each one's last token
            for i, g in enumerate(gens):
                first = g.advance(awaited(futures[0], deadline))  # (left queued if it raised: cancelled)
                futures.popleft()  # its prompt's logits (T x vocabulary floats) are not held while the stream runs
                if first is not None and not first.reason:
                    engine.add(g)
                    live.append(i)
                yield i, g
                if first is not None:
                    yield i, first
            while live:
                signal.clear()
                got = False
                for i in list(live):
                    try:
                        item = gens[i].out.get_nowait()
                    except queue.Empty:
                        continue
                    got = True
                    engine.wake()
                    if isinstance(item, BaseException):
                        raise item
                    yield i, item
                    if item.reason:
                        live.remove(i)
                if not is_active():
                    raise Cancelled("client cancelled the stream")
                if not got:
                    signal.wait(0.05)
        finally:
            for g in gens:
                g.cancelled = True  # the loop drops it before its next step
            for f in futures:
                f.cancel()

    # --- Infer (KServe v2 ModelInfer) -------------------------------------------------------------------

    def infer(self, name: str, ids: np.ndarray, mask: np.ndarray, want_attentions: bool,
              deadline: float | None = None) -> dict[str, np.ndarray]:
        """A caller's (batch, seq) tensors through the model's engine: each row's real tokens (mask 1) become
        one job, so rows share the batching, the queue limit and the deadline of every other request, and each
        row's answer equals its answer alone.  Outputs come back in the caller's layout: logits (B, T, V) and
        attentions (B, L, H, T, T), zero at padded positions.  Both KServe fronts call this only with a request
        `service.kserve_request.check` has validated (mask shape and values, a token per row, the answer's size)."""
        with self.registry.acquire(name) as served:
            model = served.model
            B, T = ids.shape
            rows = [np.flatnonzero(mask[b]) for b in range(B)]
            attention = MapRequest.FULL if want_attentions else MapRequest.NONE
            jobs = []
            for b, real in enumerate(rows):
                toks = self.tokens(model, None, ids[b, real].tolist())
                jobs.append(served.engine.submit(Job(np.asarray(toks, np.int64), None, attention, deadline,
                                                       want_state=False)))
            logits = np.zeros((B, T, model.vocab_size), np.float32)
            att = np.zeros((B, model.n_layers, model.n_heads, T, T), np.float32) if want_attentions else None
            for b, (real, job) in enumerate(zip(rows, jobs, strict=True)):
                result = awaited(job, deadline)
                logits[b, real] = result.logits
                if att is not None:
                    att[b][np.ix_(np.arange(model.n_layers), np.arange(model.n_heads), real, real)] = result.attentions
            return {"logits": logits, **({"attentions": att} if att is not None else {})}


def _named(err: InvalidArgument, param: str) -> InvalidArgument:
    """The error with the request field it is about (the HTTP fronts report it as OpenAI's `param`)."""
    err.param = param
    return err
