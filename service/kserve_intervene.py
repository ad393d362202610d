"""KServe v2 ModelInfer (gRPC and REST) under a position intervention (service/intervention.py).

A request intervenes when it sends the optional input `position_ids` INT64 [batch, seq] (one position per token,
the shape of input_ids; the positions of padded slots, attention_mask 0, are ignored) or any of the request
parameters in PARAMETERS:

- `shift` (an integer) and `stretch` (a number > 0): token i of each row sits at shift + round(i * stretch);
- `positional_off`: layers whose positional computation is removed, comma-separated ("1,3"; an integer for one);
- `ablate_heads`: heads whose output is zeroed, comma-separated layer.head pairs ("0.2,1.0");
- `rope_scaling`: another RoPE scaling for the call, transformers' rope_parameters as JSON text.

Every row is resolved against the model with its own positions (intervention.resolve), and all rows run in one
call of the intervention graph (intervention.run), left-padded to the longest row's real tokens, so each row's
answer is the answer of that row alone; the outputs come back in the caller's layout, as the plain path's do
(service.operations.Operations.infer, service.profile.batch): zero at padded positions.  The call runs on the
request's thread, never in the engine's batches, as every intervention call does."""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import numpy as np

from service import intervention
from service.artifacts import LoadedModel
from service.errors import DeadlineExceeded, InvalidArgument
from service.intervention import Intervention, Row
from service.operations import Operations
from service.profile import first_row

POSITION_IDS = "position_ids"
PARAMETERS = ("shift", "stretch", "positional_off", "ablate_heads", "rope_scaling")


def _bad(name: str, why: str) -> InvalidArgument:
    err = InvalidArgument(f"{name}: {why}")
    err.param = name.split()[-1]
    return err


def takes_positions(m: LoadedModel) -> bool:
    """Whether the model's intervention graph takes positions (ModelMetadata lists position_ids only then)."""
    return m.intervene is not None and m.meta.intervene is not None and m.meta.intervene.positions


def wanted(positions: np.ndarray | None, parameters: Mapping[str, Any]) -> bool:
    return positions is not None or any(p in parameters for p in PARAMETERS)


def _number(name: str, value: Any, integer: bool) -> int | float:
    if isinstance(value, str):
        try:
            value = int(value) if integer else float(value)
        except ValueError:
            raise _bad(f"parameter {name}", f"{value!r} is not {'an integer' if integer else 'a number'}") from None
    if isinstance(value, bool) or not isinstance(value, int | float) or (integer and not isinstance(value, int)):
        raise _bad(f"parameter {name}", f"{value!r} is not {'an integer' if integer else 'a number'}")
    return value


def _items(name: str, value: Any) -> list[str]:
    """A comma-separated list parameter's items (an integer is one item)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return [str(value)]
    if not isinstance(value, str):
        raise _bad(f"parameter {name}", f"{value!r} is not a comma-separated list")
    return [x.strip() for x in value.split(",") if x.strip()]


def edit_of(parameters: Mapping[str, Any]) -> Intervention:
    """The intervention the request's parameters ask for (positions aside: they come as an input)."""
    obj: dict[str, Any] = {}
    if "shift" in parameters:
        obj["shift"] = _number("shift", parameters["shift"], True)
    if "stretch" in parameters:
        obj["stretch"] = _number("stretch", parameters["stretch"], False)
    if "positional_off" in parameters:
        layers = _items("positional_off", parameters["positional_off"])
        if not all(x.lstrip("-").isdigit() for x in layers):
            raise _bad("parameter positional_off", f"{parameters['positional_off']!r} is not comma-separated layer "
                       "indices (\"1,3\")")
        obj["positional_off"] = [int(x) for x in layers]
    if "ablate_heads" in parameters:
        obj["ablate_heads"] = _items("ablate_heads", parameters["ablate_heads"])
    if "rope_scaling" in parameters:
        text = parameters["rope_scaling"]
        if not isinstance(text, str):
            raise _bad("parameter rope_scaling", "must be a string: rope_parameters as JSON text")
        obj["rope_scaling"] = text
    try:
        return intervention.parse(obj)
    except InvalidArgument as err:
        raise _renamed(err, False, Intervention()) from None


def _renamed(err: InvalidArgument, given: bool, edit: Intervention) -> InvalidArgument:
    """An intervention error (naming `intervention.<field>`) as KServe names the field: the input position_ids, or
    the request parameter."""
    key = (err.param or "").removeprefix("intervention.")
    if key == "positions":
        name = f"input {POSITION_IDS}" if given else "parameter " + ("shift" if edit.shift else "stretch")
    else:
        name = f"parameter {key}"
    return _bad(name, str(err).split(": ", 1)[-1])


def rows_of(ops: Operations, m: LoadedModel, ids: np.ndarray, mask: np.ndarray, positions: np.ndarray | None,
            edit: Intervention) -> list[Row]:
    """Each row's graph inputs: its real tokens (mask 1) at its own positions (position_ids' real slots, or the
    parameters' shift and stretch), with the parameters' switches, ablations and scaling; INVALID_ARGUMENT naming the
    input or the parameter the model cannot take."""
    spec = intervention.entry(m)  # FAILED_PRECONDITION for a model without an intervention graph
    limit = ops.position_limit(m)
    where = f"input {POSITION_IDS}"
    if positions is not None:
        if not spec.positions:
            raise _bad(where, f"model {m.name}'s encoding ({m.meta.variant}) is not a function of the position index: "
                       "it takes no positions")
        if positions.shape != ids.shape:
            raise _bad(where, f"shape {list(positions.shape)} differs from input_ids {list(ids.shape)} (one position "
                       "per token)")
        if edit.shift or edit.stretch != 1.0:
            raise _bad(where, "give position_ids, or the parameters shift and stretch, not both")
        real = positions[mask == 1]
        if real.min() < 0:
            b, t = np.argwhere((positions < 0) & (mask == 1))[0]
            raise _bad(where, f"position {int(positions[b, t])} (row {b}, token {t}) is negative")
        if limit is not None and real.max() >= limit:
            b, t = np.argwhere((positions >= limit) & (mask == 1))[0]
            raise _bad(where, f"position {int(positions[b, t])} (row {b}, token {t}) is past model {m.name}'s "
                       f"{limit} positions (0 .. {limit - 1})"
                       + ("; the worker's --long-context 1 allows more" if m.max_positions is None else ""))
    rows = []
    for b in range(ids.shape[0]):
        real = np.flatnonzero(mask[b])
        toks = ops.tokens(m, None, ids[b, real].tolist())
        row_edit = edit if positions is None else replace(edit, positions=tuple(int(p) for p in positions[b, real]))
        try:
            rows.append(intervention.resolve(m, row_edit, toks, limit))
        except InvalidArgument as err:
            raise _renamed(err, positions is not None, edit) from None
    return rows


def infer(ops: Operations, name: str, rows: list[Row], mask: np.ndarray, outputs: list[str], profile_last: int,
          deadline: float | None) -> dict[str, np.ndarray]:
    """logits (B, T, V), attentions (B, L, H, T, T) and profile (B, L, H, C), those `outputs` names, in the caller's
    layout (T: mask's width): each row's real tokens where its mask is 1, zero elsewhere.  A profile averages each
    row's last `profile_last` query rows (0: all) with every column of the graph, as service.profile.batch does."""
    with ops.registry.acquire(name) as served:
        m = served.model
        B, T = mask.shape
        real = [np.flatnonzero(keep) for keep in mask]
        width = max(len(r) for r in real)  # the graph's rows: left-padded to the longest row
        out: dict[str, np.ndarray] = {}
        maps = "attentions" in outputs
        if maps or "logits" in outputs:
            if deadline is not None and time.monotonic() > deadline:
                raise DeadlineExceeded("the request's deadline passed before its intervention call")
            got = intervention.run(m, rows, maps=maps)
            logits = np.zeros((B, T, m.vocab_size), np.float32)
            att = np.zeros((B, m.n_layers, m.n_heads, T, T), np.float32) if maps else None
            for b, r in enumerate(real):
                at = slice(width - len(r), width)
                logits[b, r] = got["logits"][b, at]
                if att is not None:
                    cells = np.ix_(np.arange(m.n_layers), np.arange(m.n_heads), r, r)
                    att[b][cells] = got["attentions"][b][:, :, at, at]
            out["logits"] = logits
            if att is not None:
                out["attentions"] = att
        if "profile" in outputs:
            if deadline is not None and time.monotonic() > deadline:
                raise DeadlineExceeded("the request's deadline passed before its intervention call")
            per_row = intervention.run(m, rows, profile=True)["profile"]  # (B, width, L, H, C): each query row's
            out["profile"] = np.stack([
                per_row[b, width - len(r) + first_row(profile_last, len(r)):].mean(axis=0, dtype=np.float64)
                for b, r in enumerate(real)]).astype(np.float32)
        return out
