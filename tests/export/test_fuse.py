"""export.fuse on posenc's own variants: a fast graph for any artifact, checked against its exact graph through
real onnxruntime (cpe carries a fixed-size state of its own, alibi a bias in its mask, fire a learned one: all keep
the padded layout; NoPE's mask is the plain one: compact)."""

import json
import os
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from export.errors import ExportError
from export.fuse import FAST_MIN_PARAMETERS, LOGITS_POSITIONS, add_to_artifact, wanted
from export.gqa import SEQLENS, TOTAL


def _fast(tiny_artifacts, tmp_path, variant):
    root, _ = tiny_artifacts
    folder = tmp_path / variant
    folder.mkdir()
    for p in (root / variant).iterdir():
        os.link(p, folder / p.name)
    entry = add_to_artifact(folder)
    meta = json.loads((folder / "model.json").read_text())
    exact = ort.InferenceSession(str(folder / "model.onnx"), providers=["CPUExecutionProvider"])
    fast = ort.InferenceSession(str(folder / "fast.onnx"), providers=["CPUExecutionProvider"])
    return entry, meta, exact, fast


def _empty(exact, batch):
    """No past: KV of length 0, a variant's own state of its fixed shape (the exact graph's inputs after the mask)."""
    return {i.name: np.zeros([batch] + [d if isinstance(d, int) else 0 for d in i.shape[1:]], np.float32)
            for i in exact.get_inputs()[2:]}


@pytest.mark.parametrize("variant", ["cpe", "alibi", "fire"])
def test_fast_graph_of_each_kind_of_variant_matches_its_exact_graph(tiny_artifacts, tmp_path, variant):
    entry, meta, exact, fast = _fast(tiny_artifacts, tmp_path, variant)
    assert entry["layout"] == "padded" and entry["logits_positions"] == LOGITS_POSITIONS
    assert entry["parity"]["max_abs_diff"] <= 1e-4 and meta["fast"]["layout"] == "padded"
    # the tied embedding table (posenc's variants read the head from it) is stored once, as in model.onnx
    table = {meta["sizes"]["vocab_size"], meta["sizes"]["d_model"]}
    tables = [i for i in onnx.load(tmp_path / variant / "fast.onnx").graph.initializer if set(i.dims) == table]
    assert len(tables) == 1 and entry["tied_table_once"]
    # the exact graph's inputs, and logits_positions: (batch, count) positions of each row whose logits are computed
    assert [i.name for i in fast.get_inputs()] == [i.name for i in exact.get_inputs()] + [LOGITS_POSITIONS]
    assert [o.name for o in fast.get_outputs()] == [o.name for o in exact.get_outputs() if o.name != "attentions"]
    ids = np.random.default_rng(1).integers(0, meta["sizes"]["vocab_size"], (2, 40))  # longer than the check's
    mask = np.ones_like(ids)
    mask[1, :15] = 0  # row 1 left-padded: its last real token is the batch's last position too
    feeds = {"input_ids": ids, "attention_mask": mask, **_empty(exact, 2)}
    names = [o.name for o in fast.get_outputs()]
    want = exact.run(names, feeds)
    got = fast.run(names, {**feeds, LOGITS_POSITIONS: np.tile(np.arange(40), (2, 1))})
    for a, b in zip(want, got, strict=True):
        assert np.abs(a - b).max() <= 1e-4
    positions = np.array([[39, 0, 20], [39, 15, 30]])  # per row, in any order
    picked = fast.run(["logits"], {**feeds, LOGITS_POSITIONS: positions})[0]
    assert picked.shape == (2, 3, meta["sizes"]["vocab_size"])
    for b in range(2):
        assert np.abs(picked[b] - want[0][b, positions[b]]).max() <= 1e-4


def test_a_nope_model_gets_the_compact_layout(tiny_artifacts, tmp_path):
    """NoPE's attention takes the plain causal/padding mask: GroupQueryAttention replaces it, and right-padded rows
    give the exact graph's left-padded logits and cache."""
    entry, meta, exact, fast = _fast(tiny_artifacts, tmp_path, "none")
    assert entry["layout"] == "compact" and entry["fused"]["GroupQueryAttention"] == meta["sizes"]["n_layers"]
    rng = np.random.default_rng(4)
    lens = [12, 5]
    left, right = np.zeros((2, 12), np.int64), np.zeros((2, 12), np.int64)
    lmask, rmask = np.zeros_like(left), np.zeros_like(right)
    for b, n in enumerate(lens):
        row = rng.integers(0, meta["sizes"]["vocab_size"], n)
        left[b, 12 - n:], lmask[b, 12 - n:], right[b, :n], rmask[b, :n] = row, 1, row, 1
    names = [o.name for o in fast.get_outputs()]
    want = exact.run(names, {"input_ids": left, "attention_mask": lmask, **_empty(exact, 2)})
    got = fast.run(names, {"input_ids": right, "attention_mask": rmask, **_empty(exact, 2),
                           SEQLENS: np.array(lens, np.int32) - 1, TOTAL: np.array(12, np.int32),
                           LOGITS_POSITIONS: np.tile(np.arange(12), (2, 1))})
    for b, n in enumerate(lens):
        assert np.abs(got[0][b, :n] - want[0][b, 12 - n:]).max() <= 1e-4
        for x, y in zip(want[1:], got[1:], strict=True):
            assert np.abs(y[b][:, :n] - x[b][:, 12 - n:]).max() <= 1e-4


def test_exports_write_a_fast_graph_for_real_size_models_only():
    assert wanted(FAST_MIN_PARAMETERS) and not wanted(FAST_MIN_PARAMETERS - 1)
    assert wanted(1000, "on") and not wanted(10**9, "off")
    with pytest.raises(ExportError, match="auto, on, off"):
        wanted(1, "yes")


def test_fast_graph_weights_live_in_a_data_file_readable_as_the_exact_graph(tiny_artifacts, tmp_path):
    """fast.onnx keeps its weights in fast.onnx.data (onnxruntime maps it), covered by the manifest and model.json,
    with model.onnx's permissions (onnx writes the file owner-only: a worker running as another user could not read
    it)."""
    from export import artifact

    root, _ = tiny_artifacts
    folder = tmp_path / "alibi"
    folder.mkdir()
    for p in (root / "alibi").iterdir():
        os.link(p, folder / p.name)
    entry = add_to_artifact(folder)
    data = folder / "fast.onnx.data"
    assert entry["external_data"] == data.name and data.stat().st_size > (folder / "fast.onnx").stat().st_size
    assert data.stat().st_mode & 0o777 == (folder / "model.onnx").stat().st_mode & 0o777
    assert data.name in json.loads((folder / "manifest.json").read_text())["files"]
    artifact.verify(folder)


def test_half_refuses_a_padded_fast_graph_in_one_line_and_leaves_the_artifact_as_it_was(tiny_artifacts, tmp_path):
    """ALiBi adds its bias to the scores, so its fast graph is padded: no float16 copy (the worker's padded rows are
    float32); the CLI says why in one line, exit 2, and the folder keeps its files and manifest."""
    import subprocess
    import sys

    root, _ = tiny_artifacts
    folder = tmp_path / "alibi"
    folder.mkdir()
    for p in (root / "alibi").iterdir():
        os.link(p, folder / p.name)
    before = {p.name: p.stat().st_ino for p in folder.iterdir()}
    res = subprocess.run([sys.executable, "-m", "export.fuse", str(folder), "--half"], capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parents[2], timeout=300)
    assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1
    assert "compact layout" in res.stderr and "padded" in res.stderr
    assert {p.name: p.stat().st_ino for p in folder.iterdir()} == before


def test_prune_keeps_what_only_a_subgraph_reads_from_the_graph_around_it():
    """export.rewrite.prune (the fast graph's, and the intervention graph's from the maps graph) keeps the producers
    of the values an If's branches read from outside, and drops the node nothing reads; onnxruntime runs the pruned
    graph to the same answers."""
    from onnx import TensorProto, helper

    from export.rewrite import prune

    f = TensorProto.FLOAT
    then = helper.make_graph([helper.make_node("Identity", ["a"], ["ta"])], "then", [],
                             [helper.make_tensor_value_info("ta", f, [2])])
    other = helper.make_graph([helper.make_node("Neg", ["b"], ["nb"])], "else", [],
                              [helper.make_tensor_value_info("nb", f, [2])])
    graph = helper.make_graph(
        [helper.make_node("Abs", ["x"], ["a"]), helper.make_node("Exp", ["x"], ["b"]),
         helper.make_node("Sin", ["x"], ["unused"]),
         helper.make_node("If", ["cond"], ["y"], then_branch=then, else_branch=other)],
        "g", [helper.make_tensor_value_info("x", f, [2]), helper.make_tensor_value_info("cond", TensorProto.BOOL, [])],
        [helper.make_tensor_value_info("y", f, [2])])
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    onnx.checker.check_model(proto)
    prune(proto)
    assert [n.op_type for n in proto.graph.node] == ["Abs", "Exp", "If"]
    sess = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    x = np.array([-1.0, 2.0], np.float32)
    for cond, want in ((True, np.abs(x)), (False, -np.exp(x))):
        np.testing.assert_allclose(sess.run(None, {"x": x, "cond": np.array(cond)})[0], want, rtol=1e-6)
