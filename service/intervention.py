"""Per-request interventions on what positions do, run on the artifact's intervention graph (export/intervene.py).

A request may give every prompt token's position (or shift and stretch the counted ones), switch off the positional
computation of chosen layers (a NoPE ablation of each: the rotation by the identity, the score bias zero), zero
chosen heads' outputs before the output projection, and give a RoPE model another scaling for that call
(service/rope_request.py computes its frequencies).  `Intervention` is the request's part, the same on every front
(posenc.v1's Intervention message, the JSON APIs' `intervention` object, OpenAI's extension, KServe's parameters);
`resolve` checks it against the model and the prompt and gives the graph's inputs for that row (`Row`); `run`
calls the graph for a batch of rows, each with its own intervention, left-padded.

Positions.  Without `positions`, token i of the prompt sits at shift + round(i * stretch) (shift 0 and stretch 1:
the positions the model counts itself, 0 .. T-1).  A generated token sits one past the one before it, the first
at `next_position` when given.  Positions must be >= 0 and below the positions the model takes (a learned table's
rows; an imported model's max_model_len unless the worker runs with --long-context 1).

Intervention calls do not go through the engine's batch or prefix cache: each request's rows (the intervened
prompt and, with `baseline`, the unmodified one) run in one call of the intervention graph on the request's own
thread, under the server's gate on concurrent runs, so nothing one request changes reaches another's rows or any
cache.  The plain graphs' speed is untouched; what an intervention call costs is measured by `make bench`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from service import rope_request
from service.artifacts import LoadedModel
from service.errors import FailedPrecondition, InvalidArgument
from service.model_json import Intervene
from service.rope_request import RopeRequest

FIELDS = ("positions", "shift", "stretch", "next_position", "positional_off", "ablate_heads", "rope_scaling",
          "baseline")


def _bad(key: str, why: str) -> InvalidArgument:
    err = InvalidArgument(f"intervention.{key}: {why}")
    err.param = f"intervention.{key}"
    return err


@dataclass(frozen=True)
class Intervention:
    """What a request changes (all optional; the empty one changes nothing)."""

    positions: tuple[int, ...] = ()  # one per prompt token; empty: shift + round(i * stretch)
    shift: int = 0
    stretch: float = 1.0
    next_position: int | None = None  # Generate: the first generated token's position (default: the last + 1)
    positional_off: tuple[int, ...] = ()  # layers whose positional computation is removed
    ablate_heads: tuple[tuple[int, int], ...] = ()  # (layer, head) pairs whose output is zeroed
    rope_scaling: RopeRequest | None = None
    baseline: bool = False  # also run the unmodified request and report the effect

    @property
    def active(self) -> bool:
        """Whether it changes anything (a request with only `baseline` set still runs both rows)."""
        return bool(self.positions or self.shift or self.stretch != 1.0 or self.next_position is not None
                    or self.positional_off or self.ablate_heads or self.rope_scaling is not None)

    @property
    def wanted(self) -> bool:
        return self.active or self.baseline

    def describe(self) -> str:
        parts = []
        if self.positions:
            parts.append(f"{len(self.positions)} positions given")
        if self.shift:
            parts.append(f"shift {self.shift}")
        if self.stretch != 1.0:
            parts.append(f"stretch {self.stretch:g}")
        if self.positional_off:
            parts.append("encoding off in layers " + ",".join(map(str, self.positional_off)))
        if self.ablate_heads:
            parts.append("heads ablated " + ",".join(f"{lay}.{h}" for lay, h in self.ablate_heads))
        if self.rope_scaling is not None:
            parts.append(rope_request.describe(self.rope_scaling))
        return "; ".join(parts) or "none"


def _int(key: str, value: Any, least: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or float(value) != int(value):
        raise _bad(key, f"{value!r} is not an integer")
    if least is not None and int(value) < least:
        raise _bad(key, f"{int(value)} must be >= {least}")
    return int(value)


def parse(obj: Any) -> Intervention:
    """An intervention from a JSON object (the HTTP fronts, KServe's parameters): keys as FIELDS; ablate_heads as
    [[layer, head], ...] or ["layer.head", ...]; rope_scaling a rope_parameters object (or its JSON text)."""
    if obj is None:
        return Intervention()
    if not isinstance(obj, Mapping):
        raise _bad("", "must be an object") from None
    unknown = sorted(set(obj) - set(FIELDS))
    if unknown:
        raise _bad(unknown[0], f"unknown field; an intervention takes {', '.join(FIELDS)}")
    positions = obj.get("positions") or ()
    if not isinstance(positions, (list, tuple)):
        raise _bad("positions", "must be a list of integers")
    heads = []
    for h in obj.get("ablate_heads") or ():
        if isinstance(h, str) and h.count(".") == 1:
            h = h.split(".")
        if not isinstance(h, (list, tuple)) or len(h) != 2:
            raise _bad("ablate_heads", f"{h!r} is not a [layer, head] pair")
        heads.append((_int("ablate_heads", h[0] if not isinstance(h[0], str) else _digits(h[0])),
                      _int("ablate_heads", h[1] if not isinstance(h[1], str) else _digits(h[1]))))
    stretch = obj.get("stretch", 1.0)
    if stretch is None:
        stretch = 1.0
    if isinstance(stretch, bool) or not isinstance(stretch, (int, float)) or not 0 < float(stretch) < 1e6:
        raise _bad("stretch", f"{stretch!r} must be a number > 0")
    scaling = obj.get("rope_scaling")
    if isinstance(scaling, str):
        try:
            scaling = json.loads(scaling) if scaling.strip() else None
        except ValueError:
            raise _bad("rope_scaling", "is not a JSON object") from None
    off = obj.get("positional_off") or ()
    if not isinstance(off, (list, tuple)):
        raise _bad("positional_off", "must be a list of layer indices")
    baseline = obj.get("baseline", False)
    if not isinstance(baseline, bool):
        raise _bad("baseline", "must be true or false")
    nxt = obj.get("next_position")
    return Intervention(tuple(_int("positions", p) for p in positions), _int("shift", obj.get("shift") or 0),
                        float(stretch), None if nxt is None else _int("next_position", nxt),
                        tuple(_int("positional_off", x) for x in off), tuple(heads),
                        None if scaling is None else rope_request.parse(scaling), baseline)


def _digits(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise _bad("ablate_heads", f"{text!r} is not an integer") from None


@dataclass
class Row:
    """One row of an intervention call: its tokens and the graph's per-row inputs."""

    ids: list[int]
    positions: np.ndarray  # (T,) int64
    on: np.ndarray  # (L,) float32
    keep: np.ndarray  # (L, H) float32
    rope: tuple[np.ndarray, float, float] | None = None  # (inv_freq, factor, use)
    scaling: RopeRequest | None = field(default=None, repr=False)


def entry(model: LoadedModel) -> Intervene:
    """The model's intervention graph entry; FAILED_PRECONDITION when it has none (exported without one, or a
    copy whose model.onnx changed)."""
    spec = model.meta.intervene
    if spec is None or model.intervene is None:
        raise FailedPrecondition(f"model {model.name!r} has no intervention graph (exported with --interventions off, "
                                 "before interventions existed, or a quantized copy); re-export it to intervene")
    return spec


def resolve(model: LoadedModel, edit: Intervention, ids: Sequence[int], limit: int | None,
            neutral: bool = False) -> Row:
    """The graph's inputs for one prompt under `edit` (or, `neutral`, under none): INVALID_ARGUMENT naming the field
    the model cannot take."""
    spec = entry(model)
    L, H, T = model.n_layers, model.n_heads, len(ids)
    if neutral:
        edit = Intervention()
    positions = _positions(model, edit, T, spec.positions)
    last = int(positions.max()) if T else 0
    if limit is not None and last >= limit:
        raise _bad("positions", f"position {last} is past model {model.name}'s {limit} positions (0 .. {limit - 1})"
                   + ("; the worker's --long-context 1 allows more" if model.max_positions is None else ""))
    on = np.ones(L, np.float32)
    if edit.positional_off:
        if not spec.in_layers:
            raise _bad("positional_off", f"model {model.name}'s encoding ({model.meta.variant}) is not computed inside "
                       "its layers (it is added to the embeddings, or there is none): no layer's can be switched off")
        for layer in edit.positional_off:
            if not 0 <= layer < L:
                raise _bad("positional_off", f"layer {layer} is out of range [0, {L})")
            mixer = model.meta.layers[layer].mixer if layer < len(model.meta.layers) else "attention"
            if mixer != "attention":
                raise _bad("positional_off", f"layer {layer} of model {model.name} is a {mixer} mixer: its order is "
                           "its own computation (docs/mixers.md), not an encoding to switch off")
            on[layer] = 0.0
    keep = np.ones((L, H), np.float32)
    for layer, head in edit.ablate_heads:
        if not 0 <= layer < L:
            raise _bad("ablate_heads", f"layer {layer} is out of range [0, {L})")
        if not 0 <= head < H:
            raise _bad("ablate_heads", f"head {head} is out of range [0, {H})")
        keep[layer, head] = 0.0
    rope = None
    if spec.rope:
        rope = (np.zeros(spec.rope_pairs, np.float32), 1.0, 0.0)
        if edit.rope_scaling is not None:
            inv, factor = rope_request.frequencies(edit.rope_scaling, model.meta.config, np.asarray([last + 1]))
            if inv.shape[-1] != spec.rope_pairs:
                raise _bad("rope_scaling", f"gives {inv.shape[-1]} frequencies; model {model.name} rotates "
                           f"{spec.rope_pairs} pairs")
            rope = (inv[0].astype(np.float32), float(factor[0]), 1.0)
    elif edit.rope_scaling is not None:
        raise _bad("rope_scaling", f"model {model.name} ({model.meta.variant}) has no RoPE layer that rotates with "
                   "the model's scaling")
    return Row(list(ids), positions, on, keep, rope, edit.rope_scaling)


def _positions(model: LoadedModel, edit: Intervention, T: int, by_index: bool) -> np.ndarray:
    given = edit.positions or edit.shift or edit.stretch != 1.0 or edit.next_position is not None
    if given and not by_index:
        raise _bad("positions", f"model {model.name}'s encoding ({model.meta.variant}) is not a function of the "
                   "position index: it takes no positions")
    if edit.positions:
        if len(edit.positions) != T:
            raise _bad("positions", f"{len(edit.positions)} positions for a prompt of {T} tokens (one per token)")
        if edit.shift or edit.stretch != 1.0:
            raise _bad("positions", "give positions, or shift and stretch, not both")
        out = np.asarray(edit.positions, np.int64)
    else:
        out = edit.shift + np.rint(np.arange(T) * edit.stretch).astype(np.int64)
    if T and out.min() < 0:
        raise _bad("positions" if edit.positions else "shift", f"position {int(out.min())} is negative")
    return out


def next_positions(row: Row, count: int, first: int | None) -> np.ndarray:
    """The positions of `count` generated tokens after the row's prompt: from `first` (default: the last + 1)."""
    start = int(row.positions[-1]) + 1 if first is None else first
    return start + np.arange(count, dtype=np.int64)


def feeds(model: LoadedModel, rows: Sequence[Row], new: Sequence[np.ndarray], past_len: int,
          past: Sequence[np.ndarray] | None, past_positions: Sequence[np.ndarray],
          past_mask: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """The graph's inputs for rows whose new tokens `new` (each (T_b,)) follow `past_len` cached slots each (real
    where `past_mask` (B, past_len) is 1; every one without it), at the given positions (past_positions[b]: every
    slot's, past and new); the new tokens left-padded to the longest."""
    spec = entry(model)
    B, T = len(rows), max(len(n) for n in new)
    ids = np.zeros((B, T), np.int64)
    mask = np.zeros((B, past_len + T), np.int64)
    pos = np.zeros((B, past_len + T), np.int64)
    for b, (tokens, row) in enumerate(zip(new, rows, strict=True)):
        n = len(tokens)
        ids[b, T - n:] = tokens
        mask[b, :past_len] = 1 if past_mask is None else past_mask[b]
        mask[b, past_len + T - n:] = 1
        pos[b, :past_len] = past_positions[b][:past_len] if past_len else 0
        pos[b, past_len + T - n:] = row.positions if past_len == 0 else past_positions[b][past_len:past_len + n]
    out = {"input_ids": ids, "attention_mask": mask, "position_ids": pos,
           "positional_on": np.stack([r.on for r in rows]), "head_keep": np.stack([r.keep for r in rows])}
    if spec.rope:
        out["rope_inv_freq"] = np.stack([r.rope[0] for r in rows if r.rope is not None])
        out["rope_attention_factor"] = np.asarray([r.rope[1] for r in rows if r.rope is not None], np.float32)
        out["rope_override"] = np.asarray([r.rope[2] for r in rows if r.rope is not None], np.float32)
    for s in model.meta.state:
        if past is not None:
            continue
        decl = next(i for i in model.meta.inputs if i.name == s.input)
        shape = [B if d == decl.shape[0] else (0 if isinstance(d, str) else int(d)) for d in decl.shape]
        out[s.input] = np.zeros(shape, np.float32)
    if past is not None:
        out.update({s.input: t for s, t in zip(model.meta.state, past, strict=True)})
    return out


def run(model: LoadedModel, rows: Sequence[Row], maps: bool = False, profile: bool = False,
        new: Sequence[np.ndarray] | None = None, past: Sequence[np.ndarray] | None = None,
        past_positions: Sequence[np.ndarray] = (), past_mask: np.ndarray | None = None,
        exact: bool = False) -> dict[str, np.ndarray]:
    """One call of the intervention graph (its profile graph with `profile`, its maps graph with `exact`, that one's
    profile graph with both): its outputs by name (attentions and mixer_maps only with `maps`).  Without `new`,
    each row's whole prompt runs from an empty cache."""
    entry(model)
    lazy, what = {(False, False): (model.intervene, "intervention"),
                  (True, False): (model.intervene_profile, "intervention profile"),
                  (False, True): (model.intervene_maps, "mixer maps"),
                  (True, True): (model.intervene_maps_profile, "mixer profile")}[profile, exact]
    if lazy is None:
        raise FailedPrecondition(f"model {model.name!r} has no {what} graph")
    session = lazy.get()
    tokens = new if new is not None else [np.asarray(r.ids, np.int64) for r in rows]
    past_len = 0 if past is None else _past_length(model, past)
    names = [o.name for o in session.get_outputs() if maps or o.name not in ("attentions", "mixer_maps")]
    values = session.run(names, feeds(model, rows, tokens, past_len, past, past_positions, past_mask))
    return dict(zip(names, values, strict=True))


def _past_length(model: LoadedModel, past: Sequence[np.ndarray]) -> int:
    for s, t in zip(model.meta.state, past, strict=True):
        if s.sequence_axis is not None:
            return int(t.shape[s.sequence_axis])
    return 0
