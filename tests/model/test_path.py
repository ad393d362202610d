"""PaTH attention (Yang et al. 2025, arXiv 2505.16381) proven against its paper: the logits q_i^T H_i ... H_{j+1} k_j
with H_t = I - beta_t w_t w_t^T written out here as explicit products of d x d matrices (section 3's definition, not
the closed form model/variants/path.py computes) from the layer's own input and the projection's weights, compared
with the exported graph's attention maps in onnxruntime on a left-padded batch past the trained context; the
paper's special cases, beta = 0 giving attention without positions and beta = 2 a reflection; pads anywhere in a row
changing nothing; cached decoding; and the paths that give positions from outside refusing it, while an
intervention's layer switch removes the products and nothing else."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from model.attention import positions_from_mask
from model.config import preset
from model.errors import ConfigError
from model.train import check_random_positions
from model.transformer import Transformer
from model.variants import check_config
from tests.model.helpers import check_cached_decode, check_row_alone_in_padded_pieces, tiny_model
from tests.model.positionless import check_layer_off
from tests.model.test_research_variants import CONTEXT, graph_maps, layer_inputs, softmax_rows
from tests.model.test_variants import covers

pytestmark = pytest.mark.numerics

covers("path")  # tests/model/test_variants.py's check that every registered variant has its own tests


# --- the paper's definition, independently of model/variants ----------------------------------------------------

def householder(w: np.ndarray, beta: float) -> np.ndarray:
    """H = I - beta w w^T for a unit w."""
    return np.eye(len(w)) - beta * np.outer(w, w)


def paper_scores(x: np.ndarray, wq: np.ndarray, wk: np.ndarray, bq: np.ndarray, bk: np.ndarray, heads: int,
                 products: bool = True) -> np.ndarray:
    """(H, T, T) logits of one row's real tokens from the layer's input x (T, D), each head's key channels read as
    [k (c) | w (c) | beta logit (1) | rest], c = (d - 1) // 2:
      w_t      the w channels over their Euclidean norm
      beta_t   2 sigmoid(logit)
      logit_ij q_i^T H_i H_{i-1} ... H_{j+1} k_j / sqrt(d), j <= i, over the first c channels (d: the head's size;
               without `products`, q_i . k_j / sqrt(d))."""
    T = x.shape[0]
    q = (x @ wq.T + bq).reshape(T, heads, -1)
    k = (x @ wk.T + bk).reshape(T, heads, -1)
    d = q.shape[-1]
    c = (d - 1) // 2
    out = np.zeros((heads, T, T))
    for h in range(heads):
        w = [k[t, h, c:2 * c] / math.sqrt(float(k[t, h, c:2 * c] @ k[t, h, c:2 * c]) + 1e-6) for t in range(T)]
        beta = [2.0 / (1.0 + math.exp(-float(k[t, h, 2 * c]))) for t in range(T)]
        for i in range(T):
            m = np.eye(c)  # H_i ... H_{j+1}, grown one factor on the right as j goes down
            for j in range(i, -1, -1):
                if j < i and products:
                    m = m @ householder(w[j + 1], beta[j + 1])
                out[h, i, j] = float(q[i, h, :c] @ m @ k[j, h, :c]) / math.sqrt(d)
    return out


def projection(model: Transformer, layer: int) -> tuple[np.ndarray, ...]:
    """(wq, wk, bq, bk) of a layer's qkv projection."""
    cfg, qkv = model.cfg, model.blocks[layer].attn.qkv
    H, Dh = cfg.n_heads, cfg.head_dim
    w = qkv.weight.detach().double().numpy()
    b = qkv.bias.detach().double().numpy() if qkv.bias is not None else np.zeros(w.shape[0])
    return w[:H * Dh], w[H * Dh:2 * H * Dh], b[:H * Dh], b[H * Dh:2 * H * Dh]


@pytest.fixture(scope="module")
def exported(tiny_artifact):
    """The path artifact of the run's tiny artifacts (validated as every variant's), beside its PyTorch model."""
    return tiny_model("path"), *tiny_artifact("path")


def test_the_export_says_what_an_intervention_may_do(exported):
    _, folder, _ = exported
    meta = json.loads((folder / "model.json").read_text())
    assert meta["variant"] == "path" and meta["max_positions"] is None
    assert meta["intervene"]["positions"] is False  # the matrices make the positions: none may be given
    assert meta["intervene"]["in_layers"] is True  # but a layer's products may be switched off


def test_every_graph_walks_the_keys_instead_of_inverting_a_matrix_over_them(exported):
    """A served call's cost is linear in the keys for each query: every graph of the artifact holds one ONNX Scan per
    layer (the walk over the keys) and no matrix inverse (com.microsoft's Inverse, cubic in the keys), and nothing
    outside ONNX's standard domain."""
    import onnx

    model, folder, _ = exported
    for name in ("model.onnx", "profile.onnx", "intervene.onnx", "intervene_profile.onnx"):
        nodes = onnx.load(folder / name, load_external_data=False).graph.node
        assert [n.op_type for n in nodes if n.op_type in ("Scan", "Loop")] == ["Scan"] * model.cfg.n_layers, name
        assert {n.domain for n in nodes} <= {"", "ai.onnx"}, name


def test_the_graphs_attention_maps_are_the_papers(exported):
    """onnxruntime's attention maps of every layer equal the softmax of the paper's logits over each row's real
    tokens, on a left-padded batch whose long row runs past the trained context."""
    model, folder, _ = exported
    rows, ids, mask, maps = graph_maps(model, folder, (2 * CONTEXT + 5, 9))  # maps: (B, L, H, T, S)
    for layer, x in enumerate(layer_inputs(model, ids, mask)):
        x = x.detach().double().numpy()
        weights = projection(model, layer)
        for b, row in enumerate(rows):
            pad = ids.shape[1] - len(row)
            causal = np.tril(np.ones((len(row), len(row)), bool))
            want = softmax_rows(paper_scores(x[b, pad:], *weights, model.cfg.n_heads), causal)
            np.testing.assert_allclose(maps[b, layer, :, pad:, pad:], want, atol=2e-5, rtol=0)
            assert np.all(maps[b, layer, :, :, :pad] == 0)  # no probability on the pads
            # the products matter: without them the maps are far from these (the check can fail)
            content = paper_scores(x[b, pad:], *weights, model.cfg.n_heads, products=False)
            assert np.abs(softmax_rows(content, causal) - want).max() > 1e-2


def products(q: np.ndarray, w: np.ndarray, beta: np.ndarray, k: np.ndarray, i: int, j: int) -> float:
    """q_i^T H_i ... H_{j+1} k_j for one head, the matrices multiplied out (q, w, k: (S, c); beta: (S,))."""
    m = np.eye(q.shape[1])
    for t in range(i, j, -1):
        m = m @ householder(w[t], beta[t])
    return float(q[i] @ m @ k[j])


def test_the_blocked_form_pytorch_trains_with_is_the_papers_products_across_blocks():
    """The form score_bias uses outside an export (model.variants.path.chunked_bias: blocks of slots, each whole
    block between a query and a key as one matrix) against the products multiplied out, with blocks of 4 over 23
    slots (six blocks, the last padded), pads (beta 0) at the start, and the last 9 slots as queries; and its
    gradient against finite differences (gradcheck), since training differentiates it."""
    from model.variants.path import chunked_bias

    rng = np.random.default_rng(3)
    H, S, T, c = 2, 23, 9, 5
    q, k = rng.standard_normal((H, T, c)), rng.standard_normal((H, S, c))
    w = rng.standard_normal((H, S, c))
    w /= np.linalg.norm(w, axis=-1, keepdims=True)
    beta = rng.uniform(0.1, 1.9, (H, S))
    beta[:, :3] = 0.0
    got = chunked_bias(*(torch.from_numpy(x)[None] for x in (q, w, beta, k)), chunk=4)[0].numpy()
    for h in range(H):
        qs = np.concatenate((np.zeros((S - T, c)), q[h]))  # the queries at the last T slots
        for i in range(S - T, S):
            for j in range(S):
                want = products(qs, w[h], beta[h], k[h], i, j) - qs[i] @ k[h, j] if j <= i else 0.0
                assert got[h, i - (S - T), j] == pytest.approx(want, abs=1e-12), (h, i, j)
    small = [torch.from_numpy(x[:1, -7:].copy())[None].requires_grad_() for x in (q, w, beta, k)]
    small[0] = torch.from_numpy(q[:1, -3:].copy())[None].requires_grad_()
    assert torch.autograd.gradcheck(lambda *xs: chunked_bias(*xs, chunk=3), small)


def keys(H: int, S: int, d: int, beta_logit: float | None = None) -> torch.Tensor:
    k = torch.randn(1, H, S, d, dtype=torch.float64, generator=torch.Generator().manual_seed(S))
    if beta_logit is not None:
        k[..., 2 * ((d - 1) // 2)] = beta_logit
    return k


def test_beta_zero_is_attention_without_positions_and_beta_two_a_reflection():
    """beta -> 0 (a very negative logit) leaves q . k alone; beta -> 2 makes each H_t the reflection across w_t's
    orthogonal plane, so with one token between query and key the logit is q . k - 2 (q . w)(w . k)."""
    model = Transformer(preset("tiny", "path")).double()
    H, d, S = 4, model.cfg.head_dim, 6
    c = (d - 1) // 2
    q = torch.randn(1, H, S, d, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    q, _ = model.pos.rotate_layer(q, q, None, 0)
    pos = torch.arange(S)[None]
    with torch.no_grad():
        off = model.pos.score_bias(q, pos, pos, k=keys(H, S, d, -60.0), layer=0)
        k = keys(H, S, d, 60.0)
        flip = model.pos.score_bias(q, pos, pos, k=k, layer=0)
    assert float(off.abs().max()) < 1e-20
    for h in range(H):
        w = k[0, h, 2, c:2 * c] / k[0, h, 2, c:2 * c].norm()
        qv, kv = q[0, h, 2, :c], k[0, h, 1, :c]  # query at 2, key at 1: H_2 alone between them
        want = -2 * float(qv @ w) * float(w @ kv) / math.sqrt(d)
        assert float(flip[0, h, 2, 1]) == pytest.approx(want, rel=1e-5)  # 1e-6: the norm's epsilon
        assert float(flip[0, h, 2, 2]) == 0.0  # a key's own H is not applied


def test_pads_anywhere_in_a_row_change_nothing():
    """Pads on the left and in the middle of a row, whatever their w and beta channels hold, leave the bias between
    the real tokens as the row without them gives it."""
    model = Transformer(preset("tiny", "path")).double()
    H, d, S = 4, model.cfg.head_dim, 20
    real = torch.ones(1, S, dtype=torch.int64)
    real[0, :3] = 0
    real[0, 9:12] = 0
    q = torch.randn(1, H, S, d, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    q, _ = model.pos.rotate_layer(q, q, None, 0)
    k = keys(H, S, d)
    k[0, :, ~real[0].bool(), 2 * ((d - 1) // 2)] = 8.0  # a pad counted as a token would be near a reflection
    slot = real[0].bool()
    with torch.no_grad():
        padded = model.pos.score_bias(q, positions_from_mask(real), positions_from_mask(real), k=k, layer=0)
        n = int(slot.sum())
        alone = model.pos.score_bias(q[:, :, slot], torch.arange(n)[None], torch.arange(n)[None], k=k[:, :, slot])
    got = padded[0][:, slot][:, :, slot]
    torch.testing.assert_close(torch.tril(got), torch.tril(alone[0]), atol=1e-12, rtol=0)


def test_a_cached_decode_is_the_full_forward_past_the_context():
    """Each new query reads every cached key's w and beta; the cached keys themselves never change."""
    check_cached_decode(tiny_model("path"), 2 * CONTEXT + 4, CONTEXT)


def test_left_pads_and_a_padded_piece_leave_each_rows_answer_as_alone():
    """A row behind left pads, decoded in two pieces of which the second is left-padded too (pads in the middle of
    its cache), then a cached step: the logits and the real keys' maps of that row alone."""
    check_row_alone_in_padded_pieces(tiny_model("path"))


def test_a_config_it_cannot_run_is_refused():
    with pytest.raises(ConfigError, match="head_dim must be >= 3"):
        check_config(preset("tiny", "path", d_model=8, n_heads=4))
    for name, value in (("attn_scale_dim", 64.0), ("attn_softcap", 20.0)):  # they would scale or cap q.k alone
        with pytest.raises(ConfigError, match=f"{name} applies to q.k alone"):
            check_config(preset("tiny", "path", **{name: value}))


def test_randomized_training_positions_are_refused():
    with pytest.raises(ConfigError, match="the path variant reads no position index to randomize"):
        check_random_positions(preset("tiny", "path"), 64)


def test_an_intervention_may_not_give_positions_but_switching_a_layer_off_removes_its_products_only(exported):
    """The worker refuses positions for path in one line; layer 0 switched off gives PyTorch's logits under the same
    switch, whose layer-0 maps are the paper's content scores alone: the products gone, w and beta still out of
    q . k."""
    model, folder, _ = exported
    check_layer_off(model, folder,
                    lambda x: paper_scores(x, *projection(model, 0), model.cfg.n_heads, products=False))
