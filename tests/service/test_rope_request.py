"""A request's own RoPE scaling (service/rope_request.py): the worker's numpy frequencies and attention factor for
every scaling type against transformers' own ROPE_INIT_FUNCTIONS on a transformers config with the same values
(posenc's own ntk, absent there, against model.rope_scaling and its defining property), against the exporter's
torch model.rope_scaling on a ModelConfig read from the same request, and the refusals, each naming its field.

dynamic and longrope follow the length a row's call sees; each row is compared with transformers computing that
length alone, below, at and past L0, as the rotary module's forward does (seq_len: a 0-d int64 tensor)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from model import rope_scaling
from model.config import ModelConfig
from service import rope_request
from service.errors import InvalidArgument

# Model shapes (ModelConfig fields): a fully rotated head at its trained context, a partly rotated one already
# scaled on import (L0 its rope_original_context), and proportional RoPE (pairs over the whole head, a quarter turn)
MODELS = {
    "full": {"d_model": 128, "n_heads": 4, "context": 128, "rope_base": 10000.0},
    "partial": {"d_model": 192, "n_heads": 4, "d_head": 48, "rope_fraction": 0.5, "context": 4096,
                "rope_base": 500000.0, "rope_scaling": "yarn", "rope_factor": 4.0, "rope_original_context": 1024},
    "proportional": {"d_model": 128, "n_heads": 4, "rope_fraction": 0.25, "rope_scaling": "proportional",
                     "rope_base": 1e6, "context": 256},
    "narrow": {"d_model": 8, "n_heads": 4, "context": 16},  # 2 rotated dims: no NTK exponent d / (d - 2)
}
LISTS = object()  # stands for longrope's short_factor and long_factor, one number per pair of the model
REQUESTS = {
    "default": [{}, {"rope_type": "default"}, {"rope_theta": 50000.0}, {"rope_type": "default", "rope_theta": 100}],
    "linear": [{"factor": 4}, {"factor": 2.5, "rope_theta": 1e6}],
    "ntk": [{"factor": 4.0}, {"factor": 8, "rope_theta": 5e5}],
    "dynamic": [{"factor": 4.0}, {"factor": 2, "original_max_position_embeddings": 64},
                {"factor": 8.0, "rope_theta": 1e5}],
    "yarn": [{"factor": 4.0},
             {"factor": 8.0, "original_max_position_embeddings": 32, "beta_fast": 8.0, "beta_slow": 0.5,
              "mscale": 0.707, "mscale_all_dim": 1.0, "truncate": False},  # DeepSeek's form
             {"factor": 4, "attention_factor": 0.8, "beta_fast": 16, "rope_theta": 2e4}],
    "llama3": [{"factor": 8.0, "original_max_position_embeddings": 64, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0},
               {"factor": 4, "low_freq_factor": 2.0, "high_freq_factor": 3.0}],
    "longrope": [{"short_factor": LISTS, "long_factor": LISTS, "original_max_position_embeddings": 64},
                 {"short_factor": LISTS, "long_factor": LISTS, "factor": 16.0},
                 {"short_factor": LISTS, "long_factor": LISTS},  # no factor: the model's context / L0
                 {"short_factor": LISTS, "long_factor": LISTS, "attention_factor": 1.3, "rope_theta": 3e4}],
    "proportional": [{}, {"factor": 2.0}, {"factor": 4, "rope_theta": 100.0}],
}
# which models each type runs on: proportional's pairs span the whole head, the others int(head_dim * fraction)
ON = {kind: ("full", "partial") for kind in REQUESTS} | {"proportional": ("full", "proportional")}
CASES = [pytest.param(model, kind, i, id=f"{model}-{kind}-{i}")
         for kind, requests in REQUESTS.items() for i in range(len(requests)) for model in ON[kind]]


def model_config(model: str) -> ModelConfig:
    return ModelConfig(**MODELS[model])


def request_obj(model: str, kind: str, i: int) -> dict:
    """The request as a client sends it, longrope's lists sized to the model's pairs."""
    pairs = model_config(model).rope_dim // 2
    lists = {"short_factor": [1.0 + 0.05 * j for j in range(pairs)],
             "long_factor": [1.0 + 0.7 * j for j in range(pairs)]}
    obj = {k: lists[k] if v is LISTS else v for k, v in REQUESTS[kind][i].items()}
    return obj if kind == "default" else {"rope_type": kind, **obj}


def original(model: str, obj: dict) -> int:
    """L0: the request's original_max_position_embeddings, else the model's rope_original_context, else its
    context."""
    cfg = model_config(model)
    return obj.get("original_max_position_embeddings") or cfg.rope_original_context or cfg.context


def lengths(model: str, obj: dict) -> np.ndarray:
    L0 = original(model, obj)
    return np.array([1, L0 - 1, L0, L0 + 1, 3 * L0, 7], dtype=np.int64)


def transformers_config(model: str, obj: dict):
    """A LlamaConfig with the model's sizes and the request's rope_parameters (L0 written out, the model's base
    where the request names none); max_position_embeddings is dynamic's L0, the model's context otherwise."""
    import transformers as tf

    cfg, kind = model_config(model), obj.get("rope_type", "default")
    params = {**obj, "rope_type": kind, "rope_theta": float(obj.get("rope_theta", cfg.rope_base)),
              "partial_rotary_factor": cfg.rope_fraction}
    if kind in ("yarn", "llama3", "longrope"):
        params["original_max_position_embeddings"] = original(model, obj)
    if kind == "dynamic":  # transformers' dynamic reads max_position_embeddings
        params.pop("original_max_position_embeddings", None)
    if kind == "proportional":
        params.setdefault("factor", 1.0)
    return tf.LlamaConfig(hidden_size=cfg.d_model, num_attention_heads=cfg.n_heads, head_dim=cfg.head_dim,
                          num_hidden_layers=1, intermediate_size=8, vocab_size=8, rope_parameters=params,
                          max_position_embeddings=original(model, obj) if kind == "dynamic" else cfg.context)


def transformers_frequencies(model: str, obj: dict, n: int) -> tuple[np.ndarray, float]:
    """transformers' frequencies and attention factor for a call that sees length n."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.gpt_neox.modeling_gpt_neox import GPTNeoXRotaryEmbedding

    hf, kind = transformers_config(model, obj), obj.get("rope_type", "default")
    if kind == "default":  # GPT-NeoX's default honours partial_rotary_factor (LLaMA's rotates the whole head)
        inv, factor = GPTNeoXRotaryEmbedding.compute_default_rope_parameters(hf)
    else:
        inv, factor = ROPE_INIT_FUNCTIONS[kind](hf, device=None, seq_len=torch.tensor(n))
    return inv.numpy(), factor


def exporter_frequencies(model: str, obj: dict, n: np.ndarray) -> tuple[np.ndarray, float]:
    """model.rope_scaling's (B, d/2) frequencies and attention factor, on the ModelConfig the exporter reads from
    the same rope_parameters (rope-scale's reading: from_hf, max_positions the model's context, dynamic's L0)."""
    cfg, kind = model_config(model), obj.get("rope_type", "default")
    params = {**obj, "rope_type": kind}
    L0 = original(model, obj)
    if kind in ("yarn", "llama3", "longrope"):
        params["original_max_position_embeddings"] = L0
    fields = rope_scaling.from_hf(params, max_positions=L0 if kind == "dynamic" else cfg.context, own=True)
    fields["rope_original_context"] = fields["rope_original_context"] or L0
    scaled = cfg.replace(**fields, rope_base=float(obj.get("rope_theta", cfg.rope_base)))
    inv = rope_scaling.inv_freq(scaled, torch.from_numpy(n)) if rope_scaling.get(scaled.rope_scaling).length_dependent \
        else rope_scaling.inv_freq(scaled)[None].expand(len(n), -1)
    return inv.numpy(), rope_scaling.attention_factor(scaled)


# Frequencies agree to 3 float32 steps (2^-23 relative each): the worker's powers are correctly rounded, torch's
# pow misses by a step now and then, dynamic's takes two powers, and the quotients round again.
RTOL = 3 * 2.0 ** -23


@pytest.mark.numerics
@pytest.mark.parametrize("model, kind, i", [c for c in CASES if c.values[1] != "ntk"])
def test_frequencies_equal_transformers(model, kind, i):
    """Every row against transformers computing its length alone: the frequencies to RTOL, the attention factor
    equal in float32."""
    obj = request_obj(model, kind, i)
    n = lengths(model, obj)
    inv, factor = rope_request.frequencies(rope_request.parse(obj), model_config(model).to_dict(), n)
    assert inv.dtype == factor.dtype == np.float32 and inv.shape == (len(n), model_config(model).rope_dim // 2)
    for row, length in enumerate(n):
        want, want_factor = transformers_frequencies(model, obj, int(length))
        assert want.dtype == np.float32 and want.shape == inv[row].shape
        np.testing.assert_allclose(inv[row], want, rtol=RTOL, atol=0, err_msg=f"length {length}")
        assert np.array_equal(inv[row] == 0, want == 0)  # proportional's still pairs stay exactly still
        assert factor[row] == np.float32(want_factor), (factor[row], want_factor)


@pytest.mark.numerics
@pytest.mark.parametrize("model, kind, i", CASES)
def test_frequencies_equal_the_exporters(model, kind, i):
    """The worker's numpy and the exporter's torch (model.rope_scaling) agree on every row: what a request asks
    for is what an artifact exported with that scaling computes."""
    obj = request_obj(model, kind, i)
    n = lengths(model, obj)
    inv, factor = rope_request.frequencies(rope_request.parse(obj), model_config(model).to_dict(), n)
    want, want_factor = exporter_frequencies(model, obj, n)
    assert want.shape == inv.shape
    np.testing.assert_allclose(inv, want, rtol=RTOL, atol=0)
    assert np.all(factor == np.float32(want_factor)), (factor, want_factor)


@pytest.mark.parametrize("factor, theta", [(4.0, 10000.0), (8.0, 5e5), (2.0, 100.0)])
def test_ntk_slows_the_slowest_pair_by_exactly_the_factor(factor, theta):
    """ntk's definition, independent of either implementation: base' = base s^(d/(d-2)) leaves the fastest pair's
    frequency 1 and divides the slowest pair's, base^(-(d-2)/d), by s."""
    for model in ("full", "partial"):
        cfg = model_config(model)
        req = rope_request.parse({"rope_type": "ntk", "factor": factor, "rope_theta": theta})
        inv, attention = rope_request.frequencies(req, cfg.to_dict(), np.array([5]))
        d = cfg.rope_dim
        assert inv[0, 0] == 1.0 and attention[0] == 1.0
        assert math.isclose(float(inv[0, -1]), theta ** (-(d - 2) / d) / factor, rel_tol=1e-6)


def test_length_dependent_types_switch_past_l0_per_row():
    """dynamic and longrope: rows at or below L0 keep the unscaled (short-factor) frequencies, rows past it change,
    each row by its own length whatever it is batched with."""
    cfg = model_config("full").to_dict()
    plain, _ = rope_request.frequencies(rope_request.parse({}), cfg, np.array([1]))
    req = rope_request.parse({"rope_type": "dynamic", "factor": 4.0, "original_max_position_embeddings": 64})
    assert req.length_dependent and not rope_request.parse({"rope_type": "yarn", "factor": 2}).length_dependent
    batch, _ = rope_request.frequencies(req, cfg, np.array([64, 65, 500, 10]))
    assert np.array_equal(batch[0], plain[0]) and np.array_equal(batch[3], plain[0])
    assert np.all(batch[2, 1:] < batch[1, 1:]) and np.all(batch[1, 1:] < plain[0, 1:])
    alone, _ = rope_request.frequencies(req, cfg, np.array([500]))
    assert np.array_equal(alone[0], batch[2])


def test_the_worker_knows_every_registered_type():
    """A type model/rope_scaling/ registers is one a request may name, reading the same keys (and a new one fails
    here until the worker states it)."""
    registered = {t.rope_type: set(t.keys) for t in rope_scaling.TYPES.values()}
    assert {k: set(v) for k, v in rope_request.TYPES.items()} == registered
    assert rope_request.LENGTH_DEPENDENT == {t.rope_type for t in rope_scaling.TYPES.values() if t.length_dependent}
    assert rope_request.NEEDS_ORIGINAL == {t.rope_type for t in rope_scaling.TYPES.values() if t.needs_original}
    for kind in REQUESTS:  # each type computes on some model
        assert kind in registered and any(c.values[1] == kind for c in CASES)


def test_describe():
    cfg = model_config("partial").to_dict()
    yarn = rope_request.parse({"rope_type": "yarn", "factor": 4, "original_max_position_embeddings": 2048,
                               "rope_theta": 10000})
    assert rope_request.describe(yarn) == "yarn x4 of 2048 positions, base 10000"
    assert rope_request.describe(yarn, cfg) == "yarn x4 of 2048 positions, base 10000, attention factor 1.1386"
    dynamic = rope_request.parse({"rope_type": "dynamic", "factor": 2})
    assert rope_request.describe(dynamic) == ("dynamic x2 of the model's original length, the model's base "
                                              "(frequencies follow each row's length)")
    assert rope_request.describe(dynamic, cfg).startswith("dynamic x2 of 1024 positions, base 500000")
    assert rope_request.describe(rope_request.parse({"rope_theta": 5e4})) == "default (unscaled), base 50000"


WRONG = [
    ([1, 2], "rope_scaling"),
    ({"rope_type": "turbo", "factor": 2}, "rope_scaling.rope_type"),
    ({"rope_type": 3}, "rope_scaling.rope_type"),
    ({"rope_type": "linear"}, "rope_scaling.factor"),
    ({"rope_type": "linear", "factor": 0.5}, "rope_scaling.factor"),
    ({"rope_type": "linear", "factor": float("nan")}, "rope_scaling.factor"),
    ({"rope_type": "dynamic", "factor": True}, "rope_scaling.factor"),
    ({"rope_type": "ntk", "factor": "2"}, "rope_scaling.factor"),
    ({"rope_type": "linear", "factor": 2, "beta_fast": 4}, "rope_scaling.beta_fast"),
    ({"rope_type": "default", "factor": 2}, "rope_scaling.factor"),
    ({"rope_theta": 50000, "bogus": 1}, "rope_scaling.bogus"),
    ({"rope_theta": 1.0}, "rope_scaling.rope_theta"),
    ({"rope_theta": float("inf")}, "rope_scaling.rope_theta"),
    ({"rope_type": "yarn", "factor": 4, "original_max_position_embeddings": 100.5},
     "rope_scaling.original_max_position_embeddings"),
    ({"rope_type": "yarn", "factor": 4, "original_max_position_embeddings": 1},
     "rope_scaling.original_max_position_embeddings"),
    ({"rope_type": "yarn", "factor": 4, "truncate": "yes"}, "rope_scaling.truncate"),
    ({"rope_type": "yarn", "factor": 4, "beta_fast": 0.5}, "rope_scaling.beta_fast"),
    ({"rope_type": "yarn", "factor": 4, "beta_slow": 0}, "rope_scaling.beta_slow"),
    ({"rope_type": "yarn", "factor": 4, "attention_factor": 0}, "rope_scaling.attention_factor"),
    ({"rope_type": "yarn", "factor": 4, "mscale": -1}, "rope_scaling.mscale"),
    ({"rope_type": "yarn", "original_max_position_embeddings": 32}, "rope_scaling.factor"),
    ({"rope_type": "llama3", "factor": 8, "low_freq_factor": 4, "high_freq_factor": 2},
     "rope_scaling.high_freq_factor"),
    ({"rope_type": "llama3", "factor": 8, "high_freq_factor": 2}, "rope_scaling.low_freq_factor"),
    ({"rope_type": "longrope", "short_factor": [1.0] * 16}, "rope_scaling.long_factor"),
    ({"rope_type": "longrope", "short_factor": [], "long_factor": [1.0] * 16}, "rope_scaling.short_factor"),
    ({"rope_type": "longrope", "short_factor": [1.0, -1.0], "long_factor": [1.0] * 16},
     "rope_scaling.short_factor[1]"),
    ({"rope_type": "longrope", "short_factor": 2, "long_factor": [1.0] * 16}, "rope_scaling.short_factor"),
]


@pytest.mark.parametrize("obj, field", WRONG, ids=[f for _, f in WRONG])
def test_parse_refuses_naming_the_field(obj, field):
    with pytest.raises(InvalidArgument) as err:
        rope_request.parse(obj)
    assert err.value.param == field and str(err.value).startswith(field + " ") and "\n" not in str(err.value)


MISFIT = [  # requests that parse but cannot run on the model
    ("partial", {"rope_type": "proportional"}, "rope_scaling.rope_type"),  # 48 dims where it rotates 24
    ("proportional", {"rope_type": "yarn", "factor": 4}, "rope_scaling.rope_type"),  # 8 dims where it rotates 32
    ("full", {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [1.0] * 16},
     "rope_scaling.short_factor"),  # 16 pairs
    ("narrow", {"rope_type": "ntk", "factor": 2}, "rope_scaling.rope_type"),
    ("narrow", {"rope_type": "dynamic", "factor": 2}, "rope_scaling.rope_type"),
]


@pytest.mark.parametrize("model, obj, field", MISFIT, ids=[f"{m}-{o['rope_type']}" for m, o, _ in MISFIT])
def test_a_request_the_model_cannot_take_is_refused_naming_the_field(model, obj, field):
    req, cfg = rope_request.parse(obj), model_config(model).to_dict()
    for call in (lambda: rope_request.check(req, cfg), lambda: rope_request.frequencies(req, cfg, np.array([3]))):
        with pytest.raises(InvalidArgument) as err:
            call()
        assert err.value.param == field and str(err.value).startswith(field + " ")
