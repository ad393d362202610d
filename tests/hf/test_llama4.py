"""Llama 4's text model (iRoPE) against transformers' eager forward, the independent reference: a RoPE layer chunked
by 8 positions with the L2 q/k norm and llama3-scaled interleaved RoPE, a NoPE layer with the query temperature, a
dense layer and one of 4 experts (top 2, the router's sigmoid scaling the expert's input) beside a shared expert.

transformers' batched call takes the temperature's position from the cache slot (left padding counts), posenc from
the mask (a row's own positions, as its chunks and rotations are in both): a left-padded row's temperature differs
there and nowhere else (test_batched_transformers_differs_only_in_the_padded_rows_temperature), so each row of
posenc's left-padded batch is compared with transformers run on that row alone.  Lengths 1, 7 (inside the first
chunk) and 200 (past the chunk, past the RoPE's original 64 and 50 temperature steps), the cache steps past the chunk
boundary, 32 greedy tokens against generate(), the experts alone on many tokens, the fast graph and the worker."""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import shutil

import grpc
import pytest
import torch

from model.hf import import_folder
from model.transformer import Transformer
from protos.posenc.v1 import posenc_pb2 as pb
from protos.posenc.v1 import posenc_pb2_grpc
from tests.hf import test_families, test_families_served
from tests.hf.helpers import CHUNK, VOCAB
from tests.hf.test_families import hf_forward
from tests.hf.test_hf_parity import Graph, batch
from tests.serving import start

FAMILY = "llama4"


@pytest.fixture(scope="module")
def llama4(hf_zoo):
    entry = hf_zoo[FAMILY]
    return entry, import_folder(entry["folder"])[0]


def alone(hf, ids, mask, row, past=None):
    """transformers on row `row`'s real tokens alone (no padding), with that row's own cache."""
    real = ids[row][mask[row, -ids.shape[1]:].bool()][None]
    with torch.no_grad():
        return hf(input_ids=real, output_attentions=True, use_cache=True, past_key_values=past)


def compare_rows(hf, ids, mask, logits, attentions, pasts=None):
    """Each row's real queries and keys of posenc's left-padded batch against transformers on the row alone (whose
    cache keeps a chunked layer's last keys only: there posenc's maps are compared on those columns and must be
    exactly 0 on the keys before them); returns each row's transformers output (its cache for the next step)."""
    refs, worst = [], (0.0, 0.0)
    T = ids.shape[1]
    for row in range(ids.shape[0]):
        ref = alone(hf, ids, mask, row, None if pasts is None else pasts[row])
        q, k = mask[row, -T:].bool(), mask[row].bool()
        d_logits, d_attn = (ref.logits[0] - logits[row][q]).abs().max().item(), 0.0
        for layer, a in enumerate(ref.attentions):
            ours = attentions[row, layer][:, q][:, :, k]
            kept = a.shape[-1]  # transformers' cache keeps a chunked layer's last keys only: ours is 0 before them
            assert torch.count_nonzero(ours[..., :-kept]) == 0
            d_attn = max(d_attn, (a[0] - ours[..., -kept:]).abs().max().item())
        worst = (max(worst[0], d_logits), max(worst[1], d_attn))
        refs.append(ref)
    assert worst[0] <= 1e-4 and worst[1] <= 3e-5, worst
    return refs


@pytest.mark.parametrize("length", [7, 200])
def test_pytorch_model_equals_transformers(llama4, length):
    (entry, model), (ids, mask) = llama4, batch(length)
    with torch.no_grad():
        out = model(ids, mask)
    compare_rows(entry["hf"], ids, mask, out.logits, out.attentions)


@pytest.mark.parametrize("length", [1, 7, 200])
def test_onnx_graph_equals_transformers(llama4, length):
    entry, graph = llama4[0], Graph(llama4[0]["artifact"])
    ids, mask = batch(length, seed=1)
    logits, attentions, _ = graph.run(ids, mask, graph.empty(3))
    compare_rows(entry["hf"], ids, mask, logits, attentions)


def test_onnx_kv_cache_steps_past_the_chunk_equal_transformers_cache(llama4):
    """A prefill of 7 (row 0), 3 and 1 tokens, then 4 steps: row 0 crosses the chunk boundary at position 8."""
    hf, graph = llama4[0]["hf"], Graph(llama4[0]["artifact"])
    ids, mask = batch(CHUNK - 1, seed=2)
    logits, attentions, past = graph.run(ids, mask, graph.empty(3))
    refs = compare_rows(hf, ids, mask, logits, attentions)
    g = torch.Generator().manual_seed(3)
    for _ in range(4):
        step = torch.randint(0, VOCAB, (3, 1), generator=g)
        mask = torch.cat([mask, torch.ones(3, 1, dtype=torch.int64)], dim=1)
        logits, attentions, past = graph.run(step, mask, past)
        refs = compare_rows(hf, step, mask, logits, attentions, [r.past_key_values for r in refs])


def test_batched_transformers_differs_only_in_the_padded_rows_temperature(llama4):
    """Why rows are compared alone: with the temperature off on both sides, transformers' left-padded batch (its
    chunks counted from each row's first real token, positions from the mask) equals posenc's on every real row;
    with it on, the padded row's NoPE queries are scaled by their slot's temperature in transformers and differ."""
    entry, model = llama4
    hf = copy.deepcopy(entry["hf"])
    c = model.cfg  # every layer's record untempered too
    cold = Transformer(c.replace(temperature_floor=0.0, temperature_scale=0.0, layers=[
        dataclasses.replace(c.layer(i), temperature=False) for i in range(c.n_layers)])).eval()
    cold.load_state_dict(model.state_dict())
    ids, mask = batch(40, seed=9)
    real = mask.bool()
    with torch.no_grad():
        warm_ref, warm = hf_forward(FAMILY, hf, ids, mask), model(ids, mask)
        for layer in hf.model.layers:
            layer.self_attn.attn_temperature_tuning = False
        cold_ref, cold_out = hf_forward(FAMILY, hf, ids, mask), cold(ids, mask)
    assert (cold_ref.logits - cold_out.logits)[real].abs().max() <= 1e-4
    diff = (warm_ref.logits - warm.logits).abs().amax(-1)  # (rows, positions)
    assert diff[0].max() <= 1e-4 and diff[1][real[1]].max() > 1e-2  # row 0 is unpadded, row 1 half padding


def test_chunked_layer_sees_only_its_block(llama4):
    """In the graph's maps under left padding: layer 0 is exactly 0 on every key of an earlier block of 8 positions
    and positive inside the block; layer 1 (full) is positive on every earlier key."""
    graph = Graph(llama4[0]["artifact"])
    ids, mask = batch(30, seed=5)
    _, attentions, _ = graph.run(ids, mask, graph.empty(3))
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    seen = (pos[:, None, :] <= pos[:, :, None]) & mask.bool()[:, None, :] & mask.bool()[:, :, None]
    same = pos[:, :, None] // CHUNK == pos[:, None, :] // CHUNK
    chunked, full = (attentions[:, layer].permute(0, 2, 3, 1) for layer in (0, 1))  # (B, T, S, heads)
    assert torch.count_nonzero(chunked[seen & ~same]) == 0 and (chunked[seen & same] > 0).all()
    assert (full[seen] > 0).all() and (seen & ~same).any()


def test_experts_layer_equals_transformers_moe_on_many_tokens(llama4):
    """The MoE layer alone on 4,096 hidden states: posenc's dense experts, each reading the token times its router
    score, equal transformers' Llama4TextMoe (its router, scaled inputs, experts and shared expert)."""
    entry, model = llama4
    ours, theirs = model.blocks[1].mlp, entry["hf"].model.layers[1].feed_forward
    x = torch.randn(4096, model.cfg.d_model, generator=torch.Generator().manual_seed(8)) * 2
    with torch.no_grad():
        want, got = theirs(x)[0], ours(x)
        chosen = torch.topk(theirs.router(x)[1], 2, dim=-1).indices
    assert chosen.unique().numel() == model.cfg.n_experts
    assert (got - want).abs().max().item() <= 1e-5 * max(1.0, want.abs().max().item())


def test_greedy_tokens_equal_transformers_generate(hf_zoo):
    test_families.test_greedy_tokens_equal_transformers_generate(hf_zoo, FAMILY)


def test_artifact_validates_and_records_the_family(hf_zoo):
    test_families.test_artifact_validates_and_records_the_family(hf_zoo, FAMILY)


def test_chunks_and_temperature_keep_the_padded_fast_graph(hf_zoo, tmp_path):
    """GroupQueryAttention has no block mask: the fast graph keeps the exact graph's Attention nodes and equals it."""
    from export.fuse import add_to_artifact
    from export.gqa import ineligible

    folder = tmp_path / FAMILY
    folder.mkdir()
    for p in hf_zoo[FAMILY]["artifact"].iterdir():
        os.link(p, folder / p.name)
    meta = json.loads((folder / "model.json").read_text())
    assert "chunked attention" in ineligible(meta)
    meta["config"]["attention_chunk"] = 0
    assert "temperature" in ineligible(meta)
    entry = add_to_artifact(folder)
    assert entry["layout"] == "padded" and entry["parity"]["max_abs_diff"] <= 1e-4


@pytest.fixture(scope="module")
def served(hf_zoo, tmp_path_factory):
    models = tmp_path_factory.mktemp("served-llama4")
    shutil.copytree(hf_zoo[FAMILY]["artifact"], models / FAMILY)
    srv = start(models)
    ch = grpc.insecure_channel(f"127.0.0.1:{srv.port}")
    yield posenc_pb2_grpc.PosencStub(ch)
    ch.close()
    srv.stop(grace=1)


def test_predict_and_generate_equal_transformers(served, hf_zoo):
    test_families_served.test_predict_and_generate_equal_transformers(served, hf_zoo, FAMILY)


def test_encoding_note_names_the_chunked_and_tempered_layers(served, hf_zoo):
    """As transformers' config gives them: the chunked_attention layers with attention_chunk_size, the NoPE layers'
    temperature (floor_scale, attn_scale)."""
    theirs = hf_zoo[FAMILY]["hf"].config
    note = served.Encoding(pb.EncodingRequest(model=FAMILY, length=8), timeout=30).note
    chunked = [str(i) for i, t in enumerate(theirs.layer_types) if t == "chunked_attention"]
    nope = [str(i) for i, r in enumerate(theirs.no_rope_layers) if not r]
    assert chunked == ["0"] and nope == ["1"]
    assert (f"chunked attention in layer {', '.join(chunked)}: a query sees the keys of its own block of "
            f"{theirs.attention_chunk_size} positions") in note, note
    assert (f"queries of layer {', '.join(nope)} scaled by log1p(floor((position + 1) / {theirs.floor_scale:g})) "
            f"x {theirs.attn_scale:g} + 1") in note, note
