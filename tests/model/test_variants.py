"""Property checks per variant (docs/design.md, "What every variant must hold"), one group per variant.

Each test is tagged with @covers(variant); test_every_variant_has_property_test fails when a registered variant
has none, so a new encoding cannot land untested.
"""

import importlib
import math

import numpy as np
import pytest
import torch

from model.attention import positions_from_mask
from model.config import ModelConfig, preset
from model.errors import ConfigError, SequenceTooLongError
from model.variants import REGISTRY, PositionalVariant, build_variant
from model.variants.alibi import alibi_slopes
from model.variants.rope import apply_rope, inv_freq, rope_angles
from model.variants.sinusoidal import sinusoidal_table
from model.variants.t5 import causal_bucket
from tests.model.helpers import tiny_model

pytestmark = pytest.mark.numerics  # PyTorch against each paper's formula: also run under AVX2 (make test)


COVERED: set[str] = set()


def covers(variant):
    COVERED.add(variant)
    return lambda fn: fn


def positions(*rows):
    return torch.tensor(rows, dtype=torch.int64)


# --- none ---------------------------------------------------------------------------------------------------

@covers("none")
def test_none_adds_nothing():
    v = tiny_model("none").pos
    x, q = torch.randn(1, 5, 32), torch.randn(1, 4, 5, 8)
    p = positions(list(range(5)))
    assert torch.equal(v.embed(x, p), x)
    assert v.score_bias(q, p, p) is None
    assert all(torch.equal(a, b) for a, b in zip(v.rotate(q, q, p), (q, q), strict=True))


@covers("none")
@pytest.mark.parametrize("variant, invariant", [("none", True), ("rope", False), ("alibi", False)])
def test_one_layer_nope_is_order_blind_before_the_last_token(variant, invariant):
    # One NoPE layer: the last token attends to a set of keys with no order, so permuting the earlier tokens
    # leaves its prediction unchanged.  A positional variant must change it (so the check can fail).
    model = tiny_model(variant, n_layers=1)
    ids = torch.tensor([[5, 9, 77, 31, 200, 13]])
    perm = torch.tensor([[77, 5, 200, 9, 31, 13]])
    a, b = model(ids).logits[0, -1], model(perm).logits[0, -1]
    assert torch.allclose(a, b, atol=1e-5) == invariant


# --- sinusoidal ---------------------------------------------------------------------------------------------

def reference_sinusoid(p: np.ndarray, d: int) -> np.ndarray:
    pe = np.zeros((len(p), d))
    for k in range(d // 2):
        w = 10000.0 ** (-2 * k / d)
        pe[:, 2 * k], pe[:, 2 * k + 1] = np.sin(p * w), np.cos(p * w)
    return pe


@covers("sinusoidal")
def test_sinusoidal_matches_formula():
    p = np.arange(0, 600)
    table = sinusoidal_table(torch.tensor(p), 32).double().numpy()
    assert np.abs(table - reference_sinusoid(p, 32)).max() < 5e-4  # fp32 angles at p < 600


@covers("sinusoidal")
def test_sinusoidal_shift_is_a_rotation_independent_of_position():
    d, k = 16, 7
    pe = reference_sinusoid(np.arange(0, 200), d)
    # R_k maps PE(p) to PE(p + k): block-diagonal 2x2 rotations by w*k, the same for every p.
    R = np.zeros((d, d))
    for i in range(d // 2):
        a = k * 10000.0 ** (-2 * i / d)
        R[2 * i:2 * i + 2, 2 * i:2 * i + 2] = [[math.cos(a), math.sin(a)], [-math.sin(a), math.cos(a)]]
    assert np.abs(pe[:-k] @ R.T - pe[k:]).max() < 1e-9
    assert np.allclose((pe ** 2).sum(1), d / 2)


@covers("sinusoidal")
def test_sinusoidal_finite_far_out_and_added_to_embeddings():
    table = sinusoidal_table(torch.tensor([0, 10**6, 10**7]), 32)
    assert torch.isfinite(table).all()
    v = tiny_model("sinusoidal").pos
    x = torch.zeros(1, 3, 32)
    expected = v.scale * sinusoidal_table(positions([0, 1, 2]), 32)  # scaled by the learned scalar
    assert torch.equal(v.embed(x, positions([0, 1, 2])), expected)


# --- learned ------------------------------------------------------------------------------------------------

@covers("learned")
def test_learned_rejects_too_long_with_named_limit():
    model = tiny_model("learned")  # table of 16
    model(torch.zeros(1, 16, dtype=torch.int64))  # exactly the table: fine
    with pytest.raises(SequenceTooLongError, match="limit of 16 positions") as err:
        model(torch.zeros(1, 17, dtype=torch.int64))
    assert not isinstance(err.value, IndexError)
    out = model(torch.zeros(1, 10, dtype=torch.int64))
    with pytest.raises(SequenceTooLongError, match="max_positions=16"):  # past + new counts
        model(torch.zeros(1, 7, dtype=torch.int64), past_key_values=out.presents)


@covers("learned")
def test_learned_needs_mask_positions_under_left_padding():
    # Regression for HF #21080: arange positions shift a left-padded row; cumsum positions do not.
    mask = torch.tensor([[0, 0, 1, 1, 1]])
    assert positions_from_mask(mask).tolist() == [[0, 0, 0, 1, 2]]
    model = tiny_model("learned")
    alone = model(torch.tensor([[3, 4, 5]])).logits[0]
    padded = model(torch.tensor([[0, 0, 3, 4, 5]]), mask).logits[0, 2:]
    assert torch.allclose(alone, padded, atol=1e-5)
    naive = model.pos.table(torch.arange(2, 5))
    assert not torch.allclose(naive, model.pos.table(torch.arange(0, 3)))


# --- shaw ---------------------------------------------------------------------------------------------------

@covers("shaw")
def test_shaw_clips_at_k():
    v = tiny_model("shaw").pos  # k = 4
    idx = v.relative_index(positions([40]), positions(list(range(41))))[0, 0, 0]
    rel = idx - 4  # clip(j - i, -k, k)
    expected = (torch.arange(41) - 40).clamp(-4, 4)
    assert torch.equal(rel, expected)
    q = torch.randn(1, 4, 1, 8)
    bias = v.score_bias(q, positions([40]), positions(list(range(41))))[0, :, 0]
    assert torch.allclose(bias[:, :37], bias[:, :1].expand(-1, 37))  # every distance >= 4 shares one vector
    assert not torch.allclose(bias[:, 36], bias[:, 37])


@covers("shaw")
def test_shaw_bias_is_query_dependent_and_relative():
    v = tiny_model("shaw").pos
    q = torch.randn(1, 4, 1, 8)
    near = v.score_bias(q, positions([5]), positions(list(range(6))))
    far = v.score_bias(q, positions([105]), positions(list(range(100, 106))))
    assert torch.allclose(near, far)
    assert not torch.allclose(v.score_bias(2 * q, positions([5]), positions(list(range(6)))), near)


# --- t5 -----------------------------------------------------------------------------------------------------

T5_BOUNDARIES = {16: 16, 17: 19, 18: 21, 19: 24, 20: 27, 21: 31, 22: 35, 23: 40, 24: 46, 25: 52, 26: 59, 27: 67,
                 28: 77, 29: 87, 30: 99, 31: 113}


@covers("t5")
def test_t5_causal_bucket_boundaries():
    n = torch.arange(0, 1000)
    b = causal_bucket(n, 32, 128)
    assert torch.equal(b[:16], n[:16])  # exact region
    assert (b[1:] >= b[:-1]).all()  # monotone
    for bucket, first in T5_BOUNDARIES.items():
        assert b[first] == bucket and b[first - 1] == bucket - 1, bucket
    assert (b[113:] == 31).all()
    assert causal_bucket(torch.tensor([-5]), 32, 128).item() == 0  # future -> bucket 0 (masked)


@covers("t5")
def test_t5_bias_depends_on_distance_only():
    v = tiny_model("t5").pos
    a = v.score_bias(None, positions([7]), positions(list(range(8))))
    b = v.score_bias(None, positions([307]), positions(list(range(300, 308))))
    assert torch.equal(a, b)
    assert a.shape == (1, 4, 1, 8)
    assert not torch.allclose(a[..., 0], a[..., -1])


# --- rope ---------------------------------------------------------------------------------------------------

HEAD16 = ModelConfig(variant="rope", d_model=64, n_heads=4)  # head_dim 16


def rope_score(m: int, n: int, q: torch.Tensor, k: torch.Tensor, cfg: ModelConfig = HEAD16) -> float:
    cq, sq = rope_angles(positions([m]), cfg)
    ck, sk = rope_angles(positions([n]), cfg)
    return (apply_rope(q, cq, sq) * apply_rope(k, ck, sk)).sum().item()


@covers("rope")
@pytest.mark.parametrize("shift", [0, 100, 509, 997])
def test_rope_score_depends_only_on_distance(shift):
    torch.manual_seed(0)
    q, k = torch.randn(1, 1, 1, 16), torch.randn(1, 1, 1, 16)
    base = rope_score(5, 2, q, k)
    assert abs(rope_score(5 + shift, 2 + shift, q, k) - base) <= 1e-5 * max(1.0, abs(base)) * 4


@covers("rope")
def test_rope_angles_are_fp32_and_accurate():
    p = 4 * 128  # 4x the trained context
    cos, sin = rope_angles(positions([p, p + 1]), ModelConfig(variant="rope"))
    assert cos.dtype == torch.float32
    inv = 10000.0 ** (-np.arange(0, 32, 2) / 32)
    exact = np.cos(np.concatenate([(p + 1) * inv] * 2))
    assert np.abs(cos[0, 0, 1].numpy() - exact).max() < 1e-4
    assert not torch.equal(cos[0, 0, 0], cos[0, 0, 1])  # adjacent positions stay distinct


@covers("rope")
def test_rope_preserves_norm_identity_at_zero_and_leaves_values_alone():
    v = tiny_model("rope").pos
    q, k = torch.randn(1, 4, 3, 8), torch.randn(1, 4, 3, 8)
    rq, rk = v.rotate(q, k, positions([0, 1, 2]))
    assert torch.allclose(rq.norm(dim=-1), q.norm(dim=-1), atol=1e-5)
    assert torch.allclose(rq[:, :, 0], q[:, :, 0]) and torch.allclose(rk[:, :, 0], k[:, :, 0])
    # values: the cached value of a rope model is the plain projection (never rotated)
    model = tiny_model("rope")
    x = torch.tensor([[3, 4, 5]])
    out = model(x)
    h = model.blocks[0].ln1(model.tok(x))
    v_plain = model.blocks[0].attn.qkv(h).view(1, 3, 3, 4, 8)[:, :, 2].transpose(1, 2)
    assert torch.allclose(out.presents[0][1], v_plain, atol=1e-6)


# --- alibi --------------------------------------------------------------------------------------------------

@covers("alibi")
@pytest.mark.parametrize("heads, log2", [
    (4, [-2, -4, -6, -8]),
    (6, [-2, -4, -6, -8, -1, -3]),
    (8, [-1, -2, -3, -4, -5, -6, -7, -8]),
    (12, [-1, -2, -3, -4, -5, -6, -7, -8, -0.5, -1.5, -2.5, -3.5]),
])
def test_alibi_slopes_follow_the_paper(heads, log2):
    assert np.allclose(np.log2(alibi_slopes(heads)), log2)


@covers("alibi")
def test_alibi_bias_is_unscaled_relative_and_spans_all_keys_when_decoding():
    v = tiny_model("alibi").pos
    slopes = torch.tensor(alibi_slopes(4))
    # a decode step: one query at position 9 against 10 keys
    bias = v.score_bias(None, positions([9]), positions(list(range(10))))
    assert bias.shape == (1, 4, 1, 10)
    expected = -slopes[:, None] * (9 - torch.arange(10.0))[None]
    assert torch.allclose(bias[0, :, 0], expected)  # exactly -m(i - j): no 1/sqrt(d) on the bias
    assert (bias[0, :, 0, :9] != 0).all()


# --- fire ---------------------------------------------------------------------------------------------------

@covers("fire")
def test_fire_normalised_distance_in_unit_interval_and_bounded():
    v = tiny_model("fire").pos  # L init 8
    for T in (5, 64, 1000):
        d = v.normalised_distance(positions([T - 1]), positions(list(range(T))))
        assert d.min() >= 0 and d.max() <= 1 + 1e-6
        assert torch.isfinite(v.score_bias(None, positions([T - 1]), positions(list(range(T))))).all()


@covers("fire")
def test_fire_relative_below_L_absolute_above():
    v = tiny_model("fire").pos
    L = v.L.abs().item()
    assert 4 < L < 12  # tiny preset: L init 8
    # both queries below L: a function of i - j only
    a = v.score_bias(None, positions([4]), positions([1, 2, 3, 4]))
    b = v.score_bias(None, positions([7]), positions([4, 5, 6, 7]))
    assert torch.allclose(a, b)
    # queries beyond L: normaliser uses the absolute query position, so the same distances differ
    c = v.score_bias(None, positions([20]), positions([17, 18, 19, 20]))
    d = v.score_bias(None, positions([40]), positions([37, 38, 39, 40]))
    assert not torch.allclose(c, d)


# --- cpe ----------------------------------------------------------------------------------------------------

@covers("cpe")
def test_cpe_sees_exactly_kernel_minus_one_inputs_back():
    v = tiny_model("cpe").pos  # kernel 3
    torch.manual_seed(0)
    x = torch.randn(1, 10, 32)
    mask = torch.ones(1, 10, dtype=torch.int64)
    base, _ = v.embed_state(x, mask, (torch.zeros(1, 2, 32),))
    bumped = x.clone()
    bumped[0, 4] += 1.0
    out, _ = v.embed_state(bumped, mask, (torch.zeros(1, 2, 32),))
    changed = (out - base).abs().amax(-1)[0] > 1e-6
    assert changed.tolist() == [i in (4, 5, 6) for i in range(10)]  # itself and the next kernel-1 positions


@covers("cpe")
def test_cpe_padding_reads_as_the_start_and_the_state_is_the_last_masked_inputs():
    v = tiny_model("cpe").pos
    torch.manual_seed(1)
    x = torch.randn(1, 6, 32)
    alone, (state_alone,) = v.embed_state(x, torch.ones(1, 6, dtype=torch.int64), (torch.zeros(1, 2, 32),))
    padded_x = torch.cat([torch.randn(1, 3, 32) * 50, x], dim=1)  # garbage in the pad slots
    mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 1]])
    padded, (state_padded,) = v.embed_state(padded_x, mask, (torch.zeros(1, 2, 32),))
    assert torch.allclose(padded[0, 3:], alone[0], atol=1e-6)
    assert torch.equal(state_alone, x[:, -2:]) and torch.equal(state_padded, state_alone)
    # a row that carries state and whose new tokens are left-padded (a batch mixing lengths) skips the pads
    carried = torch.randn(1, 2, 32)
    want, (want_state,) = v.embed_state(x[:, :2], torch.ones(1, 2, dtype=torch.int64), (carried,))
    got, (got_state,) = v.embed_state(torch.cat([torch.randn(1, 4, 32), x[:, :2]], 1),
                                      torch.tensor([[0, 0, 0, 0, 1, 1]]), (carried,))
    assert torch.allclose(got[:, 4:], want, atol=1e-6) and torch.allclose(got_state, want_state)
    # no state and no conv weights: the position signal is the convolution alone
    assert v.state_spec() == [("conv_state", (2, 32))]
    with torch.no_grad():
        v.weight.zero_()
        v.bias.zero_()
    same, _ = v.embed_state(x, torch.ones(1, 6, dtype=torch.int64), (torch.zeros(1, 2, 32),))
    assert torch.equal(same, x)


# --- xl -----------------------------------------------------------------------------------------------------

def qk(seed, t=1, s=6, h=4, dh=8):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, h, t, dh, generator=g), torch.randn(1, h, s, dh, generator=g)


@covers("xl")
def test_xl_bias_is_translation_invariant_and_per_layer():
    v = tiny_model("xl").pos
    q, k = qk(0)
    a = v.score_bias(q, positions([5]), positions(list(range(6))), k=k, layer=0)
    b = v.score_bias(q, positions([105]), positions(list(range(100, 106))), k=k, layer=0)
    assert torch.allclose(a, b, atol=1e-5)  # relative: only i - j (and the key content) matter
    assert not torch.allclose(a, v.score_bias(q, positions([5]), positions(list(range(6))), k=k, layer=1))


@covers("xl")
def test_xl_u_term_reads_keys_and_v_term_reads_distance():
    v = tiny_model("xl").pos
    q, k = qk(1)
    with torch.no_grad():
        for w in v.w_r:
            w.weight.zero_()  # no position term: only u . k_j remains
    bias = v.score_bias(q, positions([5]), positions(list(range(6))), k=k, layer=0)
    want = (v.u[None, :, None, :] @ k.transpose(-1, -2)) / math.sqrt(8)
    assert torch.allclose(bias, want, atol=1e-6) and want.abs().max() > 0
    v2 = tiny_model("xl").pos
    with torch.no_grad():
        v2.u.zero_()
    zero_q = torch.zeros_like(q)  # q = 0: only v . W_R R_{i-j}, which differs by distance, not by key content
    c = v2.score_bias(zero_q, positions([5]), positions(list(range(6))), k=k, layer=0)
    d = v2.score_bias(zero_q, positions([5]), positions(list(range(6))), k=torch.randn_like(k), layer=0)
    assert torch.allclose(c, d) and not torch.allclose(c[..., 0], c[..., -1])


# --- deberta ------------------------------------------------------------------------------------------------

@covers("deberta")
def test_deberta_bias_is_relative_bucketed_and_scaled():
    v = tiny_model("deberta").pos  # 8 buckets saturating at 20
    q, k = qk(2, s=6)
    a = v.score_bias(q, positions([5]), positions(list(range(6))), k=k)
    b = v.score_bias(q, positions([305]), positions(list(range(300, 306))), k=k)
    assert torch.allclose(a, b, atol=1e-6)
    far = v.buckets(positions([200]), positions([0, 100, 150]))
    assert far.tolist() == [[[[7, 7, 7]]]]  # every distance past the saturation shares the last bucket
    assert v.content_scale == pytest.approx(1 / math.sqrt(3))
    with torch.no_grad():
        v.rel.weight.zero_()
    assert torch.equal(v.score_bias(q, positions([5]), positions(list(range(6))), k=k), torch.zeros(1, 4, 1, 6))


@covers("deberta")
def test_deberta_has_both_disentangled_terms():
    v = tiny_model("deberta").pos
    q, k = qk(3, s=6)
    base = v.score_bias(q, positions([5]), positions(list(range(6))), k=k)
    assert not torch.allclose(base, v.score_bias(2 * q, positions([5]), positions(list(range(6))), k=k))  # c2p
    assert not torch.allclose(base, v.score_bias(q, positions([5]), positions(list(range(6))), k=2 * k))  # p2c
    content_free = v.score_bias(torch.zeros_like(q), positions([5]), positions(list(range(6))), k=k)
    key_free = v.score_bias(q, positions([5]), positions(list(range(6))), k=torch.zeros_like(k))
    assert torch.allclose(content_free + key_free, base, atol=1e-6)  # the two terms add


# --- coverage -----------------------------------------------------------------------------------------------

def test_every_variant_has_property_test():
    importlib.import_module("tests.model.test_research_variants")  # the research variants' tests say covers() there
    importlib.import_module("tests.model.test_fope")  # fope's
    importlib.import_module("tests.model.test_cope")  # cope's
    importlib.import_module("tests.model.test_fox")  # fox's
    importlib.import_module("tests.model.test_path")  # path's
    importlib.import_module("tests.model.test_p_rope_ssmax")  # p_rope's, ssmax's and ssmax_rope's
    missing = set(REGISTRY) - COVERED
    assert not missing, f"registered variants without a property test: {sorted(missing)}"


def test_every_variant_but_nope_uses_a_hook():
    for cls in REGISTRY.values():
        overridden = {h for h in ("embed", "score_bias", "rotate", "rotate_layer", "embed_state")
                      if getattr(cls, h) is not getattr(PositionalVariant, h)}
        assert overridden or cls.name == "none"
    assert preset("tiny", "alibi").variant == "alibi"


# --- rope context extension (export rope-scale) ---------------------------------------------------------------

def scaled(method: str, factor: float = 4.0) -> ModelConfig:
    return ModelConfig(variant="rope", rope_scaling=method, rope_factor=factor)


@covers("rope")
def test_linear_interpolation_is_positions_divided_by_the_factor():
    a, _ = rope_angles(positions([400]), scaled("linear"))
    b, _ = rope_angles(positions([100]), ModelConfig(variant="rope"))
    assert torch.allclose(a, b, atol=1e-5)


@covers("rope")
def test_ntk_scales_the_base_so_the_lowest_frequency_slows_by_the_factor():
    theta, scale = inv_freq(ModelConfig(variant="rope"))
    ntk, ntk_scale = inv_freq(scaled("ntk"))
    assert scale == ntk_scale == 1.0
    assert ntk[0] == theta[0]  # the fastest pair is untouched
    dh = 32
    want = (10000.0 * 4 ** (dh / (dh - 2))) ** (-np.arange(0, dh, 2) / dh)
    np.testing.assert_allclose(ntk.numpy(), want, rtol=1e-5)
    assert ntk[-1] == pytest.approx(theta[-1].item() / 4, rel=1e-5)  # the slowest pair slows by the factor


@covers("rope")
def test_yarn_keeps_fast_pairs_interpolates_slow_ones_and_tempers_attention():
    cfg = ModelConfig(variant="rope", rope_scaling="yarn", rope_factor=8.0, rope_original_context=2048)
    theta, _ = inv_freq(ModelConfig(variant="rope"))
    yarn, scale = inv_freq(cfg)
    turns = 2048 * theta / (2 * np.pi)  # rotations over the original context
    fast, slow = turns > 32, turns < 1
    assert fast.any() and slow.any()
    assert torch.allclose(yarn[fast], theta[fast]) and torch.allclose(yarn[slow], theta[slow] / 8)
    between = ~fast & ~slow
    assert ((yarn[between] < theta[between]) & (yarn[between] > theta[between] / 8)).all()
    assert scale == pytest.approx(0.1 * np.log(8) + 1)
    cos, sin = rope_angles(positions([3]), cfg)
    assert torch.allclose(cos ** 2 + sin ** 2, torch.full_like(cos, scale ** 2), atol=1e-5)


@covers("rope")
@pytest.mark.parametrize("method", ["linear", "ntk", "yarn"])
def test_scaled_rope_still_depends_only_on_distance(method):
    torch.manual_seed(0)
    q, k = torch.randn(1, 1, 1, 16), torch.randn(1, 1, 1, 16)
    cfg = ModelConfig(variant="rope", d_model=64, n_heads=4, rope_scaling=method, rope_factor=4.0)
    base = rope_score(5, 2, q, k, cfg)
    assert abs(rope_score(905, 902, q, k, cfg) - base) <= 1e-4 * max(1.0, abs(base))


def test_rope_scaling_is_validated():
    with pytest.raises(ConfigError, match="rope_scaling must be one of"):
        build_variant(ModelConfig(variant="rope", rope_scaling="nope"))
    with pytest.raises(ConfigError, match="rope variant only"):
        build_variant(ModelConfig(variant="alibi", rope_scaling="yarn", rope_factor=2.0))
    with pytest.raises(ConfigError, match="rope_factor"):
        ModelConfig(variant="rope", rope_scaling="linear", rope_factor=0.5)
