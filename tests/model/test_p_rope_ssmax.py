"""p-RoPE (Barbero et al. 2024) and Scalable-Softmax (Nakanishi 2025), issue 50: each proven against its paper's
equations written out here in plain loops (p-RoPE's frequency rule over the whole head; SSMax's softmax of
s log(n) z per row), compared with the attention maps of the exported graph as onnxruntime runs it on a left-padded
batch past the trained context; p-RoPE's limits (p = 1 is RoPE; the still pairs carry no position, as p = 0 does
everywhere); what a config may say; the fast graph each takes; an intervention's positional_off; and the exports
validated like every variant's.  Cached decoding equal to the full forward and padding invariance come from
tests/model/test_transformer.py, which runs every registered variant; serving from the worker's tests over the
registry."""

from __future__ import annotations

import json
import math

import numpy as np
import onnxruntime as ort
import pytest
import torch

from export import gqa
from export.build import build_artifact
from export.report import Report
from export.validate import Runner, session_for
from model.attention import Intervention
from model.config import preset
from model.errors import ConfigError
from model.transformer import Transformer
from model.variants import REGISTRY, check_config
from model.variants import p_rope as p_rope_module
from model.variants.ssmax import scale_queries
from tests.model.helpers import left_pad, tiny_model
from tests.model.test_research_variants import CONTEXT, layer_inputs, softmax_rows
from tests.model.test_variants import covers

pytestmark = pytest.mark.numerics

VARIANTS = ["p_rope", "ssmax", "ssmax_rope"]
WIDE = {"d_model": 64}  # tiny with head_dim 16: the size onnxruntime's rotary kernel inside GroupQueryAttention needs
for _name in VARIANTS:  # tests/model/test_variants.py's check that every registered variant has its own tests
    covers(_name)


# --- the papers' equations, independently of model/variants ---------------------------------------------------

def rotary_scores(q: np.ndarray, k: np.ndarray, qpos: list[int], kpos: list[int], p: float,
                  base: float = 10000.0) -> np.ndarray:
    """q.k (T, S) of one head after RoPE with Barbero et al.'s p-RoPE rule (their section 6 and appendix
    algorithm): over the whole head of d dims, pair i (dims i and i + d/2, read as the complex number
    q_i + i q_{i+d/2}) turns at theta_i = base^(-2i/d) when i < p d / 2 and not at all otherwise, so
    <R_n q, R_m k> = Re sum_i q~_i conj(k~_i) e^{i (n - m) g_i}.  p = 1 is RoPE (Su et al.), p = 0 NoPE."""
    d = q.shape[-1]
    half = d // 2
    out = np.zeros((len(qpos), len(kpos)))
    for t, n in enumerate(qpos):
        for s, m in enumerate(kpos):
            total = 0.0
            for i in range(half):
                g = base ** (-2 * i / d) if i < p * d / 2 else 0.0
                qc, kc = complex(q[t, i], q[t, i + half]), complex(k[s, i], k[s, i + half])
                total += (qc * kc.conjugate() * complex(math.cos((n - m) * g), math.sin((n - m) * g))).real
            out[t, s] = total
    return out


def paper_maps(variant: str, q: np.ndarray, k: np.ndarray, s: np.ndarray) -> np.ndarray:
    """(H, T, T) attention of one row of T real tokens at positions 0 .. T-1, q and k (T, H, Dh) before any
    encoding, s (H,) SSMax's scalars: softmax over the causal keys of z (p_rope), or of s_h log(n) z with
    n = t + 1 the keys query t sees (Nakanishi 2025: a_j = n^(s z_j) / sum_j' n^(s z_j')); z = q.k / sqrt(d) after
    the rotation (p-RoPE at p = 0.75, RoPE for ssmax_rope, none for ssmax)."""
    T, H, d = q.shape
    pos = list(range(T))
    causal = np.tril(np.ones((T, T), bool))
    p = {"p_rope": 0.75, "ssmax": 0.0, "ssmax_rope": 1.0}[variant]
    out = np.zeros((H, T, T))
    for h in range(H):
        z = rotary_scores(q[:, h], k[:, h], pos, pos, p) / math.sqrt(d)
        if variant != "p_rope":
            for t in range(T):
                z[t] = s[h] * math.log(t + 1) * z[t]
        out[h] = softmax_rows(z, causal)
    return out


# --- exported artifacts ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def exported(tiny_artifact):
    """Each variant's validated artifact of the run's tiny artifacts (tests/conftest.py), beside the PyTorch model it
    was exported from (tiny_model is seeded): get(variant) -> (model, folder, report)."""
    def get(variant: str):
        return tiny_model(variant), *tiny_artifact(variant)
    return get


@pytest.fixture(scope="module")
def fast_exports(tmp_path_factory):
    """One artifact per variant at head_dim 16 with its fast graph, built once (no intervention graph: the tiny
    artifacts carry each variant's): {variant: (model, folder, report)}."""
    root, built = tmp_path_factory.mktemp("p_rope_ssmax"), {}

    def get(variant: str):
        if variant not in built:
            model = tiny_model(variant, **WIDE)
            report = build_artifact(model, root / variant, name=variant, opset=23, source={"kind": "random"},
                                    training={}, force=False, fast="on", interventions=False)
            built[variant] = (model, root / variant, report)
        return built[variant]
    return get


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_graphs_attention_maps_are_the_papers(exported, variant):
    """onnxruntime's attention maps of every layer equal the paper's, computed above from the layer's q and k before
    any encoding, on a left-padded batch longer than the trained context."""
    model, folder, _ = exported(variant)
    rows = [list(np.random.default_rng(n).integers(0, 256, n)) for n in (CONTEXT + 8, 9)]
    ids, mask = left_pad(rows)
    run = Runner(session_for(folder / "model.onnx"), model, Report(variant, []))
    maps = dict(zip(run.names, run.ort(ids.numpy(), mask.numpy(), run.empty_past(len(rows))), strict=True))[
        "attentions"]  # (B, L, H, T, S)
    cfg = model.cfg
    for layer, x in enumerate(layer_inputs(model, ids, mask)):
        q, k, _ = model.blocks[layer].attn.project(x)
        q = q.detach().double().numpy().reshape(len(rows), -1, cfg.n_heads, cfg.head_dim)
        k = k.detach().double().numpy().reshape(len(rows), -1, cfg.n_heads, cfg.head_dim)
        s = model.pos.s[layer].detach().double().numpy() if variant != "p_rope" else None
        for b, row in enumerate(rows):
            pad = ids.shape[1] - len(row)
            want = paper_maps(variant, q[b, pad:], k[b, pad:], s)
            np.testing.assert_allclose(maps[b, layer, :, pad:, pad:], want, atol=2e-5, rtol=0)
            assert np.all(maps[b, layer, :, :, :pad] == 0)  # no probability on the pads


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_intervention_graph_switches_each_layer_and_scales_rope_only(exported, variant):
    meta = json.loads((exported(variant)[1] / "model.json").read_text())
    assert meta["intervene"]["in_layers"]  # positional_off reaches its layers
    assert meta["intervene"]["rope"] == (variant == "ssmax_rope")  # a request's RoPE scaling: rope's rotation only


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_export_validates_and_takes_the_fast_graph_it_may(fast_exports, variant):
    """Validated as every variant (lengths 1, 7, past the context, left padding, cached steps, greedy decoding);
    p_rope's fast graph is RoPE's (compact, rotation inside GroupQueryAttention), SSMax's keeps the padded layout,
    its scaled queries outside any fused kernel."""
    model, folder, report = fast_exports(variant)
    assert report.passed, report.format_table()
    cases = {c.case for c in report.checks}
    for n in (1, 7, CONTEXT, 4 * CONTEXT):
        assert f"B=3 T={n} past=0" in cases
    assert any(c.startswith("left-padded") for c in cases) and any(c.startswith("decode step 3") for c in cases)
    assert not [c.case for c in report.checks if c.output == "not run"]
    meta = json.loads((folder / "model.json").read_text())
    assert (folder / "encoding.onnx").exists()  # a picture of each: p-RoPE's rotation, SSMax's factor
    fast = meta["fast"]
    assert fast["parity"]["max_abs_diff"] <= fast["parity"]["tolerance"]
    if variant == "p_rope":
        assert fast["layout"] == "compact" and fast["fused"]["GroupQueryAttention do_rotary"] == model_layers(meta)
        assert meta["encoding"]["note"] == "rope proportional (p-RoPE): 6 of 8 pairs turn, base 10000"
    else:
        assert fast["layout"] == "padded" and repr(variant) in gqa.ineligible(meta)
        assert "Scalable-Softmax: each query scaled by s log n" in meta["encoding"]["note"]
        # the picture of the factor: s log(t + 1) per layer, head and position, as onnxruntime computes it
        got = dict(zip([o["name"] for o in meta["encoding"]["outputs"]], ort.InferenceSession(
            str(folder / "encoding.onnx")).run(None, {"positions": np.arange(40)}), strict=True))["query_scale"]
        s = model.pos.s.detach().numpy()
        want = [[[s[layer, h] * math.log(t + 1) for t in range(40)] for h in range(4)] for layer in range(2)]
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def model_layers(meta) -> int:
    return int(meta["sizes"]["n_layers"])


# --- p-RoPE -------------------------------------------------------------------------------------------------------

def test_p_rope_at_p_1_is_rope(monkeypatch):
    """The paper's upper limit: with every pair turning, p-RoPE computes what the rope variant does."""
    rope = tiny_model("rope", **WIDE)
    monkeypatch.setattr(p_rope_module, "P", 1.0)
    whole = Transformer(preset("tiny", "p_rope", **WIDE)).eval()
    whole.load_state_dict(rope.state_dict())
    ids = torch.randint(0, 256, (2, 30), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(whole(ids).logits, rope(ids).logits, atol=1e-5, rtol=0)


def test_p_rope_still_pairs_carry_no_position_and_the_turning_ones_do():
    """The lowest-frequency quarter of the pairs (pairs 6 and 7 of 8) passes unrotated: q.k read through them alone
    is the same at every position, as p = 0 (NoPE) is everywhere; through a turning pair it is not."""
    pos = Transformer(preset("tiny", "p_rope", **WIDE)).pos
    g = torch.Generator().manual_seed(2)
    for pair, moves in ((6, False), (7, False), (5, True), (0, True)):
        x = torch.zeros(1, 1, 1, 16)
        x[..., [pair, pair + 8]] = torch.randn(2, generator=g)
        scores = []
        for n, m in ((3, 0), (500, 0), (5000, 4000), (9, 9)):
            q, _ = pos.rotate(x, x, torch.tensor([[n]]))
            _, k = pos.rotate(x, x, torch.tensor([[m]]))
            scores.append(float((q * k).sum()))
        assert (max(scores) - min(scores) > 1e-3) == moves, (pair, scores)


def test_p_rope_refuses_what_p_fixes_in_one_line():
    for field, value in (("rope_fraction", 0.5), ("rope_scaling", "linear"), ("local_rope_base", 10000.0)):
        extra = {"rope_factor": 2.0} if field == "rope_scaling" else {}
        with pytest.raises(ConfigError) as err:
            check_config(preset("tiny", "p_rope", **{field: value}, **extra))
        assert "\n" not in str(err.value) and field in str(err.value)
    cls = REGISTRY["p_rope"]
    assert cls.compact_layout and not cls.rope_scaled  # RoPE's fast graph; no RoPE scaling from a config or request


# --- SSMax --------------------------------------------------------------------------------------------------------

def test_ssmax_keeps_attention_from_fading_as_the_paper_shows():
    """Nakanishi's Figure 1: one score of +3 among n - 1 of -2; a softmax's largest output fades towards 0 as n
    grows, SSMax's (s = 0.43) stays near 1.  The variant's own query scaling, read through a one-key-dimension
    attention whose q.k is the score."""
    pos = Transformer(preset("tiny", "ssmax")).pos
    s = torch.full((4,), 0.43)
    for n, fading in ((10, 0.95), (1000, 0.2), (100000, 0.002)):
        z = torch.full((n,), -2.0)
        z[-1] = 3.0
        q = torch.ones(1, 4, 1, 1)
        scaled = scale_queries(q, torch.tensor([[n - 1]]), s, 1)[0, 0, 0, 0]  # the query at position n - 1
        plain, kept = torch.softmax(z, 0)[-1], torch.softmax(scaled * z, 0)[-1]
        assert plain < fading and kept > 0.9
    assert pos.s.shape == (2, 4) and torch.all(pos.s == 0.43)  # one s per layer and head, from S_INIT


@pytest.mark.parametrize("variant", ["ssmax", "ssmax_rope"])
def test_positional_off_is_a_plain_softmax_and_the_first_token_attends_to_itself(variant):
    """An intervention's positional_off: no length scaling in that layer (and no rotation), i.e. the NoPE model with
    the same weights; and at n = 1 the factor is log 1 = 0, the first query's row all on its one key."""
    model = tiny_model(variant)
    plain = Transformer(preset("tiny", "none")).eval()
    plain.load_state_dict({k: v for k, v in model.state_dict().items() if not k.startswith("pos.")})
    ids = torch.randint(0, 256, (2, 20), generator=torch.Generator().manual_seed(3))
    off = Intervention(torch.zeros(2, 2), torch.ones(2, 2, 4))
    with torch.no_grad():
        out = model(ids, intervention=off)
        torch.testing.assert_close(out.logits, plain(ids).logits, atol=1e-5, rtol=0)
        on = model(ids)
        assert not torch.allclose(on.logits, out.logits, atol=1e-3)  # the scaling moves them: the check can fail
    assert torch.isfinite(on.logits).all() and torch.all(on.attentions[..., 0, 0] == 1.0)  # no 0 x -inf


def test_ssmax_rope_refuses_per_layer_rope():
    with pytest.raises(ConfigError, match="ssmax_rope rotates every layer"):
        check_config(preset("tiny", "ssmax_rope", local_rope_base=10000.0, sliding_window=4))
    assert not REGISTRY["ssmax"].compact_layout and not REGISTRY["ssmax_rope"].compact_layout
