"""bench/peers_prepare.py's posenc_for_genai: posenc's compact fast graph with the inputs the worker feeds computed in
front of it from the attention mask and the ids, as onnxruntime-genai's Generator drives a graph (a cache buffer of
fixed capacity bound as past and present, the mask over every position so far, logits for every new token).  Its
logits are held to the exact graph's (model.onnx, fed the concatenating cache it was exported with) over a prompt and
cached steps, and its cache to the worker's own feeds for the same step (service/compact.py's step_feeds)."""

import json

import numpy as np
import onnxruntime as ort

from bench.peers_prepare import posenc_for_genai
from service.compact import step_feeds
from tests.service.conftest import fast_artifacts  # noqa: F401  (the fixture: tiny artifacts with fast graphs)

CAPACITY = 24


def session(path):
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


def test_the_genai_copy_computes_the_exact_graphs_logits_from_the_mask_alone(fast_artifacts, tmp_path):  # noqa: F811
    art = fast_artifacts / "rope"
    meta = json.loads((art / "model.json").read_text())
    assert meta["fast"]["layout"] == "compact" and meta["fast"]["logits_positions"]
    genai = tmp_path / "genai"
    genai.mkdir()
    (genai / "genai_config.json").write_text(json.dumps({"model": {"decoder": {"filename": "its_own.onnx"}}}))
    out = posenc_for_genai(art, genai, tmp_path / "work")
    assert json.loads((out / "genai_config.json").read_text())["model"]["decoder"]["filename"] == "model.onnx"
    wrapped, exact, fast = session(out / "model.onnx"), session(art / "model.onnx"), session(art / meta["fast"]["file"])
    names = [i.name for i in wrapped.get_inputs()]
    assert names[:2] == ["input_ids", "attention_mask"] and not {"seqlens_k", "total_sequence_length"} & set(names)
    cache = wrapped.get_inputs()[2:]
    outputs = [o.name for o in wrapped.get_outputs()]

    rng = np.random.default_rng(0)
    ids = rng.integers(1, 250, (1, 9)).astype(np.int64)
    buffers = {c.name: np.zeros((1, c.shape[1], CAPACITY, c.shape[3]), np.float32) for c in cache}  # genai's
    past = {c.name: np.zeros((1, c.shape[1], 0, c.shape[3]), np.float32) for c in cache}  # the exact graph's
    total, new = 0, ids
    for _ in range(4):  # the prompt, then three cached steps of one token
        total += new.shape[1]
        mask = np.ones((1, total), np.int64)
        got = dict(zip(outputs, wrapped.run(None, {"input_ids": new, "attention_mask": mask, **buffers}), strict=True))
        want = dict(zip([o.name for o in exact.get_outputs()],
                        exact.run(None, {"input_ids": new, "attention_mask": mask, **past}), strict=True))
        assert got["logits"].shape == (1, new.shape[1], want["logits"].shape[-1])  # every new token's
        np.testing.assert_allclose(got["logits"], want["logits"][:, -new.shape[1]:], atol=1e-4)
        # the same call as the worker feeds it: seqlens_k, the total length and the last token's head
        feeds = {**step_feeds(new, np.array([total - new.shape[1]])), **buffers,
                 meta["fast"]["logits_positions"]: np.array([[new.shape[1] - 1]], np.int64)}
        mine = dict(zip([o.name for o in fast.get_outputs()], fast.run(None, feeds), strict=True))
        np.testing.assert_allclose(got["logits"][:, -1:], mine["logits"], atol=1e-5)
        buffers = {c.name: got[c.name.replace("past_key_values", "present")] for c in cache}
        past = {c.name: want[c.name.replace("past_key_values", "present")] for c in cache}
        new = got["logits"][:, -1].argmax(-1)[:, None].astype(np.int64)
