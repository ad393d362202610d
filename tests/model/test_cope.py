"""CoPE (Golovneva, Wang, Weston, Sukhbaatar 2024, arXiv 2405.18719) proven against its paper: the gates, the
counts and the interpolated position embedding written out here in plain loops (section 3's equations) and compared
with the exported graph's attention maps in onnxruntime on a left-padded batch past the trained context; the
paper's point, that a position counts the tokens the gates pick and nothing else, with gates forced to 0 or 1 and
pads among the keys; its export validated like every variant's, the worker's padded batches and cached decoding
included; and the paths that give positions from outside (randomized training positions, an intervention's)
refusing it, since its positions are counts."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from model.attention import Intervention, positions_from_mask
from model.config import preset
from model.errors import ConfigError
from model.train import check_random_positions
from model.transformer import Transformer
from service import intervention
from service.artifacts import load_artifact
from service.errors import InvalidArgument
from tests.model.helpers import check_cached_decode, tiny_model
from tests.model.test_research_variants import CONTEXT, graph_maps, layer_inputs, softmax_rows
from tests.model.test_variants import covers

pytestmark = pytest.mark.numerics

covers("cope")  # tests/model/test_variants.py's check that every registered variant has its own tests
NPOS = CONTEXT + 1  # the authors' block_size + 1


def given_tables(model: Transformer, seed: int = 7) -> Transformer:
    """Every layer's position table set to distinct values (the authors start it at zero: no bias at all)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for table in model.pos.tables:
            table.copy_(torch.randn(table.shape, generator=g) * 0.5)
    return model


# --- the paper's equations, independently of model/variants ---------------------------------------------------

def sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def paper_scores(q: np.ndarray, k: np.ndarray, table: np.ndarray) -> np.ndarray:
    """(H, T, T) logits of one row's real tokens, q and k (T, H, d), table E (d, npos), keys j <= i:
      gates    g_ij = sigmoid(q_i . k_j / sqrt(d))
      position p_ij = sum_{t=j}^{i} g_it, at most npos - 1
      e[p]     = (p - floor p) e[ceil p] + (1 - p + floor p) e[floor p]
      logit    = (q_i . k_j + q_i . e[p_ij]) / sqrt(d)        (the authors' code divides both terms)."""
    T, H, d = q.shape
    npos = table.shape[1]
    out = np.zeros((H, T, T))
    for h in range(H):
        for i in range(T):
            for j in range(i + 1):
                p = min(sum(sigmoid(float(q[i, h] @ k[t, h]) / math.sqrt(d)) for t in range(j, i + 1)), npos - 1)
                lo, hi = math.floor(p), math.ceil(p)
                e = (p - lo) * table[:, hi] + (1 - p + lo) * table[:, lo]
                out[h, i, j] = (float(q[i, h] @ k[j, h]) + float(q[i, h] @ e)) / math.sqrt(d)
    return out


# --- the exported artifact --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def exported(tiny_artifact):
    """The cope artifact of the run's tiny artifacts (tests/conftest.py: validated as every variant's, its tables
    random like every weight of tiny_model, which is seeded), beside its PyTorch model: (model, folder, report)."""
    return tiny_model("cope"), *tiny_artifact("cope")


def test_the_export_says_what_an_intervention_may_do(exported):
    model, folder, _ = exported
    assert all(torch.count_nonzero(t) > 0 for t in model.pos.tables)  # tables that move the maps checked below
    meta = json.loads((folder / "model.json").read_text())
    assert meta["variant"] == "cope" and meta["max_positions"] is None
    assert meta["intervene"]["positions"] is False  # its positions are counts: an intervention may not give them
    assert meta["intervene"]["in_layers"] is True  # but it may switch a layer's bias off
    assert (folder / "encoding.onnx").exists()


def test_the_graphs_attention_maps_are_the_papers(exported):
    """onnxruntime's attention maps of every layer equal the softmax of the paper's logits over each row's real
    tokens, on a left-padded batch whose long row runs past the trained context (its counts reach the clamp)."""
    model, folder, _ = exported
    rows, ids, mask, maps = graph_maps(model, folder, (CONTEXT + 8, 9))  # maps: (B, L, H, T, S)
    cfg = model.cfg
    for layer, x in enumerate(layer_inputs(model, ids, mask)):
        q, k, _ = model.blocks[layer].attn.project(x)
        q = q.detach().double().numpy().reshape(len(rows), -1, cfg.n_heads, cfg.head_dim)
        k = k.detach().double().numpy().reshape(len(rows), -1, cfg.n_heads, cfg.head_dim)
        table = model.pos.tables[layer].detach().double().numpy()
        for b, row in enumerate(rows):
            pad = ids.shape[1] - len(row)
            causal = np.tril(np.ones((len(row), len(row)), bool))
            want = softmax_rows(paper_scores(q[b, pad:], k[b, pad:], table), causal)
            np.testing.assert_allclose(maps[b, layer, :, pad:, pad:], want, atol=2e-5, rtol=0)
            assert np.all(maps[b, layer, :, :, :pad] == 0)  # no probability on the pads
            # the position term matters: without it the maps are far from these (the check can fail)
            content = np.einsum("thd,shd->hts", q[b, pad:], k[b, pad:]) / math.sqrt(cfg.head_dim)
            assert np.abs(softmax_rows(content, causal) - want).max() > 1e-2


# --- what the positions count ---------------------------------------------------------------------------------

def test_positions_count_the_gated_tokens_and_never_a_pad():
    """With gates forced to 1 or 0 (q.k/sqrt(d) = +-70), p_ij is the number of gated keys from j to i, both ends
    included; read back from the bias, which at a whole position n is q . e[n] / sqrt(d).  Pads, left and in the
    middle of a row, get keys whose gate would be 1, and still count for nothing.  Past npos - 1 the count stops."""
    model = Transformer(preset("tiny", "cope")).double()
    d = model.cfg.head_dim
    table = model.pos.tables[1]
    with torch.no_grad():
        table.zero_()
        table[0] = torch.arange(NPOS, dtype=torch.float64) * 0.25 + 1.0  # e[n]'s first coordinate: 1 + n/4
    S = 2 * CONTEXT
    real = torch.ones(2, S, dtype=torch.int64)
    real[0, :5] = 0  # left pads
    real[0, 12:15] = 0  # pads in the middle
    real[0, 20] = 0
    gated = torch.zeros(2, S, dtype=torch.bool)
    gated[0] = torch.rand(S, generator=torch.Generator().manual_seed(0)) < 0.5
    gated[0, ~real[0].bool()] = True  # a pad's gate would be 1 if it were counted
    gated[1] = True  # every token gated: the count grows past npos - 1
    unit = torch.zeros(d, dtype=torch.float64)
    unit[0] = 1.0
    k = torch.where(gated[:, None, :, None], unit, -unit).expand(2, 4, S, d)  # (B, H, S, d)
    q = (70 * math.sqrt(d) * unit).expand(2, 4, S, d)  # q . k / sqrt(d) = +-70
    k_pos = positions_from_mask(real)
    with torch.no_grad():
        bias = model.pos.score_bias(q, k_pos, k_pos, k=k, layer=1)
    read = (bias * math.sqrt(d) / (70 * math.sqrt(d)) - 1.0) / 0.25  # back from 1 + n/4 to n
    for b in range(2):
        for i in range(S):
            for j in range(i + 1):
                if not (real[b, i] and real[b, j]):
                    continue
                count = sum(1 for t in range(j, i + 1) if real[b, t] and gated[b, t])
                want = min(count, NPOS - 1)
                assert read[b, :, i, j].tolist() == pytest.approx([want] * 4, abs=1e-9), (b, i, j)
    assert read[1, 0, S - 1, 0] == pytest.approx(NPOS - 1)  # the clamp: 32 gated tokens count as 16


def test_a_cached_decode_is_the_full_forward_past_the_context():
    """Each new query recomputes its gates over every cached key; the cached keys themselves never change."""
    check_cached_decode(given_tables(tiny_model("cope")), 2 * CONTEXT + 4, CONTEXT)


def test_the_tables_start_at_zero_and_training_reaches_them():
    """As in the authors' code: one d x (context + 1) table per layer, all zeros (no bias at the start), and a
    training step's gradient reaches every table through z = q E."""
    torch.manual_seed(0)
    model = Transformer(preset("tiny", "cope")).train()
    cfg = model.cfg
    assert [tuple(t.shape) for t in model.pos.tables] == [(cfg.head_dim, NPOS)] * cfg.n_layers
    assert all(torch.equal(t, torch.zeros_like(t)) for t in model.pos.tables)
    ids = torch.randint(0, 256, (2, 12))
    out = model(ids, output_attentions=False)
    torch.nn.functional.cross_entropy(out.logits[:, :-1].reshape(-1, 256), ids[:, 1:].reshape(-1)).backward()
    assert all(t.grad is not None and t.grad.abs().sum() > 0 for t in model.pos.tables)


# --- positions from outside: refused ----------------------------------------------------------------------------

def test_randomized_training_positions_are_refused():
    with pytest.raises(ConfigError, match="the cope variant reads no position index to randomize"):
        check_random_positions(preset("tiny", "cope"), 64)


def test_an_intervention_may_not_give_positions_but_may_switch_a_layer_off(exported):
    """The worker refuses positions (or a shift) for cope in one line naming the field; layer 0's bias switched off
    on two prompts of different lengths (left-padded, the pads at position 0 in its feeds) gives PyTorch's logits
    under the same switch, and not the plain ones."""
    model, folder, _ = exported
    loaded = load_artifact(folder, threads=1)
    prompts = [[7, 99, 3, 140, 21], [200, 5, 17, 63, 88, 9, 250, 31, 44]]
    for edit in (intervention.Intervention(positions=(0, 1, 2, 3, 4)), intervention.Intervention(shift=3)):
        with pytest.raises(InvalidArgument, match="is not a function of the position index"):
            intervention.resolve(loaded, edit, prompts[0], None)
    rows = [intervention.resolve(loaded, intervention.Intervention(positional_off=(0,)), p, None) for p in prompts]
    got = intervention.run(loaded, rows)["logits"]
    with torch.no_grad():
        for b, p in enumerate(prompts):
            want = model(torch.tensor([p]), intervention=_layer_off(model, 0)).logits[0]
            np.testing.assert_allclose(got[b, -len(p):], want.numpy(), atol=1e-4, rtol=0)
            assert not np.allclose(got[b, -len(p):], model(torch.tensor([p])).logits[0].numpy(), atol=1e-3)


def _layer_off(model: Transformer, layer: int):
    """An intervention (model.attention.Intervention) on one row: `layer`'s CoPE bias off, every head kept."""
    on = torch.ones(1, model.cfg.n_layers)
    on[0, layer] = 0.0
    return Intervention(on, torch.ones(1, model.cfg.n_layers, model.cfg.n_heads))
