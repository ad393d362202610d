"""The encodings of 2022-2023 research (issue 50): KERPLE's two kernels, Sandwich and xPos, each proven against its
paper's own equations, written out here in plain loops over the query and key positions, and compared with the
attention maps of the exported graph as onnxruntime runs it; their relative form (the scores depend on i - j only)
as a property; and their exports validated like every variant's (lengths 1, 7 and past the trained context, a
left-padded batch, cached steps, greedy decoding, the intervention graph).  Forward/decode equality and padding
invariance in float64 come from tests/model/test_transformer.py, which runs every registered variant."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from model.config import preset
from model.errors import ConfigError
from model.transformer import Transformer
from tests.model.helpers import left_pad, tiny_model
from tests.model.test_variants import covers

pytestmark = pytest.mark.numerics

KERPLE = ["kerple_log", "kerple_power"]
RESEARCH = [*KERPLE, "sandwich"]
CONTEXT = 16  # the tiny preset's trained context
for _name in RESEARCH:  # tests/model/test_variants.py's check that every registered variant has its own tests
    covers(_name)


def given_parameters(model: Transformer) -> Transformer:
    """Each kernel's parameters set to distinct values inside the paper's constraints (r1, r2 > 0, power <= 2)."""
    with torch.no_grad():
        if model.cfg.variant == "kerple_log":
            model.pos.r1.copy_(torch.tensor([0.4, 1.1, 1.7, 2.5]))
            model.pos.r2.copy_(torch.tensor([0.05, 0.3, 0.9, 2.0]))
        elif model.cfg.variant == "kerple_power":
            model.pos.r1.copy_(torch.tensor([0.1, 0.4, 0.8, 1.5]))
            model.pos.r2.copy_(torch.tensor([0.3, 0.8, 1.4, 1.9]))
    return model


# --- the papers' equations, independently of model/variants ---------------------------------------------------

def sinusoid(p: int, dims: int) -> list[float]:
    """The sinusoidal embedding of position p: [sin(p w_k), cos(p w_k)], w_k = 10000^(-2k/d'), k = 1 .. d'/2."""
    out = []
    for k in range(1, dims // 2 + 1):
        w = 10000.0 ** (-2 * k / dims)
        out += [math.sin(p * w), math.cos(p * w)]
    return out


def paper_bias(model: Transformer, qpos: list[int], kpos: list[int]) -> np.ndarray:
    """(H, T, S) bias on q.k/sqrt(d) for query positions qpos and key positions kpos (keys after the query: 0)."""
    cfg, H = model.cfg, model.cfg.n_heads
    r1s, r2s = ([float(v) for v in p.detach()] for p in (model.pos.r1, model.pos.r2)) \
        if cfg.variant.startswith("kerple") else ([], [])
    out = np.zeros((H, len(qpos), len(kpos)))
    for h in range(H):
        for a, m in enumerate(qpos):
            for b, n in enumerate(kpos):
                if n > m:
                    continue
                if cfg.variant == "kerple_log":  # Chi et al. 2022, eq. for the logarithmic kernel
                    out[h, a, b] = -r1s[h] * math.log(1 + r2s[h] * abs(m - n))
                elif cfg.variant == "kerple_power":  # the power kernel, 0 < r2 <= 2
                    out[h, a, b] = -r1s[h] * abs(m - n) ** r2s[h]
                elif cfg.variant == "sandwich":  # Chi et al. 2023: p_m . p_n - d'/2, over ALiBi's 8h/H
                    dims = cfg.head_dim
                    pm, pn = sinusoid(m, dims), sinusoid(n, dims)
                    out[h, a, b] = (sum(x * y for x, y in zip(pm, pn, strict=True)) - dims / 2) / (8 * (h + 1) / H)
    return out


def paper_scores(model: Transformer, q: np.ndarray, k: np.ndarray, qpos: list[int], kpos: list[int]) -> np.ndarray:
    """(H, T, S) q.k/sqrt(d) with the paper's positional term, q (T, H, Dh) and k (S, H, Dh) before any encoding."""
    d = model.cfg.head_dim
    content = np.einsum("thd,shd->hts", q, k) / math.sqrt(d)
    return content + paper_bias(model, qpos, kpos)


def softmax_rows(scores: np.ndarray, allowed: np.ndarray) -> np.ndarray:
    s = np.where(allowed, scores, -np.inf)
    s = s - s.max(-1, keepdims=True)
    e = np.where(allowed, np.exp(s), 0.0)
    return e / e.sum(-1, keepdims=True)


def layer_inputs(model: Transformer, ids: torch.Tensor, mask: torch.Tensor) -> list[torch.Tensor]:
    """What each block's attention reads (after its norm), from the PyTorch model: the content side of q and k."""
    seen = []
    hooks = [b.attn.register_forward_pre_hook(lambda _m, args: seen.append(args[0])) for b in model.blocks]
    try:
        with torch.no_grad():
            model(ids, mask)
    finally:
        for h in hooks:
            h.remove()
    return seen


# --- exported artifacts ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """One validated artifact per research variant, built once for this module: {variant: (model, folder, report)}."""
    from export.build import build_artifact

    root, built = tmp_path_factory.mktemp("research"), {}

    def get(variant: str):
        if variant not in built:
            model = given_parameters(tiny_model(variant))
            report = build_artifact(model, root / variant, name=variant, opset=23, source={"kind": "random"},
                                    training={}, force=False)
            built[variant] = (model, root / variant, report)
        return built[variant]
    return get


@pytest.mark.parametrize("variant", RESEARCH)
def test_the_export_validates_like_every_variant(exported, variant):
    _, folder, report = exported(variant)
    assert report.passed, report.format_table()
    cases = {c.case for c in report.checks}
    for n in (1, 7, CONTEXT, 4 * CONTEXT):  # lengths 1, 7 and past the trained context
        assert f"B=1 T={n} past=0" in cases and f"B=3 T={n} past=0" in cases
    assert any(c.startswith("left-padded") for c in cases)
    assert any(c.startswith("decode step 3") for c in cases)
    assert any(c.startswith("greedy") for c in cases)
    meta = json.loads((folder / "model.json").read_text())
    assert meta["variant"] == variant and meta["max_positions"] is None
    assert meta["intervene"]  # the intervention graph, proven against PyTorch by the exporter
    assert (folder / "encoding.onnx").exists()


@pytest.mark.parametrize("variant", RESEARCH)
def test_the_graphs_attention_maps_are_the_papers(exported, variant):
    """onnxruntime's attention maps of every layer equal softmax(q.k/sqrt(d) + the paper's positional term), the
    term computed above from the paper's equations, on a left-padded batch longer than the trained context."""
    from export.validate import Runner, session_for
    from export.report import Report

    model, folder, _ = exported(variant)
    rows = [list(np.random.default_rng(n).integers(0, 256, n)) for n in (CONTEXT + 8, 9)]
    ids, mask = left_pad(rows)
    run = Runner(session_for(folder / "model.onnx"), model, Report(variant, []))
    got = dict(zip(run.names, run.ort(ids.numpy(), mask.numpy(), run.empty_past(len(rows))), strict=True))
    maps = got["attentions"]  # (B, L, H, T, S)
    cfg = model.cfg
    inputs = layer_inputs(model, ids, mask)
    for layer, x in enumerate(inputs):
        q, k, _ = model.blocks[layer].attn.project(x)
        q = q.detach().double().numpy().reshape(len(rows), -1, cfg.n_heads, cfg.head_dim)
        k = k.detach().double().numpy().reshape(len(rows), -1, cfg.n_heads, cfg.head_dim)
        for b, row in enumerate(rows):
            pad = ids.shape[1] - len(row)
            pos = list(range(len(row)))  # each real token's position: the real tokens before it
            want = softmax_rows(paper_scores(model, q[b, pad:], k[b, pad:], pos, pos),
                                np.tril(np.ones((len(row), len(row)), bool)))
            np.testing.assert_allclose(maps[b, layer, :, pad:, pad:], want, atol=2e-5, rtol=0)
            assert np.all(maps[b, layer, :, :, :pad] == 0)  # no probability on the pads


# --- relative form ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("variant", RESEARCH)
def test_scores_depend_on_the_distance_only(variant):
    """Every position moved by the same offset leaves the attention maps and the logits as they were."""
    model = given_parameters(tiny_model(variant))
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        plain = model(ids)
        for shift in (5, 1000, 30000):
            moved = model(ids, position_ids=torch.arange(12).expand(2, 12) + shift)
            torch.testing.assert_close(moved.attentions, plain.attentions, atol=2e-5, rtol=0)
            torch.testing.assert_close(moved.logits, plain.logits, atol=1e-4, rtol=0)
        # and spacing the positions apart does change them: the check can fail
        spread = model(ids, position_ids=torch.arange(12).expand(2, 12) * 3)
    assert not torch.allclose(spread.attentions, plain.attentions, atol=1e-3)


# --- KERPLE -------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("variant, r1_high, r2_high", [("kerple_log", 2.0, 1.0), ("kerple_power", 1.0, 2.0)])
def test_kerple_initialises_as_the_authors_code(variant, r1_high, r2_high):
    torch.manual_seed(0)
    pos = Transformer(preset("tiny", variant, n_heads=8, d_model=64)).pos
    assert pos.r1.shape == pos.r2.shape == (8,)  # one pair per head, shared by the layers
    assert 0 <= pos.r1.min() and pos.r1.max() < r1_high and 0 <= pos.r2.min() and pos.r2.max() < r2_high
    assert len(set(pos.r1.tolist())) == 8  # drawn, not constant


@pytest.mark.parametrize("variant", KERPLE)
def test_kerple_keeps_its_parameters_positive_and_its_power_at_most_two(variant):
    model = tiny_model(variant)
    with torch.no_grad():
        model.pos.r1.copy_(torch.tensor([-1.0, 0.0, 0.5, 3.0]))
        model.pos.r2.copy_(torch.tensor([-2.0, 0.005, 1.5, 7.0]))
    r1, r2 = model.pos.params()
    assert r1.tolist() == pytest.approx([0.01, 0.01, 0.5, 3.0])
    top = 2.0 if variant == "kerple_power" else 7.0
    assert r2.tolist() == pytest.approx([0.01, 0.01, 1.5, top])
    # the bias is finite on every key, the masked future ones included (no log or power of a negative distance)
    p = torch.arange(6)[None]
    bias = model.pos.score_bias(None, p, p)
    assert torch.isfinite(bias).all() and bias.shape == (1, 4, 6, 6)
    assert torch.equal(bias[0, :, 1, 2:], torch.zeros(4, 4))  # future keys: distance 0, masked by the model


@pytest.mark.parametrize("variant", KERPLE)
def test_kerple_learns_its_parameters_even_at_the_floor(variant):
    torch.manual_seed(0)
    model = Transformer(preset("tiny", variant)).train()
    with torch.no_grad():
        model.pos.r1[0] = -0.5  # below the floor: its value is 0.01, its gradient still reaches it
    ids = torch.randint(0, 256, (2, 12))
    out = model(ids, output_attentions=False)
    loss = torch.nn.functional.cross_entropy(out.logits[:, :-1].reshape(-1, 256), ids[:, 1:].reshape(-1))
    loss.backward()
    assert torch.isfinite(loss)
    assert (model.pos.r1.grad != 0).all() and (model.pos.r2.grad != 0).all()


def test_kerple_log_bias_is_the_papers_log_decay():
    """At r1 = 1, r2 = 1 the bias is -log(1 + d): -log 2 at distance 1, -log 11 at 10, flattening with distance."""
    model = tiny_model("kerple_log")
    with torch.no_grad():
        model.pos.r1.fill_(1.0)
        model.pos.r2.fill_(1.0)
    bias = model.pos.score_bias(None, torch.tensor([[10]]), torch.arange(11)[None])[0, 0, 0]
    assert bias[-1] == 0 and bias[-2].item() == pytest.approx(-math.log(2)) and \
        bias[0].item() == pytest.approx(-math.log(11))
    by_distance = bias.detach().flip(0)  # distance 0 .. 10
    drops = by_distance[:-1] - by_distance[1:]  # the drop from one distance to the next shrinks as it grows
    assert (drops > 0).all() and (drops[1:] < drops[:-1]).all()


# --- Sandwich -----------------------------------------------------------------------------------------------------

def test_sandwich_is_parameter_free_zero_on_the_diagonal_and_below_it_elsewhere():
    model = Transformer(preset("tiny", "sandwich"))
    assert list(model.pos.parameters()) == []  # the paper's "parameter-free"
    p = torch.arange(40)[None]
    bias = model.pos.score_bias(None, p, p)[0]  # (H, 40, 40)
    causal = torch.tril(torch.ones(40, 40, dtype=torch.bool), -1)
    assert torch.equal(bias.diagonal(dim1=1, dim2=2), torch.zeros(4, 40))
    assert (bias[:, causal] < 0).all()
    # ALiBi's head layout: head h's bias is head 1's divided by h, the first head the steepest
    for h in range(4):
        torch.testing.assert_close(bias[h] * (h + 1), bias[0], atol=1e-5, rtol=1e-6)


def test_sandwich_decays_like_a_log():
    """The paper's claim: the logarithmically decaying pattern KERPLE and T5 share.  Sandwich's own bias oscillates
    (a sum of cosines), so the claim is on its mean: each eightfold span of distances lowers it by about the same
    amount (a linear decay would lower it eightfold more each time), never below -d' / (8h/H)."""
    cfg = preset("tiny", "sandwich", d_model=128, n_heads=4)  # d' = 32
    pos = Transformer(cfg).pos
    row = pos.score_bias(None, torch.tensor([[4096]]), torch.arange(4097)[None])[0, 0, 0].flip(0)  # distance 0 ..
    assert row.min() >= -32 / 2  # -d' / (8 * 1/4), head 1
    means = torch.stack([row[8 ** i:8 ** (i + 1)].mean() for i in range(4)])  # distances 1-7, 8-63, 64-511, 512-4095
    drops = means[:-1] - means[1:]
    assert (drops > 0).all() and drops.max() < 2 * drops.min()
