"""The Forgetting Transformer (Lin, Nikishin, He, Courville 2025, arXiv 2503.02130) proven against its paper: the
forget gates and the decay D_ij = sum_{l=j+1}^{i} log f_l written out here in plain loops (section 2's equations)
from the layer's own input and the projection's weights, compared with the exported graph's attention maps in
onnxruntime on a left-padded batch past the trained context; the paper's special case, constant gates giving
ALiBi's linear decay with slope log f; pads in the middle of a row adding no decay; cached decoding; and the
paths that give positions from outside refusing it, while an intervention's layer switch removes D and nothing
else."""

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

covers("fox")  # tests/model/test_variants.py's check that every registered variant has its own tests


# --- the paper's equations, independently of model/variants ---------------------------------------------------

def sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def paper_scores(x: np.ndarray, wq: np.ndarray, wk: np.ndarray, bq: np.ndarray, bk: np.ndarray, wf: np.ndarray,
                 bf: np.ndarray, heads: int, decay: bool = True) -> np.ndarray:
    """(H, T, T) logits of one row's real tokens from the layer's input x (T, D):
      q_i, k_j   the head's query and key (its first d - 1 channels: the last one of the key projection is w_f)
      f_t        sigmoid(w_f . x_t + b_f)
      logit_ij   q_i . k_j / sqrt(d) + sum_{l=j+1}^{i} log f_l, for j <= i   (d: the head's size; without `decay`,
                 the first term alone)."""
    T = x.shape[0]
    q = (x @ wq.T + bq).reshape(T, heads, -1)
    k = (x @ wk.T + bk).reshape(T, heads, -1)
    d = q.shape[-1]
    out = np.zeros((heads, T, T))
    for h in range(heads):
        f = [sigmoid(float(x[t] @ wf[h] + bf[h])) for t in range(T)]
        for i in range(T):
            for j in range(i + 1):
                bias = sum(math.log(f[t]) for t in range(j + 1, i + 1)) if decay else 0.0
                out[h, i, j] = float(q[i, h, :d - 1] @ k[j, h, :d - 1]) / math.sqrt(d) + bias
    return out


def projection(model: Transformer, layer: int) -> tuple[np.ndarray, ...]:
    """(wq, wk, bq, bk, w_f, b_f) of a layer's qkv projection: w_f is each key head's last row."""
    cfg, qkv = model.cfg, model.blocks[layer].attn.qkv
    H, Dh = cfg.n_heads, cfg.head_dim
    w = qkv.weight.detach().double().numpy()
    b = qkv.bias.detach().double().numpy() if qkv.bias is not None else np.zeros(w.shape[0])
    wq, wk, bq, bk = w[:H * Dh], w[H * Dh:2 * H * Dh], b[:H * Dh], b[H * Dh:2 * H * Dh]
    last = [h * Dh + Dh - 1 for h in range(H)]
    return wq, wk, bq, bk, wk[last], bk[last]


@pytest.fixture(scope="module")
def exported(tiny_artifact):
    """The fox artifact of the run's tiny artifacts (validated as every variant's), beside its PyTorch model."""
    return tiny_model("fox"), *tiny_artifact("fox")


def test_the_export_says_what_an_intervention_may_do(exported):
    _, folder, _ = exported
    meta = json.loads((folder / "model.json").read_text())
    assert meta["variant"] == "fox" and meta["max_positions"] is None
    assert meta["intervene"]["positions"] is False  # the gates make the positions: none may be given
    assert meta["intervene"]["in_layers"] is True  # but a layer's decay may be switched off
    assert (folder / "encoding.onnx").exists()


def test_the_graphs_attention_maps_are_the_papers(exported):
    """onnxruntime's attention maps of every layer equal the softmax of the paper's logits over each row's real
    tokens, on a left-padded batch whose long row runs past the trained context."""
    model, folder, _ = exported
    rows, ids, mask, maps = graph_maps(model, folder, (2 * CONTEXT + 5, 9))  # maps: (B, L, H, T, S)
    cfg = model.cfg
    for layer, x in enumerate(layer_inputs(model, ids, mask)):
        x = x.detach().double().numpy()
        weights = projection(model, layer)
        for b, row in enumerate(rows):
            pad = ids.shape[1] - len(row)
            causal = np.tril(np.ones((len(row), len(row)), bool))
            scores = paper_scores(x[b, pad:], *weights, cfg.n_heads)
            want = softmax_rows(scores, causal)
            np.testing.assert_allclose(maps[b, layer, :, pad:, pad:], want, atol=2e-5, rtol=0)
            assert np.all(maps[b, layer, :, :, :pad] == 0)  # no probability on the pads
            # the decay matters: without it the maps are far from these (the check can fail)
            content = paper_scores(x[b, pad:], *weights, cfg.n_heads, decay=False)
            assert np.abs(softmax_rows(content, causal) - want).max() > 1e-2


def test_constant_gates_give_alibis_linear_decay_and_pads_add_none():
    """The paper's remark: with every f_l = f, D_ij = (i - j) log f, ALiBi's bias with slope -log f.  Keys whose
    last channel is a constant logit per head give that line exactly, over a row with pads on the left and in the
    middle (whose logits would decay if they counted), read back between real tokens only."""
    model = Transformer(preset("tiny", "fox")).double()
    H, d, S = 4, model.cfg.head_dim, 24
    logits = torch.tensor([-2.0, 0.0, 1.5, 4.0], dtype=torch.float64)
    real = torch.ones(1, S, dtype=torch.int64)
    real[0, :3] = 0
    real[0, 10:13] = 0
    k = torch.randn(1, H, S, d, dtype=torch.float64)
    k[..., -1] = logits[:, None]
    k[0, :, ~real[0].bool(), -1] = -30.0  # a pad's gate would nearly zero everything it spans
    k_pos = positions_from_mask(real)
    with torch.no_grad():
        bias = model.pos.score_bias(torch.zeros(1, H, S, d, dtype=torch.float64), k_pos, k_pos, k=k, layer=0)
    slot = [t for t in range(S) if real[0, t]]
    for h in range(H):
        log_f = math.log(sigmoid(float(logits[h])))
        for a, i in enumerate(slot):
            for b, j in enumerate(slot[:a + 1]):
                assert float(bias[0, h, i, j]) == pytest.approx((a - b) * log_f, abs=1e-12), (h, i, j)


def test_the_gate_channel_is_out_of_the_content_score():
    """A query's last channel never reaches q . k: changing it leaves the maps alone; the keys' last channel is the
    gate, so changing it changes them."""
    model = tiny_model("fox")
    attn = model.blocks[0].attn
    q, k = torch.randn(1, 4, 5, model.cfg.head_dim), torch.randn(1, 4, 5, model.cfg.head_dim)
    rq, rk = model.pos.rotate_layer(q, k, None, 0)
    assert torch.equal(rk, k) and torch.equal(rq[..., :-1], q[..., :-1]) and not rq[..., -1].any()
    ids = torch.randint(0, 256, (1, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        base = model(ids).attentions
        D = model.cfg.head_dim
        push = 3.0 * torch.randn(model.cfg.d_model, generator=torch.Generator().manual_seed(3))
        row = attn.qkv.weight[D - 1].clone()  # head 0's query, last channel
        attn.qkv.weight[D - 1] += push
        same = model(ids).attentions
        attn.qkv.weight[D - 1] = row
        gate = model.cfg.n_heads * D + D - 1  # head 0's key, last channel: the gate
        attn.qkv.weight[gate] += push
        moved = model(ids).attentions
        attn.qkv.weight[gate] -= push
    torch.testing.assert_close(same, base, atol=1e-6, rtol=0)
    assert (moved[0, 0, 0] - base[0, 0, 0]).abs().max() > 1e-3


def test_a_cached_decode_is_the_full_forward_past_the_context():
    """Each new query reads every cached key's gate; the cached keys themselves never change."""
    check_cached_decode(tiny_model("fox"), 2 * CONTEXT + 4, CONTEXT)


def test_left_pads_and_a_padded_piece_leave_each_rows_answer_as_alone():
    """A row behind left pads, decoded in two pieces of which the second is left-padded too (pads in the middle of
    its cache), then a cached step: the logits and the real keys' maps of that row alone.  A pad's gate, which would
    decay every pair it sits between, adds nothing."""
    check_row_alone_in_padded_pieces(tiny_model("fox"))


def test_a_config_it_cannot_run_is_refused():
    with pytest.raises(ConfigError, match="head_dim must be >= 2"):
        check_config(preset("tiny", "fox", d_model=4, n_heads=4))


def test_randomized_training_positions_are_refused():
    with pytest.raises(ConfigError, match="the fox variant reads no position index to randomize"):
        check_random_positions(preset("tiny", "fox"), 64)


def test_an_intervention_may_not_give_positions_but_switching_a_layer_off_removes_its_decay_only(exported):
    """The worker refuses positions for fox in one line; layer 0 switched off gives PyTorch's logits under the same
    switch, whose layer-0 maps are the paper's content scores alone: D gone, the gate's channel still out of q . k."""
    model, folder, _ = exported
    check_layer_off(model, folder,
                    lambda x: paper_scores(x, *projection(model, 0), model.cfg.n_heads, decay=False))
