"""Predict, Score, Profile and Generate under a request's intervention (service/intervention.py), with the effect:
the unmodified run beside the intervened one in the same call when the request asks for `baseline`.

Every front calls these when a request carries an intervention and translates the answer as it does the plain
one, adding the `Effect`: the positions the intervened run used, the baseline's top candidates, the divergences
of the next-token distributions (KL(baseline || intervened), total variation, Jensen-Shannon), and per front what
it computes: Score's per-token change of log-probability, the baseline's maps, the baseline's profile."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from service import intervention
from service.artifacts import LoadedModel
from service.auth import charge
from service.errors import Cancelled, DeadlineExceeded, InvalidArgument
from service.generation import Emitted, Generation, NextTokens
from service.intervention import Intervention, Row
from service.jobs import MapRequest, Result
from service.maps_window import query_rows, select
from service.operations import MAX_LOGPROBS, Operations, Predicted
from service.profile import LEARNED_SINK, Profiled, first_row, no_profile, reachable
from service.sampling import SamplingParams, divergences, log_softmax, top_of


@dataclass
class Effect:
    """What the intervention changed, against the unmodified run of the same request (baseline)."""

    positions: list[int]  # the intervened run's prompt positions
    description: str = ""
    baseline_top: list[tuple[int, float, float]] = field(default_factory=list)
    kl: float = 0.0  # KL(baseline || intervened) of the next-token distribution, nats
    total_variation: float = 0.0
    js: float = 0.0
    top1_changed: bool = False
    baseline_maps: list[tuple[int, int, np.ndarray]] = field(default_factory=list)
    baseline_logprobs: list[float] = field(default_factory=list)  # Score
    logprob_change: list[float] = field(default_factory=list)  # Score: intervened - baseline, per token
    baseline_profile: np.ndarray | None = None  # Profile: (layers, heads, columns)
    has_baseline: bool = False


def _rows(ops: Operations, model: LoadedModel, toks: list[int], edit: Intervention) -> list[Row]:
    limit = ops.position_limit(model)
    rows = [intervention.resolve(model, edit, toks, limit)]
    if edit.baseline:
        rows.append(intervention.resolve(model, edit, toks, limit, neutral=True))
    return rows


def _mixer_cells(model: LoadedModel, name: str, graph: str) -> int:
    """The mixer matrices the maps graph computes per query-key cell (for ops._check_maps); INVALID_ARGUMENT naming
    mixer_maps where the model has no such graph (`graph`: the Intervene field naming it)."""
    spec = model.meta.intervene
    if spec is None or not getattr(spec, graph):
        err = InvalidArgument(f"mixer_maps: model {name!r} has no mixer layers with a maps graph")
        err.param = "mixer_maps"
        raise err
    return len(spec.maps_heads) * max(spec.maps_heads)


def _check_deadline(deadline: float | None) -> None:
    if deadline is not None and time.monotonic() > deadline:
        raise DeadlineExceeded("the request's deadline passed before its intervention call")


def predict(ops: Operations, name: str, text: str | None, ids: list[int] | None, edit: Intervention,
            top_k: int = 5, attention: MapRequest = MapRequest.NONE, layers: list[int] | None = None,
            heads: list[int] | None = None, deadline: float | None = None, query_start: int = 0,
            query_count: int = 0, mixer_maps: bool = False) -> tuple[Predicted, Effect]:
    """Predict under the intervention (an empty one with `mixer_maps`: the maps graph, which also gives each asked
    layer's mixer's exact matrices, every one of its channels or heads, rows as the maps' window)."""
    start = time.monotonic()
    with ops.registry.acquire(name) as served:
        model = served.model
        top_k = top_k or 5
        cap = min(ops.limits.max_top_k, model.vocab_size)
        if not 1 <= top_k <= cap:
            raise InvalidArgument(f"top_k must be in [1, {cap}], got {top_k}")
        layers = ops._indices(layers, model.n_layers, "layer")
        heads = ops._indices(heads, model.n_heads, "head")
        toks = ops.tokens(model, text, ids)
        rows = query_rows(attention, query_start, query_count, len(toks))
        maps = attention is not MapRequest.NONE
        spec = model.meta.intervene
        if mixer_maps and not maps:
            err = InvalidArgument("mixer_maps come with the maps: ask for attention FULL or LAST_ROW too")
            err.param = "mixer_maps"
            raise err
        cells = _mixer_cells(model, name, "maps_file") if mixer_maps else 0
        if maps:  # the intervention call computes every row's maps (and mixer matrices), for each of its rows
            ops._check_maps(model, MapRequest.FULL, len(toks) * (2 if edit.baseline else 1), cells)
        batch = _rows(ops, model, toks, edit)
        _check_deadline(deadline)
        t0 = time.monotonic()
        out = intervention.run(model, batch, maps=maps, exact=mixer_maps)
        compute = (time.monotonic() - t0) * 1000
        results = []
        for b in range(len(batch)):
            att = out["attentions"][b] if maps else None
            if att is not None and attention is MapRequest.LAST_ROW:
                att = att[:, :, -1:]
            results.append(Result(out["logits"][b], att, None, 0.0, compute, len(batch)))
        logp = log_softmax(results[0].logits[-1])
        top = top_of(logp, top_k)
        chosen = select(results[0], layers, heads, rows, attention)
        predicted = Predicted(toks, model.tokenizer.pieces(toks), top, chosen, results[0],
                              (time.monotonic() - start) * 1000, model.tokenizer, rows.start, model.meta.sink_layers)
        if mixer_maps and spec is not None:
            exact = out["mixer_maps"][0]  # (M, heads, T, S)
            cut = slice(exact.shape[2] - 1, None) if attention is MapRequest.LAST_ROW else rows
            predicted.mixer_maps = [(layer, h, exact[m, h, cut].copy())
                                    for m, (layer, count) in enumerate(zip(spec.maps_layers, spec.maps_heads,
                                                                           strict=True))
                                    if layer in layers for h in range(count)]
        effect = Effect([int(p) for p in batch[0].positions], edit.describe())
        if edit.baseline:
            logq = log_softmax(results[1].logits[-1])
            effect.has_baseline = True
            effect.baseline_top = top_of(logq, top_k)
            effect.total_variation, effect.kl, effect.js = divergences(logq, logp)
            effect.top1_changed = top[0][0] != effect.baseline_top[0][0]
            effect.baseline_maps = select(results[1], layers, heads, rows, attention)
        return predicted, effect


def score(ops: Operations, name: str, text: str | None, ids: list[int] | None, edit: Intervention,
          deadline: float | None = None) -> tuple[list[int], list[float], Any, Effect]:
    """Score under the intervention: the tokens, each one's log-probability given its prefix, the tokenizer, and
    the effect (with `baseline`: the unmodified log-probabilities and the change per token)."""
    with ops.registry.acquire(name) as served:
        model = served.model
        toks = ops.tokens(model, text, ids)
        if len(toks) < 2:
            raise InvalidArgument("score needs at least two tokens (each is scored given its prefix)")
        batch = _rows(ops, model, toks, edit)
        _check_deadline(deadline)
        out = intervention.run(model, batch)
        lps = [[lp for lp, _ in NextTokens(toks)(out["logits"][b][:-1], 0)] for b in range(len(batch))]
        effect = Effect([int(p) for p in batch[0].positions], edit.describe())
        if edit.baseline:
            effect.has_baseline = True
            effect.baseline_logprobs = lps[1]
            effect.logprob_change = [a - b for a, b in zip(lps[0], lps[1], strict=True)]
            logp, logq = log_softmax(out["logits"][0][-1]), log_softmax(out["logits"][1][-1])
            effect.total_variation, effect.kl, effect.js = divergences(logq, logp)
        return toks, lps[0], model.tokenizer, effect


def profile(ops: Operations, name: str, text: str | None, ids: list[int] | None, edit: Intervention,
            last: int = 0, deadline: float | None = None, every_bucket: bool = False,
            mixer_maps: bool = False) -> tuple[Profiled, Effect]:
    """The attention profile under the intervention (the intervention profile graph, the whole prompt in one call),
    averaged over the last `last` query rows; with `baseline`, the unmodified profile in the effect.  mixer_maps:
    the profile of the mixers' own matrices instead (the maps profile graph; its layers are mixer_maps')."""
    start = time.monotonic()
    with ops.registry.acquire(name) as served:
        model = served.model
        spec = model.meta.profile
        if spec is None:
            raise no_profile(name)
        iv = model.meta.intervene
        cells = _mixer_cells(model, name, "maps_profile_file") if mixer_maps else 0
        toks = ops.tokens(model, text, ids)
        begin = first_row(last, len(toks))
        if mixer_maps:  # the maps graph holds every mixer matrix of the whole prompt at once
            ops._check_maps(model, MapRequest.FULL, len(toks) * (2 if edit.baseline else 1), cells)
        batch = _rows(ops, model, toks, edit)
        _check_deadline(deadline)
        t0 = time.monotonic()
        out = intervention.run(model, batch, profile=True, exact=mixer_maps)["profile"]  # (B, T, L, H, C)
        compute = (time.monotonic() - t0) * 1000
        keep = spec.buckets if every_bucket else reachable(spec.buckets, len(toks))
        columns = [c for c in spec.columns if not (mixer_maps and c == LEARNED_SINK)]  # a mixer has no sink
        cols = list(range(keep)) + list(range(spec.buckets, len(columns)))
        values = [out[b][begin:].mean(axis=0, dtype=np.float64)[:, :, cols].astype(np.float32)
                  for b in range(len(batch))]
        buckets = list(spec.columns[:keep])
        profiled = Profiled(toks, values[0], buckets + columns[spec.buckets:], begin, model.tokenizer,
                            (time.monotonic() - start) * 1000, 0.0, compute, buckets)
        if mixer_maps and iv is not None:
            profiled.mixer_layers, profiled.mixer_heads = list(iv.maps_layers), list(iv.maps_heads)
        effect = Effect([int(p) for p in batch[0].positions], edit.describe())
        if edit.baseline:
            effect.has_baseline, effect.baseline_profile = True, values[1]
        return profiled, effect


def generate(ops: Operations, name: str, prompts: list[tuple[str | None, list[int] | None]], params: SamplingParams,
             edit: Intervention, deadline: float | None = None, is_active: Callable[[], bool] = lambda: True,
             names: dict[str, str] | None = None, allow_zero_tokens: bool = False
             ) -> Iterator[tuple[int, Generation | Emitted]]:
    """Generate under the intervention: each prompt's completion in turn, on the request's thread (the prompt in
    one call of the intervention graph, then one call per token with its cache), yielding as ops.generate does."""
    names = names or {}
    if edit.baseline:
        raise intervention._bad("baseline", "applies to Predict, Score and Profile, not Generate")
    if edit.rope_scaling is not None and edit.rope_scaling.length_dependent:
        raise intervention._bad("rope_scaling", f"{edit.rope_scaling.rope_type}'s frequencies follow the length: "
                                "it applies to Predict, Score and Profile (one call), not Generate")
    if not 1 <= len(prompts) <= ops.limits.max_prompts:
        raise InvalidArgument(f"{len(prompts)} prompts in one request; the server takes 1 to "
                              f"{ops.limits.max_prompts} (--max-prompts)")
    charge(len(prompts), "prompts", names.get("prompt", "prompt"))  # an API key's units, as KeyedOperations'
    with ExitStack() as stack:
        for _ in prompts:  # each prompt holds a stream slot, as a plain Generate's do
            stack.enter_context(ops.registry.stream_slot())
        model = stack.enter_context(ops.registry.acquire(name)).model
        params.check(max_new_tokens=ops.limits.max_new_tokens, max_stop=ops.limits.max_stop_strings,
                     max_logprobs=MAX_LOGPROBS, vocab=model.vocab_size, names=names,
                     allow_zero_tokens=allow_zero_tokens)
        toks = [ops.tokens(model, t, i) for t, i in prompts]
        limit = ops.position_limit(model)
        rows = [intervention.resolve(model, edit, t, limit) for t in toks]
        for i, (t, row) in enumerate(zip(toks, rows, strict=True)):
            yield from _stream(model, i, t, row, params, edit, limit, deadline, is_active)


def _stream(model: LoadedModel, index: int, toks: list[int], row: Row, params: SamplingParams, edit: Intervention,
            limit: int | None, deadline: float | None, is_active: Callable[[], bool]
            ) -> Iterator[tuple[int, Generation | Emitted]]:
    first = int(row.positions[-1]) + 1 if edit.next_position is None else edit.next_position
    room = None if limit is None else len(toks) + max(limit - first, 0)
    g = Generation(toks, params, model.tokenizer.detokenizer(toks), model.meta.tokenizer.eos, room, deadline,
                   is_active=is_active)
    _check_deadline(deadline)
    out = intervention.run(model, [row])
    state = [out[s.output] for s in model.meta.state]
    reduced = NextTokens(toks, params.logprobs)(out["logits"][0][:-1], 0) if params.prompt_logprobs else None
    emitted = g.advance(Result(out["logits"][0], None, state, 0.0, 0.0, 1, reduced))
    yield index, g
    if emitted is None:
        return
    yield index, emitted
    positions = np.concatenate([row.positions, intervention.next_positions(row, params.max_new_tokens, first)])
    while not emitted.reason:
        if not is_active():
            raise Cancelled("client cancelled the stream")
        _check_deadline(deadline)
        cached = len(toks) + g.generated - 1
        out = intervention.run(model, [row], new=[np.asarray([g.last], np.int64)], past=state,
                               past_positions=[positions[:cached + 1]])
        state = [out[s.output] for s in model.meta.state]
        emitted = g.take(log_softmax(out["logits"][0][-1]))
        yield index, emitted

