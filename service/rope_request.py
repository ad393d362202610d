"""A request's own RoPE scaling: the frequencies and the cos/sin multiplier of one call, computed in numpy.

A request may ask a RoPE model to run one call under another scaling than its own: any type model/rope_scaling/
registers, with its parameters, or a new base theta. The request writes it as transformers' rope_parameters keys,
e.g. {"rope_type": "yarn", "factor": 4, "original_max_position_embeddings": 2048}, or {"rope_theta": 50000} alone
for the unscaled rotation at another base. The intervention graph takes, per batch row, the frequencies
(`rope_inv_freq`, (B, d_rot/2) float32) and the multiplier of cos and sin (`rope_attention_factor`, (B,) float32) of
the layers that rotate with the model's own scaling; `frequencies` computes both.

This module is the worker's torch-free statement of the scaling types (docs/rope-scaling.md has each formula and its
source): model/rope_scaling/ is the exporter's, in torch, which the worker may not import. Everything is float32
numpy arithmetic in the order transformers' modeling_rope_utils writes it, each power correctly rounded to float32
(`_pow`); tests/service/test_rope_request.py holds every type to transformers' own ROPE_INIT_FUNCTIONS (posenc's
own ntk to model.rope_scaling) and to model.rope_scaling's frequencies for the same config.

What the model gives: the rotated width d_rot (ModelConfig.rope_dim: the graph's input width, which a request cannot
change: proportional spans the whole head, the others int(head_dim * rope_fraction)), its base (unless rope_theta
names another), its rope_fraction (proportional's share of turning pairs) and its lengths; nothing of its own
scaling (a yarn model's beta_fast is not a yarn request's). L0, the length the weights were trained at, is the
request's original_max_position_embeddings, else the model's rope_original_context, else its context. dynamic reads
L0 where transformers reads max_position_embeddings; a request names it original_max_position_embeddings. A missing
longrope factor is the model's context / L0 (transformers' max_position_embeddings /
original_max_position_embeddings); the keys transformers requires (factor, llama3's low_freq_factor and
high_freq_factor, longrope's lists) a request must give.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from model.config import ModelConfig
from service.errors import InvalidArgument

FIELD = "rope_scaling"  # the request's field: errors name rope_scaling.<key>
Floats = npt.NDArray[np.float32]

# Per transformers rope_type, the keys it reads beside rope_type and rope_theta (model/rope_scaling/'s `keys`; a
# test holds the two equal).  ntk is posenc's own static NTK-aware base.
YARN = ("factor", "original_max_position_embeddings", "attention_factor", "beta_fast", "beta_slow", "mscale",
        "mscale_all_dim", "truncate")
TYPES: dict[str, tuple[str, ...]] = {
    "default": (),
    "linear": ("factor",),
    "ntk": ("factor",),
    "dynamic": ("factor", "original_max_position_embeddings"),
    "yarn": YARN,
    "llama3": ("factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor"),
    "longrope": ("factor", "original_max_position_embeddings", "attention_factor", "short_factor", "long_factor"),
    "proportional": ("factor",),
}
COMMON = ("rope_type", "rope_theta")
# what transformers' validation requires beside rope_type (L0 has the model's default)
REQUIRED = {"linear": ("factor",), "ntk": ("factor",), "dynamic": ("factor",), "yarn": ("factor",),
            "llama3": ("factor", "low_freq_factor", "high_freq_factor"), "longrope": ("short_factor", "long_factor")}
LENGTH_DEPENDENT = frozenset({"dynamic", "longrope"})  # frequencies follow each row's length (last position + 1)
NEEDS_ORIGINAL = frozenset({"dynamic", "yarn", "llama3", "longrope"})  # they read L0
POSENC_NAME = {"default": "none"}  # ModelConfig.rope_scaling's name where it is not the rope_type


@dataclass(frozen=True)
class RopeRequest:
    """One request's scaling, as parsed (None: the model's value, or the type's default when it has one)."""

    rope_type: str = "default"
    rope_theta: float | None = None  # the base; None: the model's rope_base
    factor: float | None = None  # None: 1 (proportional), the model's context / L0 (longrope)
    original_max_position_embeddings: int | None = None  # L0; None: the model's
    attention_factor: float | None = None  # None: the type's rule
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 0.0
    mscale_all_dim: float = 0.0
    truncate: bool = True
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()

    @property
    def length_dependent(self) -> bool:
        """Its frequencies follow the length each row's call sees: a prompt then runs whole, in one call."""
        return self.rope_type in LENGTH_DEPENDENT


def _bad(key: str | None, why: str) -> InvalidArgument:
    name = f"{FIELD}.{key}" if key else FIELD
    err = InvalidArgument(f"{name} {why}")
    err.param = name
    return err


def _number(key: str, value: Any, *, above: float | None = None, least: float | None = None) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise _bad(key, f"must be a finite number, got {value!r}")
    if above is not None and not value > above:
        raise _bad(key, f"must be > {above:g}, got {value!r}")
    if least is not None and not value >= least:
        raise _bad(key, f"must be >= {least:g}, got {value!r}")
    return float(value)


def _factors(key: str, value: Any) -> tuple[float, ...]:
    if not isinstance(value, list) or not value:
        raise _bad(key, f"must be a non-empty list of numbers, one per rotated pair, got {value!r}")
    return tuple(_number(f"{key}[{i}]", v, above=0.0) for i, v in enumerate(value))


def parse(obj: Any) -> RopeRequest:
    """A request's rope_scaling object (transformers' rope_parameters keys) as a RopeRequest; InvalidArgument, one
    line naming rope_scaling.<key>, for an unknown type or key, a wrong type, a non-finite or out-of-range number or
    a missing required parameter.  What depends on the model (list lengths, the rotated width) is `check`'s."""
    if not isinstance(obj, Mapping):
        raise _bad(None, f"must be an object of rope parameters (transformers' rope_parameters keys), got {obj!r}")
    kind = obj.get("rope_type", "default")
    if not isinstance(kind, str) or kind not in TYPES:
        raise _bad("rope_type", f"must be one of {', '.join(TYPES)}, got {kind!r}")
    for key in obj:
        if key in COMMON or key in TYPES[kind]:
            continue
        users = [t for t, keys in TYPES.items() if key in keys]
        why = f"used by {', '.join(users)}" if users else f"not a rope parameter (known: {', '.join(COMMON)}, " \
            f"{', '.join(dict.fromkeys(k for keys in TYPES.values() for k in keys))})"
        raise _bad(str(key), f"is not used by rope_type {kind!r} ({why})")
    for key in REQUIRED.get(kind, ()):
        if obj.get(key) is None:
            raise _bad(key, f"is required with rope_type {kind!r}")
    given = {k: v for k, v in obj.items() if v is not None and k != "rope_type"}
    out: dict[str, Any] = {"rope_type": kind}
    if "rope_theta" in given:
        out["rope_theta"] = _number("rope_theta", given["rope_theta"], above=1.0)
    if "factor" in given:
        # longrope's factor only sets its attention factor, 1 at or below 1 (transformers); the others scale by it
        out["factor"] = (max(_number("factor", given["factor"], above=0.0), 1.0) if kind == "longrope"
                         else _number("factor", given["factor"], least=1.0))
    if "original_max_position_embeddings" in given:
        value = given["original_max_position_embeddings"]
        if _number("original_max_position_embeddings", value, above=1.0) != int(value):
            raise _bad("original_max_position_embeddings", f"must be a whole number of positions, got {value!r}")
        out["original_max_position_embeddings"] = int(value)
    if "attention_factor" in given:
        out["attention_factor"] = _number("attention_factor", given["attention_factor"], above=0.0)
    for key in ("beta_fast", "beta_slow", "low_freq_factor", "high_freq_factor"):
        if key in given:
            out[key] = _number(key, given[key], above=0.0)
    for key in ("mscale", "mscale_all_dim"):
        if key in given:
            out[key] = _number(key, given[key], least=0.0)
    if "truncate" in given:
        if not isinstance(given["truncate"], bool):
            raise _bad("truncate", f"must be true or false, got {given['truncate']!r}")
        out["truncate"] = given["truncate"]
    for key in ("short_factor", "long_factor"):
        if key in given:
            out[key] = _factors(key, given[key])
    req = RopeRequest(**out)
    if req.beta_fast < req.beta_slow:
        raise _bad("beta_fast", f"must be >= beta_slow ({req.beta_slow:g}), got {req.beta_fast:g}")
    if req.high_freq_factor <= req.low_freq_factor:
        raise _bad("high_freq_factor", f"must exceed low_freq_factor ({req.low_freq_factor:g}), "
                                       f"got {req.high_freq_factor:g}")
    return req


@dataclass(frozen=True)
class _Setting:
    """A request resolved against one model: every number the formulas read."""

    req: RopeRequest
    base: float
    dim: int  # d_rot
    head_dim: int
    fraction: float
    original: int  # L0
    factor: float


def _resolve(req: RopeRequest, config: Mapping[str, Any]) -> _Setting:
    cfg = ModelConfig.from_dict(dict(config))
    dim = cfg.replace(rope_scaling=POSENC_NAME.get(req.rope_type, req.rope_type)).rope_dim  # the request's width
    if dim != cfg.rope_dim:
        raise _bad("rope_type", f"{req.rope_type!r} would rotate {dim} dims of each head where this model rotates "
                                f"{cfg.rope_dim} (its scaling is {cfg.rope_scaling}); a request cannot change that")
    if dim < 4 and req.rope_type in ("ntk", "dynamic"):  # their exponent d / (d - 2)
        raise _bad("rope_type", f"{req.rope_type!r} needs at least 4 rotated dims, this model rotates {dim}")
    original = req.original_max_position_embeddings or cfg.rope_original_context or cfg.context
    factor = req.factor
    if factor is None:  # longrope: transformers' max_position_embeddings / original (1 and below mean 1)
        factor = max(cfg.context / original, 1.0) if req.rope_type == "longrope" else 1.0
    for key in ("short_factor", "long_factor"):
        got = len(getattr(req, key))
        if req.rope_type == "longrope" and got != dim // 2:
            raise _bad(key, f"must hold one number per rotated pair ({dim // 2} for this model), got {got}")
    return _Setting(req, float(req.rope_theta or cfg.rope_base), dim, cfg.head_dim, float(cfg.rope_fraction),
                    int(original), float(factor))


def check(req: RopeRequest, config: Mapping[str, Any]) -> None:
    """InvalidArgument naming the field where the request cannot run on the model whose ModelConfig.to_dict() is
    `config` (model.json's config): a type that changes the rotated width, longrope lists of another length."""
    _resolve(req, config)


def _f32(x: npt.NDArray[Any]) -> Floats:
    """`x`, which float32 arithmetic made (numpy's stubs type it float64): a TypeError if it ever is not."""
    if x.dtype != np.float32:
        raise TypeError(f"float32 arithmetic gave {x.dtype}")
    return x


def _pow(base: npt.ArrayLike, exponent: npt.ArrayLike) -> Floats:
    """base ** exponent of float32 operands, correctly rounded to float32 (computed in float64).  numpy's float32
    pow misses it by a step in the last bit more often than torch's (transformers'), which misses it now and then."""
    wide = np.asarray(base, np.float32).astype(np.float64), np.asarray(exponent, np.float32).astype(np.float64)
    power = np.power(*wide)
    return _f32(power.astype(np.float32))


def _exponent(dim: int) -> Floats:
    """arange(0, d, 2) / d in float32, as transformers writes it."""
    return np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)


def _default(base: float | Floats, dim: int) -> Floats:
    """theta_i = 1 / base^(2i/d): (d/2,) for one base, (B, d/2) for (B,) bases (base^(-2i/d) rounds otherwise)."""
    b = np.asarray(base, dtype=np.float32)
    return _f32(np.float32(1.0) / _pow(b[:, None] if b.ndim else b, _exponent(dim)))


def _yarn(s: _Setting) -> Floats:
    dim, base, L0 = s.dim, s.base, s.original

    def pair_index(rotations: float) -> float:  # the pair that turns `rotations` times over L0
        return dim * math.log(L0 / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = pair_index(s.req.beta_fast), pair_index(s.req.beta_slow)
    if s.req.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
    keep = np.float32(1) - ramp  # 1: the pair keeps its frequency (extrapolates); 0: it is interpolated by s
    powers = _pow(np.float32(base), np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim))
    one = np.float32(1.0)
    return _f32(one / (np.float32(s.factor) * powers) * (one - keep) + one / powers * keep)


def _llama3(s: _Setting) -> Floats:
    theta = _default(s.base, s.dim)
    f, L0 = np.float32(s.factor), s.original
    low, high = s.req.low_freq_factor, s.req.high_freq_factor
    wavelength = np.float32(2 * math.pi) / theta
    slow_edge, fast_edge = np.float32(L0 / low), np.float32(L0 / high)
    slowed = np.where(wavelength > slow_edge, theta / f, theta)
    t = (np.float32(L0) / wavelength - np.float32(low)) / np.float32(high - low)
    blend = (np.float32(1) - t) * slowed / f + t * slowed
    middle = ~(wavelength < fast_edge) & ~(wavelength > slow_edge)
    return _f32(np.where(middle, blend, slowed))


def _proportional(s: _Setting) -> Floats:
    turning = int(s.fraction * s.head_dim // 2)  # transformers: int(partial_rotary_factor * head_dim // 2)
    exponent = np.arange(0, 2 * turning, 2, dtype=np.int64).astype(np.float32) / np.float32(s.head_dim)
    theta = np.float32(1.0) / _pow(np.float32(s.base), exponent)
    still = np.zeros(s.head_dim // 2 - turning, dtype=np.float32)
    return _f32(np.concatenate((theta, still)) / np.float32(s.factor))


def _static(s: _Setting) -> Floats:
    """(d/2,) frequencies of a type that does not follow the length."""
    kind, dim = s.req.rope_type, s.dim
    if kind == "linear":
        return _default(s.base, dim) / np.float32(s.factor)
    if kind == "ntk":  # base' = base s^(d/(d-2)): the slowest pair slows by s
        return _default(s.base * s.factor ** (dim / (dim - 2)), dim)
    if kind == "yarn":
        return _yarn(s)
    if kind == "llama3":
        return _llama3(s)
    if kind == "proportional":
        return _proportional(s)
    return _default(s.base, dim)  # default: unscaled (at the request's base, where it names one)


def _by_length(s: _Setting, lengths: npt.NDArray[np.int64]) -> Floats:
    """(B, d/2) frequencies of a type that follows each row's length."""
    dim, L0 = s.dim, s.original
    if s.req.rope_type == "dynamic":  # transformers: base * ((s n / L0) - (s - 1)) ** (d / (d - 2)), n >= L0
        n = np.maximum(lengths, L0).astype(np.float32)
        f = np.float32(s.factor)
        stretch = _pow(f * n / np.float32(L0) - np.float32(s.factor - 1), np.float32(dim / (dim - 2)))
        return _default(np.float32(s.base) * stretch, dim)
    factors = np.where((lengths > L0)[:, None], np.asarray(s.req.long_factor, np.float32)[None],
                       np.asarray(s.req.short_factor, np.float32)[None])  # longrope: (B, d/2)
    powers = _pow(np.float32(s.base), _exponent(dim))
    return _f32(np.float32(1.0) / (factors * powers))


def _attention_factor(s: _Setting) -> float:
    req, f = s.req, s.factor
    if req.attention_factor is not None:
        return req.attention_factor
    if req.rope_type == "yarn":
        if req.mscale and req.mscale_all_dim:
            return float(_mscale(f, req.mscale) / _mscale(f, req.mscale_all_dim))
        return _mscale(f)
    if req.rope_type == "longrope":
        return 1.0 if f <= 1 else math.sqrt(1 + math.log(f) / math.log(s.original))
    return 1.0


def _mscale(scale: float, k: float = 1.0) -> float:
    """YaRN's attention temperature 0.1 k ln s + 1 (1 when s <= 1)."""
    return 1.0 if scale <= 1 else 0.1 * k * math.log(scale) + 1.0


def frequencies(req: RopeRequest, config: Mapping[str, Any], lengths: npt.ArrayLike) -> tuple[Floats, Floats]:
    """For B rows whose calls see `lengths` (B,) (each row's last position + 1, read by dynamic and longrope): the
    frequencies (B, d_rot/2) float32 and the cos/sin multiplier (B,) float32 of the model whose ModelConfig.to_dict()
    is `config` under the request's scaling.  InvalidArgument as `check` says."""
    n = np.asarray(lengths)
    if n.ndim != 1 or not np.issubdtype(n.dtype, np.integer) or (n < 1).any():
        raise ValueError(f"lengths must be (B,) integers >= 1, got {n!r}")
    s = _resolve(req, config)
    if req.length_dependent:
        inv = _by_length(s, n.astype(np.int64))
    else:
        inv = np.tile(_static(s), (len(n), 1))
    factor = np.full(len(n), _attention_factor(s), dtype=np.float32)
    return np.ascontiguousarray(inv, dtype=np.float32), factor


def describe(req: RopeRequest, config: Mapping[str, Any] | None = None) -> str:
    """One line for people, e.g. "yarn x4 of 2048 positions, base 10000, attention factor 1.1386"; with `config`
    (model.json's) the model's values fill what the request leaves to it."""
    s = _resolve(req, config) if config is not None else None
    base = f"base {s.base:g}" if s else f"base {req.rope_theta:g}" if req.rope_theta else "the model's base"
    if req.rope_type == "default":
        return f"default (unscaled), {base}"
    factor = s.factor if s else req.factor
    text = req.rope_type + (f" x{factor:g}" if factor is not None else "")
    if req.rope_type in NEEDS_ORIGINAL:
        original = s.original if s else req.original_max_position_embeddings
        text += f" of {original} positions" if original else " of the model's original length"
    text += f", {base}"
    if s:
        af = _attention_factor(s)
        text += f", attention factor {af:.4f}" if af != 1.0 else ""
    elif req.attention_factor is not None:
        text += f", attention factor {req.attention_factor:.4f}"
    return text + (" (frequencies follow each row's length)" if req.length_dependent else "")
