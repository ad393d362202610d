"""The fast graph (export.fuse) of an imported LLaMA: fused norms, no maps, the same logits and cache as
transformers' own forward, loaded by the worker beside the exact graph, which then loads only when maps are wanted."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import onnx
import pytest
import torch

from export import artifact
from export.fuse import FAST_ONNX, LOGITS_FROM, add_to_artifact, main
from service.artifacts import load_artifact

TOL = 1e-4


@pytest.fixture(scope="module")
def fast_llama(hf_families, tmp_path_factory):
    """A hard-linked copy of the imported tiny LLaMA with its fast graph added (python -m export.fuse's path)."""
    src = hf_families["llama"]["artifact"]
    folder = tmp_path_factory.mktemp("fast") / "llama"
    folder.mkdir()
    for p in src.iterdir():
        os.link(p, folder / p.name)
    entry = add_to_artifact(folder)
    return folder, entry, hf_families["llama"]["hf"]


def _feeds(session, ids, mask, past=None, logits_from=0):
    feeds = {"input_ids": ids, "attention_mask": mask}
    carried = [spec for spec in session.get_inputs() if spec.name.startswith("past_key_values")]
    for i, spec in enumerate(carried):
        feeds[spec.name] = past[i] if past is not None else np.zeros((len(ids), spec.shape[1], 0, spec.shape[3]),
                                                                      np.float32)
    if LOGITS_FROM in {spec.name for spec in session.get_inputs()}:
        feeds[LOGITS_FROM] = np.array([logits_from], np.int64)
    return feeds


def test_fast_graph_is_fused_and_has_no_maps(fast_llama):
    folder, entry, hf = fast_llama
    proto = onnx.load(str(folder / FAST_ONNX))
    ops = {n.op_type for n in proto.graph.node}
    layers = hf.config.num_hidden_layers
    # every norm but the first (no residual before it) takes its residual Add along: 2 per layer, the final one
    assert entry["fused"] == {"SimplifiedLayerNormalization": 1, "SkipSimplifiedLayerNormalization": 2 * layers}
    assert not ops & {"Pow", "ReduceMean", "Sqrt", "Reciprocal", "Softmax"}
    assert "attentions" not in {o.name for o in proto.graph.output}
    assert all(len(n.output) <= 3 for n in proto.graph.node if n.op_type == "Attention")
    assert entry["parity"]["max_abs_diff"] <= TOL
    assert entry["logits_from"] == LOGITS_FROM and LOGITS_FROM in {i.name for i in proto.graph.input}
    artifact.verify(folder)  # the manifest covers fast.onnx


def test_last_position_logits_alone_equal_transformers_on_padded_rows(fast_llama):
    """logits_from -1: one row of logits per sequence, the last real token's, equal to transformers' forward of
    each row alone; and the cache it returns carries on like the whole prefill's."""
    folder, _, hf = fast_llama
    m = load_artifact(folder, threads=1)
    sess = m.fast
    rng = np.random.default_rng(5)
    rows = [list(rng.integers(1, 300, n)) for n in (11, 4)]
    ids, mask = np.zeros((2, 11), np.int64), np.zeros((2, 11), np.int64)
    for b, row in enumerate(rows):
        ids[b, 11 - len(row):], mask[b, 11 - len(row):] = row, 1
    names = ["logits"] + [o.name for o in sess.get_outputs() if o.name.startswith("present")]
    last = sess.run(names, _feeds(sess, ids, mask, logits_from=-1))
    every = sess.run(names, _feeds(sess, ids, mask))
    assert last[0].shape == (2, 1, hf.config.vocab_size) and every[0].shape == (2, 11, hf.config.vocab_size)
    with torch.no_grad():
        for b, row in enumerate(rows):
            want = hf(torch.tensor([row])).logits[0].numpy()
            assert np.abs(last[0][b, 0] - want[-1]).max() <= TOL
            assert np.abs(every[0][b, 11 - len(row):] - want).max() <= TOL
    for a, b in zip(last[1:], every[1:], strict=True):
        assert np.array_equal(a, b)


def test_fast_graph_equals_transformers_on_padded_rows_and_cache_steps(fast_llama):
    """A left-padded batch prefill, then 3 cache steps, in the fast graph: each row's logits equal transformers'
    forward of that row alone (no padding, no cache)."""
    folder, _, hf = fast_llama
    m = load_artifact(folder, threads=1)
    sess = m.session_for(maps=False)
    assert sess is m.fast and not m.exact_loaded
    rng = np.random.default_rng(3)
    lengths = [9, 5]
    ids = np.zeros((2, 9), np.int64)
    mask = np.zeros((2, 9), np.int64)
    rows = [list(rng.integers(1, 300, n)) for n in lengths]
    for b, row in enumerate(rows):
        ids[b, 9 - len(row):], mask[b, 9 - len(row):] = row, 1
    names = ["logits"] + [o.name for o in sess.get_outputs() if o.name.startswith("present")]
    out = sess.run(names, _feeds(sess, ids, mask))
    for step in range(4):
        with torch.no_grad():
            for b, row in enumerate(rows):
                want = hf(torch.tensor([row])).logits[0, -1].numpy()
                assert np.abs(out[0][b, -1] - want).max() <= TOL, (step, b)
        nxt = out[0][:, -1].argmax(-1)
        for b in range(2):
            rows[b].append(int(nxt[b]))
        mask = np.concatenate([mask, np.ones((2, 1), np.int64)], axis=1)
        out = sess.run(names, _feeds(sess, nxt[:, None].astype(np.int64), mask, out[1:]))


def test_worker_loads_the_exact_graph_only_for_maps(fast_llama):
    folder, _, _ = fast_llama
    m = load_artifact(folder, threads=1)
    assert m.fast is not None and not m.exact_loaded
    assert "attentions" not in {o.name for o in m.fast.get_outputs()}
    ids, mask = np.array([[5, 6, 7]], np.int64), np.ones((1, 3), np.int64)
    exact = m.session_for(maps=True)
    assert m.exact_loaded and exact is m.session
    a = exact.run(["logits", "attentions"], _feeds(exact, ids, mask))
    b = m.fast.run(["logits"], _feeds(m.fast, ids, mask))
    assert a[1].shape[:2] == (1, 2)  # (batch, layers, heads, new, keys)
    assert np.abs(a[0] - b[0]).max() <= TOL


def test_a_fast_graph_built_from_another_model_onnx_is_not_used(fast_llama, tmp_path):
    """A copy whose model.onnx changed (a quantized copy keeps every other file) serves its exact graph alone."""
    folder, _, _ = fast_llama
    copy = tmp_path / "copy"
    shutil.copytree(folder, copy)
    meta = json.loads((copy / "model.json").read_text())
    meta["fast"]["source_sha256"] = "0" * 64
    artifact.write_json(copy / "model.json", meta)
    artifact.write_manifest(copy, json.loads((folder / "manifest.json").read_text())["validation"])
    m = load_artifact(copy, threads=1)
    assert m.fast is None and m.exact_loaded and m.session_for(maps=False) is m.session


def test_fuse_cli_refuses_a_missing_artifact_in_one_line(tmp_path, capsys):
    assert main([str(tmp_path / "nothing")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and err.count("\n") == 1


def test_a_fast_graph_the_manifest_does_not_vouch_for_is_refused(fast_llama, tmp_path):
    from export.errors import ArtifactError
    from service.errors import ArtifactRejected

    folder, _, _ = fast_llama
    copy = tmp_path / "unlisted"
    shutil.copytree(folder, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    del manifest["files"][FAST_ONNX]
    (copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match=f"does not list {FAST_ONNX}"):
        artifact.verify(copy)
    with pytest.raises(ArtifactRejected, match="fast graph"):
        load_artifact(copy, threads=1)


def test_scheduler_runs_the_head_on_the_last_position_when_no_row_wants_more(fast_llama):
    """A last_only job gets (1, V) logits from the fast graph, equal to the last row of a job that wants every
    position; batched beside such a job, and run in pieces past the token budget, each still gets what it asked."""
    from service.scheduler import Job, Scheduler

    folder, _, hf = fast_llama
    m = load_artifact(folder, threads=1)
    sched = Scheduler(m, max_tokens=16)  # a 20-token prompt runs in two pieces
    try:
        rng = np.random.default_rng(7)
        ids = rng.integers(1, 300, 20).astype(np.int64)
        with torch.no_grad():
            want = hf(torch.tensor([ids.tolist()])).logits[0].numpy()
        alone = sched.submit(Job(ids, None, want_state=False, last_only=True)).result(60)
        assert alone.logits.shape == (1, hf.config.vocab_size)
        assert np.abs(alone.logits[0] - want[-1]).max() <= TOL
        both = [Job(ids[:6], None, want_state=False, last_only=True), Job(ids[:6], None, want_state=False)]
        with sched.exclusive():  # both queue while the session is held, then run as one call (12 tokens)
            futures = [sched.submit(j) for j in both]
        got = [f.result(60) for f in futures]
        assert got[0].logits.shape == (6, hf.config.vocab_size)  # the call computed every position for the other
        assert np.abs(got[1].logits - want[:6]).max() <= TOL
        pieces = sched.submit(Job(ids, None, want_state=True, last_only=True)).result(60)
        assert sched.pieces >= 2 and pieces.logits.shape == (1, hf.config.vocab_size)
        assert np.abs(pieces.logits[0] - want[-1]).max() <= TOL
        assert pieces.state[0].shape[1] == 20
    finally:
        sched.close()
