"""The fast graph (export.fuse) of an imported LLaMA: compact (GroupQueryAttention, each row's cache from slot 0),
fused norms, no maps; its logits equal transformers' own forward of each row alone, through a batched right-padded
prefill and cache steps whose past and present are one buffer.  A sliding-window model keeps the padded layout."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from export import artifact
from export.fuse import FAST_ONNX, LOGITS_POSITIONS, add_to_artifact, main
from export.gqa import SEQLENS, TOTAL
from service.artifacts import load_artifact

pytestmark = pytest.mark.xdist_group("fast-graph")  # one worker exports the fast LLaMA once (make test)

TOL = 1e-4


def _fast_copy(src, folder):
    """A hard-linked copy of an artifact with its fast graph added (python -m export.fuse's path)."""
    folder.mkdir(parents=True)
    for p in src.iterdir():
        os.link(p, folder / p.name)
    return add_to_artifact(folder)


@pytest.fixture(scope="module")
def fast_llama(hf_families, tmp_path_factory):
    folder = tmp_path_factory.mktemp("fast") / "llama"
    entry = _fast_copy(hf_families["llama"]["artifact"], folder)
    sess = ort.InferenceSession(str(folder / FAST_ONNX), providers=["CPUExecutionProvider"])
    return folder, entry, hf_families["llama"]["hf"], sess


def _hf_logits(hf, row):
    with torch.no_grad():
        return hf(torch.tensor([list(row)])).logits[0].numpy()


class Compact:
    """The compact graph driven as its contract says: one (rows, kv heads, capacity, head_dim) buffer per layer and
    K/V, bound as past and present both; rows right-padded from slot 0."""

    def __init__(self, sess, rows, capacity):
        self.sess, self.io = sess, sess.io_binding()
        past = [i for i in sess.get_inputs() if i.name.startswith("past_key_values.")]
        self.vocab = sess.get_outputs()[0].shape[2]
        self.buffers = [np.zeros((rows, p.shape[1], capacity, p.shape[3]), np.float32) for p in past]
        for p, buf in zip(past, self.buffers, strict=True):
            value = ort.OrtValue.ortvalue_from_numpy(buf)  # shares buf's memory
            self.io.bind_ortvalue_input(p.name, value)
            self.io.bind_ortvalue_output(p.name.replace("past_key_values.", "present."), value)

    def run(self, ids, mask, seqlens, total, positions):
        io = self.io
        for name, value in (("input_ids", ids), ("attention_mask", mask), (SEQLENS, seqlens.astype(np.int32)),
                            (TOTAL, np.array(total, np.int32)), (LOGITS_POSITIONS, positions.astype(np.int64))):
            io.bind_cpu_input(name, value)
        logits = np.zeros((*positions.shape, self.vocab), np.float32)
        io.bind_ortvalue_output("logits", ort.OrtValue.ortvalue_from_numpy(logits))  # rebinding replaces it
        self.sess.run_with_iobinding(io)
        return logits


def _right_padded(rows):
    width = max(len(r) for r in rows)
    ids, mask = np.zeros((len(rows), width), np.int64), np.zeros((len(rows), width), np.int64)
    for b, row in enumerate(rows):
        ids[b, :len(row)], mask[b, :len(row)] = row, 1
    return ids, mask


def test_compact_graph_is_fused_and_keeps_no_mask_or_maps(fast_llama):
    folder, entry, hf, sess = fast_llama
    proto = onnx.load(str(folder / FAST_ONNX))
    ops = [n.op_type for n in proto.graph.node]
    layers = hf.config.num_hidden_layers
    # every norm but the first (no residual before it) takes its residual Add along: 2 per layer, the final one
    assert entry["fused"] == {"GroupQueryAttention": layers, "GroupQueryAttention do_rotary": layers,
                              "SimplifiedLayerNormalization": 1, "SkipSimplifiedLayerNormalization": 2 * layers}
    assert ops.count("GroupQueryAttention") == layers and "Attention" not in ops
    # head_dim 48: each layer's q/k/v projection goes whole into its GroupQueryAttention, which rotates q and k by
    # cos and sin tables the graph computes (export.rotary_fold)
    producer = {o: n for n in proto.graph.node for o in n.output}
    assert "RotaryEmbedding" not in ops
    assert not [n for n in proto.graph.node if n.op_type == "Slice" and producer[n.input[0]].op_type == "MatMul"]
    for node in (n for n in proto.graph.node if n.op_type == "GroupQueryAttention"):
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        assert attrs["do_rotary"] == 1 and attrs["rotary_interleaved"] == 0 and list(node.input[1:3]) == ["", ""]
    assert not set(ops) & {"Pow", "ReduceMean", "Sqrt", "Reciprocal", "Softmax", "Where"}  # the mask chain is gone
    assert "attentions" not in {o.name for o in proto.graph.output}
    assert entry["parity"]["max_abs_diff"] <= TOL
    meta = json.loads((folder / "model.json").read_text())
    assert meta["fast"]["layout"] == "compact" and meta["fast"]["logits_positions"] == LOGITS_POSITIONS
    assert "logits_from" not in meta["fast"]
    exact = onnx.load(str(folder / "model.onnx"), load_external_data=False)
    assert [i.name for i in sess.get_inputs()] == [i.name for i in exact.graph.input] + [SEQLENS, TOTAL,
                                                                                         LOGITS_POSITIONS]
    artifact.verify(folder)  # the manifest covers fast.onnx


def test_compact_prefill_and_shared_buffer_steps_equal_transformers(fast_llama):
    """Rows of 9, 5 and 2 tokens right-padded in one prefill, then 4 steps with each row's own length, the cache one
    buffer per layer bound as past and present: every logit equals transformers' forward of that row alone."""
    _, _, hf, sess = fast_llama
    rng = np.random.default_rng(3)
    rows = [list(rng.integers(1, 300, n)) for n in (9, 5, 2)]
    lens = np.array([len(r) for r in rows])
    ids, mask = _right_padded(rows)
    run = Compact(sess, 3, capacity=16)
    every = np.tile(np.arange(ids.shape[1]), (3, 1))
    logits = run.run(ids, mask, lens - 1, ids.shape[1], every)
    for b, row in enumerate(rows):
        assert np.abs(logits[b, :len(row)] - _hf_logits(hf, row)).max() <= TOL, b
    for step in range(4):
        token = np.array([_hf_logits(hf, row)[-1].argmax() for row in rows])  # transformers' greedy choice
        for b in range(3):
            rows[b].append(int(token[b]))
        lens = lens + 1
        # the worker's step mask: left-padded, each row's length + 1 ones (its positions only)
        width = int(lens.max())
        mask = (np.arange(width)[None, :] >= (width - lens)[:, None]).astype(np.int64)
        logits = run.run(token[:, None].astype(np.int64), mask, lens - 1, width, np.zeros((3, 1)))
        for b, row in enumerate(rows):
            assert np.abs(logits[b, 0] - _hf_logits(hf, row)[-1]).max() <= TOL, (step, b)


def test_logits_positions_pick_each_rows_own_positions(fast_llama):
    """logits_positions (batch, K): each row's last real token alone, or any positions in any order, equal to
    transformers' logits there; the cache the call writes is the same whichever positions it returns."""
    _, _, hf, sess = fast_llama
    rng = np.random.default_rng(5)
    rows = [list(rng.integers(1, 300, n)) for n in (11, 4)]
    ids, mask = _right_padded(rows)
    seqlens, want = np.array([10, 3]), [_hf_logits(hf, row) for row in rows]
    last, picked = Compact(sess, 2, 12), Compact(sess, 2, 12)
    got = last.run(ids, mask, seqlens, 11, np.array([[10], [3]]))
    assert got.shape == (2, 1, hf.config.vocab_size)
    for b in range(2):
        assert np.abs(got[b, 0] - want[b][-1]).max() <= TOL
    positions = np.array([[7, 0, 10], [3, 1, 2]])
    got = picked.run(ids, mask, seqlens, 11, positions)
    for b in range(2):
        assert np.abs(got[b] - want[b][positions[b]]).max() <= TOL
    for a, b in zip(last.buffers, picked.buffers, strict=True):
        assert np.array_equal(a[0, :, :11], b[0, :, :11]) and np.array_equal(a[1, :, :4], b[1, :, :4])


def test_worker_loads_the_exact_graph_only_for_maps(fast_llama):
    folder, _, _, _ = fast_llama
    m = load_artifact(folder, threads=1)
    assert m.fast is not None and not m.exact_loaded
    assert "attentions" not in {o.name for o in m.fast.get_outputs()}
    ids, mask = np.array([[5, 6, 7]], np.int64), np.ones((1, 3), np.int64)
    exact = m.session_for(maps=True)
    assert m.exact_loaded and exact is m.session
    past = {i.name: np.zeros((1, i.shape[1], 0, i.shape[3]), np.float32) for i in exact.get_inputs()[2:]}
    a = exact.run(["logits", "attentions"], {"input_ids": ids, "attention_mask": mask, **past})
    b = m.fast.run(["logits"], {"input_ids": ids, "attention_mask": mask, **past, SEQLENS: np.array([2], np.int32),
                                TOTAL: np.array(3, np.int32), LOGITS_POSITIONS: np.array([[0, 1, 2]])})
    assert a[1].shape[:2] == (1, 2)  # (batch, layers, heads, new, keys)
    assert np.abs(a[0] - b[0]).max() <= TOL


def test_a_fast_graph_built_from_another_model_onnx_is_not_used(fast_llama, tmp_path):
    """A copy whose model.onnx changed (a quantized copy keeps every other file) serves its exact graph alone."""
    folder, _, _, _ = fast_llama
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

    folder, _, _, _ = fast_llama
    copy = tmp_path / "unlisted"
    shutil.copytree(folder, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    del manifest["files"][FAST_ONNX]
    (copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match=f"does not list {FAST_ONNX}"):
        artifact.verify(copy)
    with pytest.raises(ArtifactRejected, match="fast graph"):
        load_artifact(copy, threads=1)


def test_a_sliding_window_model_keeps_the_padded_layout(hf_zoo, tmp_path):
    """Mistral's window (7) is not GroupQueryAttention's to apply: its fast graph keeps the exact graph's Attention
    under the mask, and a 12-token row (past the window) still equals transformers, every position and the last."""
    mistral = hf_zoo["mistral"]
    entry = _fast_copy(mistral["artifact"], tmp_path / "mistral")
    assert entry["layout"] == "padded" and "GroupQueryAttention" not in entry["fused"]
    assert entry["logits_positions"] == LOGITS_POSITIONS and entry["parity"]["max_abs_diff"] <= TOL
    sess = ort.InferenceSession(str(tmp_path / "mistral" / FAST_ONNX), providers=["CPUExecutionProvider"])
    assert SEQLENS not in {i.name for i in sess.get_inputs()}
    row = list(np.random.default_rng(2).integers(1, 300, 12))
    want = _hf_logits(mistral["hf"], row)
    past = {i.name: np.zeros((1, i.shape[1], 0, i.shape[3]), np.float32) for i in sess.get_inputs()
            if i.name.startswith("past_key_values.")}
    feeds = {"input_ids": np.array([row], np.int64), "attention_mask": np.ones((1, 12), np.int64), **past}
    every = sess.run(["logits"], {**feeds, LOGITS_POSITIONS: np.arange(12)[None]})[0]
    last = sess.run(["logits"], {**feeds, LOGITS_POSITIONS: np.array([[11]])})[0]
    assert np.abs(every[0] - want).max() <= TOL and np.abs(last[0, 0] - want[-1]).max() <= TOL


def test_a_yarn_model_keeps_its_rotations_and_its_parity(hf_families, tmp_path):
    """YaRN multiplies the cosine and sine by its attention factor after computing them: that chain is not folded
    into GroupQueryAttention (onnxruntime aborted the process on the folded graph), the layers keep their
    RotaryEmbedding nodes, and the compact fast graph equals the exact one."""
    from export.hf import import_artifact

    out = tmp_path / "yarn"
    import_artifact(hf_families["llama"]["folder"], out, validation_max_length=8,
                    rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64})
    entry = add_to_artifact(out)
    assert entry["layout"] == "compact" and "GroupQueryAttention do_rotary" not in entry["fused"]
    assert entry["parity"]["max_abs_diff"] <= TOL
    assert "RotaryEmbedding" in {n.op_type for n in onnx.load(str(out / FAST_ONNX)).graph.node}
