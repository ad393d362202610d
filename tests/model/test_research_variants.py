"""The encodings of 2022-2023 research (issue 50): KERPLE's two kernels, Sandwich and xPos, each proven against its
paper's own equations, written out here in plain loops over the query and key positions, and compared with the
attention maps of the exported graph as onnxruntime runs it; their relative form (the scores depend on i - j only)
as a property; and their exports validated like every variant's (lengths 1, 7 and past the trained context, a
left-padded batch, cached steps, greedy decoding, the intervention graph).  Forward/decode equality and padding
invariance in float64 come from tests/model/test_transformer.py, which runs every registered variant."""

from __future__ import annotations

import math
import shutil
import threading

import grpc
import numpy as np
import pytest
import torch

from export.report import Report
from export.validate import Runner, session_for
from model.config import preset
from model.errors import ConfigError
from model.transformer import Transformer
from model.variants import REGISTRY, check_config
from protos.posenc.v1 import posenc_pb2 as pb
from protos.posenc.v1 import posenc_pb2_grpc
from tests.model.helpers import left_pad, tiny_model
from tests.model.test_variants import covers
from tests.serving import start

pytestmark = pytest.mark.numerics

KERPLE = ["kerple_log", "kerple_power"]
RESEARCH = ["xpos", *KERPLE, "sandwich"]
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
    # the parameters as the authors' code uses them: every one at least 0.01, the power's exponent at most 2 (their
    # clamp: a random tiny model's may lie outside the paper's r1, r2 > 0)
    r1s = [max(float(v), 0.01) for v in model.pos.r1.detach()] if cfg.variant.startswith("kerple") else []
    r2s = [min(max(float(v), 0.01), 2.0 if cfg.variant == "kerple_power" else math.inf)
           for v in model.pos.r2.detach()] if cfg.variant.startswith("kerple") else []
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


def xpos_scores(cfg, q: np.ndarray, k: np.ndarray, qpos: list[int], kpos: list[int]) -> np.ndarray:
    """Sun et al. 2022's attention score (T, S) of one head, q (T, Dh) and k (S, Dh) before the encoding: with each
    rotated pair read as a complex number q~_i = q_a + i q_b (pairs (i, i + d/2) half-split, (2i, 2i+1) interleaved),
    <f_q(q, n), f_k(k, m)> = Re sum_i q~_i conj(k~_i) e^{i (n - m) theta_i} zeta_i^((n - m) / 512), theta_i =
    base^(-2i/d), zeta_i = (2i/d + 0.4) / 1.4; the unrotated dims as plain products."""
    d, half = cfg.rope_dim, cfg.rope_dim // 2
    a = [2 * i if cfg.rope_pairing == "interleaved" else i for i in range(half)]
    b = [2 * i + 1 if cfg.rope_pairing == "interleaved" else i + half for i in range(half)]
    out = np.zeros((len(qpos), len(kpos)))
    for t, n in enumerate(qpos):
        for s, m in enumerate(kpos):
            total = float(q[t, d:] @ k[s, d:])
            for i in range(half):
                theta = cfg.rope_base ** (-2 * i / d)
                zeta = (2 * i / d + 0.4) / 1.4
                qc, kc = complex(q[t, a[i]], q[t, b[i]]), complex(k[s, a[i]], k[s, b[i]])
                total += (qc * kc.conjugate() * complex(math.cos((n - m) * theta), math.sin((n - m) * theta))
                          ).real * zeta ** ((n - m) / 512)
            out[t, s] = total
    return out


def paper_scores(model: Transformer, q: np.ndarray, k: np.ndarray, qpos: list[int], kpos: list[int]) -> np.ndarray:
    """(H, T, S) q.k/sqrt(d) with the paper's positional term, q (T, H, Dh) and k (S, H, Dh) before any encoding."""
    d = model.cfg.head_dim
    if model.cfg.variant == "xpos":
        return np.stack([xpos_scores(model.cfg, q[:, h], k[:, h], qpos, kpos)
                         for h in range(model.cfg.n_heads)]) / math.sqrt(d)
    content = np.einsum("thd,shd->hts", q, k) / math.sqrt(d)
    return content + paper_bias(model, qpos, kpos)


def softmax_rows(scores: np.ndarray, allowed: np.ndarray) -> np.ndarray:
    s = np.where(allowed, scores, -np.inf)
    s = s - s.max(-1, keepdims=True)
    e = np.where(allowed, np.exp(s), 0.0)
    return e / e.sum(-1, keepdims=True)


def graph_maps(model: Transformer, folder, lengths: tuple[int, ...]) -> tuple[list[list[int]], torch.Tensor,
                                                                              torch.Tensor, np.ndarray]:
    """(rows, ids, mask, attention maps (B, L, H, T, S)): rows of random bytes of these lengths, left-padded into one
    batch and run through the artifact's model.onnx in onnxruntime, from an empty cache."""
    rows = [list(np.random.default_rng(n).integers(0, 256, n)) for n in lengths]
    ids, mask = left_pad(rows)
    run = Runner(session_for(folder / "model.onnx"), model, Report(model.cfg.variant, []))
    got = dict(zip(run.names, run.ort(ids.numpy(), mask.numpy(), run.empty_past(len(rows))), strict=True))
    return rows, ids, mask, got["attentions"]


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
def exported(tiny_artifact):
    """Each research variant's validated artifact of the run's tiny artifacts (tests/conftest.py), beside the PyTorch
    model it was exported from (tiny_model is seeded): get(variant) -> (model, folder, report)."""
    def get(variant: str):
        return tiny_model(variant), *tiny_artifact(variant)
    return get


@pytest.fixture(scope="module")
def served(exported, tmp_path_factory):
    """A real worker on a loopback port serving the four research artifacts: (posenc stub, {variant: model})."""
    root = tmp_path_factory.mktemp("served")
    models = {}
    for variant in RESEARCH:
        models[variant], folder, _ = exported(variant)
        shutil.copytree(folder, root / variant)
    srv = start(root, max_batch=8, max_wait_ms=5.0)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{srv.port}") as channel:
            yield posenc_pb2_grpc.PosencStub(channel), models
    finally:
        srv.stop(grace=1)


@pytest.mark.parametrize("variant", RESEARCH)
def test_the_graphs_attention_maps_are_the_papers(exported, variant):
    """onnxruntime's attention maps of every layer equal softmax(q.k/sqrt(d) + the paper's positional term), the
    term computed above from the paper's equations, on a left-padded batch longer than the trained context."""
    model, folder, _ = exported(variant)
    rows, ids, mask, maps = graph_maps(model, folder, (CONTEXT + 8, 9))  # maps: (B, L, H, T, S)
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


@pytest.mark.parametrize("variant", RESEARCH)
def test_served_greedy_tokens_are_pytorchs_past_the_context(served, variant):
    """The worker's greedy answers, two prompts of different lengths at once (so batched, their caches padded), equal
    PyTorch's full forward re-run for every token, decoding past the trained context."""
    stub, models = served
    model = models[variant]
    prompts = [[7, 99, 3, 140, 21], [200, 5, 17, 63, 88, 9, 250, 31, 44]]
    answers: dict[int, list[int]] = {}

    def ask(i: int) -> None:
        req = pb.GenerateRequest(model=variant, prompt=pb.Prompt(tokens=pb.TokenIds(ids=prompts[i])),
                                 max_new_tokens=2 * CONTEXT)
        answers[i] = [m.token.id for m in stub.Generate(req, timeout=60)]

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, ids in enumerate(prompts):
        seq = list(ids)
        with torch.no_grad():
            for _ in range(2 * CONTEXT):
                seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
        assert answers[i] == seq[len(ids):]


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
            # xPos rotates by float32 angles n * theta, whose rounding grows with n (as the rope variant's does)
            slack = shift * 1e-8 if variant == "xpos" else 0.0
            torch.testing.assert_close(moved.attentions, plain.attentions, atol=2e-5 + slack, rtol=0)
            torch.testing.assert_close(moved.logits, plain.logits, atol=1e-4 + 5 * slack, rtol=0)
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


# --- xPos ---------------------------------------------------------------------------------------------------------

def xpos_rotated_scores(cfg, q, k, qpos, kpos):
    """The variant's rotate() on one head's q (T, Dh) at qpos and k (S, Dh) at kpos, as q.k (T, S)."""
    pos = Transformer(cfg).pos
    rq, _ = pos.rotate(q[None, None], q[None, None], torch.tensor([qpos]))
    _, rk = pos.rotate(k[None, None], k[None, None], torch.tensor([kpos]))
    return (rq[0, 0] @ rk[0, 0].T).numpy()


@pytest.mark.parametrize("pairing, fraction", [("half", 1.0), ("interleaved", 1.0), ("half", 0.5)])
def test_xpos_rotation_is_the_papers_in_either_pairing(pairing, fraction):
    cfg = preset("tiny", "xpos", d_model=64, rope_pairing=pairing, rope_fraction=fraction)  # head_dim 16
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(5, 16, generator=g, dtype=torch.float64), torch.randn(6, 16, generator=g, dtype=torch.float64)
    qpos, kpos = [0, 3, 40, 90, 100], [0, 1, 39, 60, 99, 100]  # small: float32 angles round little
    want = xpos_scores(cfg, q.numpy(), k.numpy(), qpos, kpos)
    np.testing.assert_allclose(xpos_rotated_scores(cfg, q, k, qpos, kpos), want, rtol=1e-5, atol=1e-5)


def test_xpos_scales_decay_with_distance_and_stay_finite_far_out():
    """Each pair's factor is zeta_i^((n - m)/512) <= 1 for a key behind the query: with the rotation taken away
    (q and k one pair's unit vector, distance a multiple of its period) the score is that factor alone.  At
    positions near 30,000 the factors (about 1e-32 and 1e31 on the fastest pair) stay inside float32."""
    cfg = preset("tiny", "xpos")  # head_dim 8: pairs i = 0..3, pair 0 is dims (0, 4)
    one = torch.zeros(1, 8)
    one[0, 3] = 1.0  # pair 3 (dims 3 and 7): theta = 10000^(-6/8) = 0.001
    period = 2 * math.pi / 10000 ** (-6 / 8)
    zeta = (6 / 8 + 0.4) / 1.4
    for base in (0, 30000):
        for dist in (0, 512, 1024):
            n = round(dist / period) * period  # close to a whole number of turns
            got = xpos_rotated_scores(cfg, one, one, [base + int(n)], [base])[0, 0]
            assert np.isfinite(got)
            want = zeta ** (int(n) / 512) * math.cos(int(n) * 10000 ** (-6 / 8))
            assert got == pytest.approx(want, rel=1e-4)
    pos = Transformer(cfg).pos
    x = torch.ones(1, 1, 1, 8)
    q, k = pos.rotate(x, x, torch.tensor([[35000]]))
    assert torch.isfinite(q).all() and torch.isfinite(k).all() and k.abs().max() > 1e30


def test_xpos_refuses_a_rope_scaling_and_is_not_rope():
    with pytest.raises(ConfigError, match="rope_scaling applies to the rope variant only, not xpos"):
        check_config(preset("tiny", "xpos", rope_scaling="linear", rope_factor=2.0))
    cls = REGISTRY["xpos"]
    assert not cls.rope_scaled and not cls.compact_layout  # q and k are scaled apart: no fused RoPE kernel
    assert cls.in_layers()  # an intervention may switch one layer's xPos off


def test_xpos_caches_keys_scaled_by_their_own_positions():
    """A key cached at position m keeps zeta^(-m/512): the step's cache equals the full forward's, past the context."""
    model = tiny_model("xpos")
    ids = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        full = model(ids)
        out = model(ids[:, :30])
        for t in range(30, 40):
            out = model(ids[:, t:t + 1], past_key_values=out.presents)
    for (k, _), (fk, _) in zip(out.presents, full.presents, strict=True):
        torch.testing.assert_close(k, fk, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.logits[:, -1], full.logits[:, -1], atol=1e-4, rtol=0)
