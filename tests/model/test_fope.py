"""FoPE (Hua et al. 2024, arXiv 2412.17739) proven against the paper's equations, written out here in plain loops:
the clipping rule checked against 2 pi / N by hand, each pair's Fourier series h_j(n) = sum_i A_ij cos(w_i n) +
i sum_i B_ij sin(w_i n) multiplying the query's and key's pair read as complex numbers, compared with the attention
maps of the exported graph as onnxruntime runs it on a left-padded batch past the trained context; its limit (no
noise, nothing clipped) equal to RoPE; its fixed coefficients carried by checkpoints and graphs; and its export
validated like every variant's."""

from __future__ import annotations

import json
import math

import numpy as np
import onnx
import pytest
import torch

import tests.model.test_research_variants as research
from export.build import build_artifact
from export.report import Report
from export.validate import Runner, graph_weights, session_for
from model import checkpoint
from model.config import preset
from model.errors import ConfigError
from model.transformer import Transformer
from model.variants import REGISTRY, check_config
from tests.model.helpers import left_pad, tiny_model
from tests.model.test_variants import covers

pytestmark = pytest.mark.numerics

covers("fope")  # tests/model/test_variants.py's check that every registered variant has its own tests
CONTEXT = 16  # the tiny preset's trained context
BASE = 20.0  # a RoPE base that keeps two of the tiny head's four frequencies and clips two (see the first test)


# --- the paper's equations, independently of model/variants ---------------------------------------------------

def kept(cfg) -> list[float]:
    """Section 4's clipping: RoPE's w_m = base^(-2m/d) with w_m < 2 pi / N set to zero, N the training length."""
    d = cfg.rope_dim
    return [cfg.rope_base ** (-2 * m / d) for m in range(d // 2) if cfg.rope_base ** (-2 * m / d) >= 2 * math.pi
            / cfg.context]


def series(omegas: list[float], a: np.ndarray, b: np.ndarray, j: int, n: int) -> complex:
    """Pair j's factor at position n: sum_i a_ij cos(w_i n) + i sum_i b_ij sin(w_i n) over the kept frequencies
    (with a = b, the Fourier series sum_i a_ij e^{i w_i n}); a clipped pair (j >= D) has 1 + i at every n."""
    if j >= len(omegas):
        return complex(1.0, 1.0)
    return complex(sum(a[i, j] * math.cos(w * n) for i, w in enumerate(omegas)),
                   sum(b[i, j] * math.sin(w * n) for i, w in enumerate(omegas)))


def fope_scores(cfg, a: np.ndarray, b: np.ndarray, q: np.ndarray, k: np.ndarray, qpos, kpos) -> np.ndarray:
    """One head's q.k (T, S) after FoPE, q (T, Dh) and k (S, Dh) before it, a and b that head's (D, D) cos and sin
    coefficients: each rotated pair (j, j + d/2) half-split or (2j, 2j+1) interleaved, read as x_j = x_a + i x_b,
    becomes x_j h_j(n); the score is Re sum_j q_j conj(k_j) plus the unrotated dims' products."""
    d, half, omegas = cfg.rope_dim, cfg.rope_dim // 2, kept(cfg)
    pa = [2 * j if cfg.rope_pairing == "interleaved" else j for j in range(half)]
    pb = [2 * j + 1 if cfg.rope_pairing == "interleaved" else j + half for j in range(half)]
    out = np.zeros((len(qpos), len(kpos)))
    for t, n in enumerate(qpos):
        for s, m in enumerate(kpos):
            total = float(q[t, d:] @ k[s, d:])
            for j in range(half):
                qj = complex(q[t, pa[j]], q[t, pb[j]]) * series(omegas, a, b, j, n)
                kj = complex(k[s, pa[j]], k[s, pb[j]]) * series(omegas, a, b, j, m)
                total += (qj * kj.conjugate()).real
            out[t, s] = total
    return out


def given_coefficients(model: Transformer, seed: int = 1) -> Transformer:
    """Coefficients farther from the identity than SIGMA draws them, distinct per layer, head, cos and sin, so a
    transposed or shared matrix shows in the scores."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in range(model.cfg.n_layers):
            for coef in model.pos.coefficients(layer):
                coef.copy_(torch.eye(coef.shape[-1]) + 0.4 * torch.randn(coef.shape, generator=g))
    return model


def coefficients(model: Transformer, layer: int, kv_head: int) -> tuple[np.ndarray, np.ndarray]:
    a, b = model.pos.coefficients(layer)
    return a[kv_head].double().numpy(), b[kv_head].double().numpy()


# --- the clipping ---------------------------------------------------------------------------------------------

def test_the_clipping_keeps_the_frequencies_a_period_fits_in_the_context():
    # tiny: d = 8, N = 16, 2 pi / 16 = 0.3927; w = 1, 0.1, 0.01, 0.001: only w_0 turns a full period in 16 tokens
    tiny = Transformer(preset("tiny", "fope")).pos
    assert tiny.omegas == [1.0] and kept(tiny.cfg) == [1.0]
    # the default model: d = 32, N = 128, 2 pi / 128 = 0.0491; w_m = 10^(-m/4): w_5 = 0.0562 kept, w_6 = 0.0316 not
    default = Transformer(preset("default", "fope")).pos
    assert default.omegas == pytest.approx([10 ** (-m / 4) for m in range(6)])
    # base 20 on the tiny head: w = 1, 0.473 kept; 0.224, 0.106 clipped
    based = Transformer(preset("tiny", "fope", rope_base=BASE)).pos
    assert based.omegas == pytest.approx([1.0, 20 ** -0.25])
    a, b = based.coefficients(1)
    assert a.shape == b.shape == (4, 2, 2)  # per kv head, one series per kept frequency, per layer
    # a clipped pair is position-free: the same output at position 0 and 10,000 (and not the input: 1 + i)
    x = torch.zeros(1, 4, 1, 8)
    x[..., 3], x[..., 7] = 0.6, -0.2  # pair 3 (dims 3 and 7), clipped
    at = [based.rotate_layer(x, x, torch.tensor([[p]]), 1)[0] for p in (0, 10000)]
    torch.testing.assert_close(at[0], at[1], atol=0, rtol=0)
    assert at[0][0, 0, 0, 3].item() == pytest.approx(0.8) and at[0][0, 0, 0, 7].item() == pytest.approx(0.4)


# --- the series, in PyTorch (either pairing, a partial rotation, grouped-query attention) ------------------------

@pytest.mark.parametrize("pairing, fraction, kv_heads", [("half", 1.0, 4), ("interleaved", 1.0, 2), ("half", 0.5, 1)])
def test_each_pair_carries_the_papers_series(pairing, fraction, kv_heads):
    """d_model 64 (head_dim 16), context 64, base 100: w = 100^(-2m/d) >= 2 pi / 64 keeps 5 of 8 pairs (whole
    head: w_4 = 0.1 just above 0.0982) or 3 of 4 (half of it); query head h takes kv head h // (4 / kv_heads)'s
    coefficients."""
    cfg = preset("tiny", "fope", d_model=64, context=64, rope_base=100.0, rope_pairing=pairing,
                 rope_fraction=fraction, n_kv_heads=kv_heads)
    torch.manual_seed(0)
    model = given_coefficients(Transformer(cfg))
    assert len(model.pos.omegas) == len(kept(cfg)) == (5 if fraction == 1.0 else 3)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 5, 16, generator=g, dtype=torch.float64)
    k = torch.randn(1, kv_heads, 6, 16, generator=g, dtype=torch.float64)
    qpos, kpos = [0, 3, 40, 90, 100], [0, 1, 39, 60, 99, 100]
    rq, _ = model.pos.rotate_layer(q, torch.zeros(1, kv_heads, 5, 16, dtype=q.dtype), torch.tensor([qpos]), 1)
    _, rk = model.pos.rotate_layer(torch.zeros(1, 4, 6, 16, dtype=k.dtype), k, torch.tensor([kpos]), 1)
    for h in range(4):
        kv = h // (4 // kv_heads)
        a, b = coefficients(model, 1, kv)
        want = fope_scores(cfg, a, b, q[0, h].numpy(), k[0, kv].numpy(), qpos, kpos)
        np.testing.assert_allclose((rq[0, h] @ rk[0, kv].T).numpy(), want, rtol=1e-5, atol=1e-5)


# --- the exported graph ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """One validated artifact of a tiny FoPE model with two kept and two clipped pairs: (model, folder, report)."""
    model = given_coefficients(tiny_model("fope", rope_base=BASE))
    folder = tmp_path_factory.mktemp("fope") / "fope"
    report = build_artifact(model, folder, name="fope", opset=23, source={"kind": "random"}, training={},
                            force=False, interventions=False)  # (the tiny artifacts carry fope's)
    return model, folder, report


def test_the_export_validates_with_clipped_pairs_and_mixed_series(exported):
    """tests/export/test_export.py validates the tiny preset's fope (one kept frequency) as every variant's; this
    artifact's two kept and two clipped pairs and far-from-identity coefficients pass the same checks."""
    _, folder, report = exported
    assert report.passed, report.format_table()
    assert not [c.case for c in report.checks if c.output == "not run"]
    assert any(c.case.startswith("left-padded") for c in report.checks)
    assert any("2x context" in c.case for c in report.checks)  # decoding past the trained context
    meta = json.loads((folder / "model.json").read_text())
    assert meta["variant"] == "fope" and meta["max_positions"] is None


def test_the_graphs_attention_maps_are_the_papers(exported):
    """onnxruntime's attention maps of every layer equal softmax(fope_scores / sqrt(d)) on a left-padded batch, one
    row longer than the trained context; the graph carries the coefficients as the weights it was exported with."""
    model, folder, _ = exported
    cfg = model.cfg
    weights = graph_weights(onnx.load(str(folder / "model.onnx")), cfg, folder)
    for layer in range(cfg.n_layers):
        a, b = model.pos.coefficients(layer)
        np.testing.assert_array_equal(weights[f"pos.cos_coef_{layer}"], a.numpy())
        np.testing.assert_array_equal(weights[f"pos.sin_coef_{layer}"], b.numpy())
    rows = [list(np.random.default_rng(n).integers(0, 256, n)) for n in (CONTEXT + 8, 9)]
    ids, mask = left_pad(rows)
    run = Runner(session_for(folder / "model.onnx"), model, Report("fope", []))
    got = dict(zip(run.names, run.ort(ids.numpy(), mask.numpy(), run.empty_past(len(rows))), strict=True))
    maps = got["attentions"]  # (B, L, H, T, S)
    for layer, x in enumerate(research.layer_inputs(model, ids, mask)):
        q, k, _ = model.blocks[layer].attn.project(x)
        q = q.detach().double().numpy().reshape(len(rows), -1, cfg.n_heads, cfg.head_dim)
        k = k.detach().double().numpy().reshape(len(rows), -1, cfg.n_heads, cfg.head_dim)
        for r, row in enumerate(rows):
            pad, pos = ids.shape[1] - len(row), list(range(len(row)))  # positions count the real tokens
            for h in range(cfg.n_heads):
                a, b = coefficients(model, layer, h)
                scores = fope_scores(cfg, a, b, q[r, pad:, h], k[r, pad:, h], pos, pos) / math.sqrt(cfg.head_dim)
                want = research.softmax_rows(scores, np.tril(np.ones((len(row), len(row)), bool)))
                np.testing.assert_allclose(maps[r, layer, h, pad:, pad:], want, atol=2e-5, rtol=0)
            assert np.all(maps[r, layer, :, :, :pad] == 0)  # no probability on the pads


def test_the_encoding_picture_shows_the_series_and_the_clipped_pairs_at_zero(exported):
    """encoding.onnx's rotary_cos and rotary_sin are layer 0's, kv head 0's series (real and imaginary parts), 1 on
    the clipped pairs; rotary_frequencies each pair's own frequency, 0 where clipped."""
    model, folder, _ = exported
    session = session_for(folder / "encoding.onnx")
    cos, sin, freqs = session.run(["rotary_cos", "rotary_sin", "rotary_frequencies"], {"positions": np.arange(40)})
    omegas = kept(model.cfg)
    np.testing.assert_allclose(freqs, omegas + [0.0, 0.0], rtol=1e-6)
    a, b = coefficients(model, 0, 0)
    want = np.array([[series(omegas, a, b, j, n) for j in range(4)] for n in range(40)])
    np.testing.assert_allclose(cos, want.real, atol=2e-5)
    np.testing.assert_allclose(sin, want.imag, atol=2e-5)
    assert "2 of 4 pairs clipped" in json.loads((folder / "model.json").read_text())["encoding"]["note"]


# --- the limit, the form, the cache ---------------------------------------------------------------------------

def test_without_noise_or_clipping_it_is_rope_and_with_them_it_is_not_relative():
    """Context 8192 clips nothing on the tiny head (2 pi / 8192 = 0.00077 < w_3 = 0.001); identity coefficients
    (SIGMA = 0) then make FoPE RoPE, weight for weight.  The drawn coefficients make the scores depend on where
    the tokens sit, not only on their distance."""
    fope = tiny_model("fope", context=8192)
    assert len(fope.pos.omegas) == 4
    with torch.no_grad():
        for layer in range(2):
            for coef in fope.pos.coefficients(layer):
                coef.copy_(torch.eye(4).expand(4, 4, 4))
    rope = Transformer(preset("tiny", "rope", context=8192)).eval()
    rope.load_state_dict({n: t for n, t in fope.state_dict().items() if not n.startswith("pos.")}, strict=True)
    ids = torch.randint(0, 256, (2, 20), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        for shift in (0, 100):
            where = torch.arange(20).expand(2, 20) + shift
            got, want = fope(ids, position_ids=where), rope(ids, position_ids=where)
            torch.testing.assert_close(got.attentions, want.attentions, atol=1e-6, rtol=0)
            torch.testing.assert_close(got.logits, want.logits, atol=1e-5, rtol=0)
        drawn = tiny_model("fope")  # SIGMA's noise, one frequency kept
        plain = drawn(ids)
        moved = drawn(ids, position_ids=torch.arange(20).expand(2, 20) + 7)
    assert not torch.allclose(moved.attentions, plain.attentions, atol=1e-3)


def test_cached_keys_keep_their_own_positions_under_left_padding_past_the_context():
    """A left-padded batch (GQA, two rows of 34 and 21 tokens) decoded four tokens a step after a prefill: every
    step's logits and the final cache equal one full forward's, each row's keys at its own real-token positions."""
    model = given_coefficients(tiny_model("fope", rope_base=BASE, n_kv_heads=2))
    g = torch.Generator().manual_seed(5)
    ids, mask = left_pad([torch.randint(0, 256, (n,), generator=g).tolist() for n in (34, 21)])
    with torch.no_grad():
        full = model(ids, mask)
        out = model(ids[:, :18], mask[:, :18])
        for start in range(18, 34, 4):
            out = model(ids[:, start:start + 4], mask[:, :start + 4], past_key_values=out.presents)
            real = mask[:, start:start + 4].bool()
            torch.testing.assert_close(out.logits[real], full.logits[:, start:start + 4][real], atol=1e-4, rtol=0)
    for (k, _), (fk, _) in zip(out.presents, full.presents, strict=True):
        torch.testing.assert_close(k[1, :, 13:], fk[1, :, 13:], atol=1e-5, rtol=1e-5)  # row 1's real keys
        torch.testing.assert_close(k[0], fk[0], atol=1e-5, rtol=1e-5)


def test_the_coefficients_are_drawn_once_and_loaded_not_drawn_again(tmp_path):
    torch.manual_seed(0)
    model = Transformer(preset("tiny", "fope", rope_base=BASE))
    a, b = model.pos.coefficients(0)
    assert not torch.equal(a, b) and not torch.equal(a, model.pos.coefficients(1)[0])  # separate draws
    assert not any(n.startswith("pos.") for n, _ in model.named_parameters())  # fixed: nothing trains them
    noise = torch.cat([t.flatten() - torch.eye(2).flatten().repeat(4) for layer in range(2)
                       for t in model.pos.coefficients(layer)])
    std = 0.3 * math.sqrt(2 / (2 * 2 + 4 * 2))  # Xavier-normal with gain 0.3 on (4, 2, 2): fans 2*2 and 4*2
    assert 0.6 * std < noise.std() < 1.4 * std
    checkpoint.save(model, tmp_path / "ckpt")
    torch.manual_seed(123)  # a construction at load would draw other values
    loaded, _ = checkpoint.load(tmp_path / "ckpt")
    for layer in range(2):
        for mine, theirs in zip(model.pos.coefficients(layer), loaded.pos.coefficients(layer), strict=True):
            assert torch.equal(mine, theirs)


def test_fope_refuses_a_rope_scaling_and_claims_no_rope_kernel():
    with pytest.raises(ConfigError, match="rope_scaling applies to the rope variant only, not fope"):
        check_config(preset("tiny", "fope", rope_scaling="linear", rope_factor=2.0))
    cls = REGISTRY["fope"]
    assert not cls.rope_scaled and not cls.compact_layout  # per-head features: no fused RotaryEmbedding
    assert cls.in_layers()  # an intervention may switch one layer's FoPE off
