"""export.fuse on posenc's own variants: a fast graph for any artifact, checked against its exact graph through
real onnxruntime (cpe carries a fixed-size state of its own, alibi a bias in its mask, fire a learned one)."""

import json
import os

import numpy as np
import onnxruntime as ort
import pytest

from export.errors import ExportError
from export.fuse import FAST_MIN_PARAMETERS, LOGITS_FROM, add_to_artifact, wanted


@pytest.mark.parametrize("variant", ["cpe", "alibi", "fire"])
def test_fast_graph_of_each_kind_of_variant_matches_its_exact_graph(tiny_artifacts, tmp_path, variant):
    root, _ = tiny_artifacts
    folder = tmp_path / variant
    folder.mkdir()
    for p in (root / variant).iterdir():
        os.link(p, folder / p.name)
    entry = add_to_artifact(folder)
    assert entry["parity"]["max_abs_diff"] <= 1e-4
    meta = json.loads((folder / "model.json").read_text())
    exact = ort.InferenceSession(str(folder / "model.onnx"), providers=["CPUExecutionProvider"])
    fast = ort.InferenceSession(str(folder / "fast.onnx"), providers=["CPUExecutionProvider"])
    # the exact graph's inputs, and logits_from: 0 for every position's logits, -1 for the last one's
    assert [i.name for i in fast.get_inputs()] == [i.name for i in exact.get_inputs()] + [LOGITS_FROM]
    assert [o.name for o in fast.get_outputs()] == [o.name for o in exact.get_outputs() if o.name != "attentions"]
    ids = np.random.default_rng(1).integers(0, meta["sizes"]["vocab_size"], (1, 40))  # longer than the check's
    feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids)}
    for i in exact.get_inputs()[2:]:  # no past: length 0, a variant's own state of its fixed shape
        feeds[i.name] = np.zeros([1] + [d if isinstance(d, int) else 0 for d in i.shape[1:]], np.float32)
    names = [o.name for o in fast.get_outputs()]
    want = exact.run(names, feeds)
    for a, b in zip(want, fast.run(names, {**feeds, LOGITS_FROM: np.array([0])}), strict=True):
        assert np.abs(a - b).max() <= 1e-4
    last = fast.run(["logits"], {**feeds, LOGITS_FROM: np.array([-1])})[0]
    assert last.shape == (1, 1, meta["sizes"]["vocab_size"])
    assert np.abs(last - want[0][:, -1:]).max() <= 1e-4


def test_exports_write_a_fast_graph_for_real_size_models_only():
    assert wanted(FAST_MIN_PARAMETERS) and not wanted(FAST_MIN_PARAMETERS - 1)
    assert wanted(1000, "on") and not wanted(10**9, "off")
    with pytest.raises(ExportError, match="auto, on, off"):
        wanted(1, "yes")
