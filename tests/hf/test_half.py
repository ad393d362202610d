"""The float16 fast graph (export/half.py, `python -m export.fuse --half`) of an imported LLaMA: float16 where it
may be, float32 for the positions' arithmetic and the logits, within its budget, as close to transformers at the
last positions as at the first; and the worker serving it (--half on; here onnxruntime's CPU float16 kernels, the
graph --provider cuda serves) decodes as the graph run directly, over a float16 KV cache."""

import json
import os
import threading

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from export import half
from export.budget import feeds
from export.fuse import add_to_artifact
from service.sampling import SamplingParams
from tests.direct import greedy_direct
from tests.serving import start

LENGTH = 250  # the tiny LLaMA's max_position_embeddings is 256


@pytest.fixture(scope="module")
def half_llama(hf_families, tmp_path_factory):
    models = tmp_path_factory.mktemp("half")
    folder = models / "llama"
    folder.mkdir()
    for p in hf_families["llama"]["artifact"].iterdir():
        os.link(p, folder / p.name)
    entry = add_to_artifact(folder, half=True)
    return models, folder, entry, hf_families["llama"]["hf"]


def test_weights_and_cache_are_float16_positions_and_logits_float32(half_llama):
    _, folder, entry, _ = half_llama
    assert entry["half"]["file"] == half.HALF_ONNX and entry["half"]["budget"]["passed"]
    assert entry["half"]["kept_float32"] > 0 and entry["half"]["round_trips_dropped"] > 0
    sess = ort.InferenceSession(str(folder / half.HALF_ONNX), providers=["CPUExecutionProvider"])
    types = {v.name: v.type for v in [*sess.get_inputs(), *sess.get_outputs()]}
    assert types["logits"] == "tensor(float)"
    assert {t for n, t in types.items() if n.startswith(("past_key_values.", "present."))} == {"tensor(float16)"}
    proto = onnx.load(str(folder / half.HALF_ONNX), load_external_data=False)
    big = [i for i in proto.graph.initializer if np.prod(i.dims) >= 1024]
    assert big and all(i.data_type == onnx.TensorProto.FLOAT16 for i in big)
    # weights in fast16.onnx.data, half of fast.onnx.data's float32 bytes
    ratio = (folder / "fast16.onnx.data").stat().st_size / (folder / "fast.onnx.data").stat().st_size
    assert 0.45 < ratio <= 0.5


def test_late_positions_are_as_close_to_transformers_as_early_ones(half_llama):
    """float16 rotation angles would grow their error with the position (position x frequency keeps 11 bits); the
    float32 positions keep it flat."""
    _, folder, _, hf = half_llama
    meta = json.loads((folder / "model.json").read_text())
    ids = np.random.default_rng(0).integers(0, meta["sizes"]["vocab_size"], LENGTH).astype(np.int64)
    with torch.no_grad():
        want = hf(torch.tensor(ids[None])).logits[0].numpy()
    sess = ort.InferenceSession(str(folder / half.HALF_ONNX), providers=["CPUExecutionProvider"])
    got = sess.run(["logits"], feeds(sess, meta, ids))[0][0]
    err = np.abs(got - want).max(-1)
    early, late = err[:60].mean(), err[-60:].mean()
    assert late <= 1.5 * early, (early, late)
    assert err.max() <= 0.02 * np.abs(want).max()
    assert (got.argmax(-1) == want.argmax(-1)).mean() >= 0.98


def test_the_worker_serves_the_float16_graph_as_run_directly(half_llama):
    models, folder, _, _ = half_llama
    prompts = [[3, 17, 29, 41, 5, 9], [7, 7, 8, 120, 33], [3, 17, 29, 41, 5, 9, 11, 60, 2]]
    want = [greedy_direct(folder, p, 20, half.HALF_ONNX) for p in prompts]
    srv = start(models, half="on", max_batch=4)
    try:
        model = srv.registry.models["llama"]
        assert model.kv.dtype is np.float16 and model.fast.get_inputs()[2].type == "tensor(float16)"
        got = {}

        def run(k):
            got[k] = [item.id for _, item in srv.ops.generate("llama", [(None, prompts[k])],
                                                               SamplingParams(max_new_tokens=20, ignore_eos=True))
                      if hasattr(item, "id")]

        threads = [threading.Thread(target=run, args=(k,)) for k in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    finally:
        srv.stop(grace=1)
    # onnxruntime refuses float32 tensors for the graph's float16 pasts: every call was fed float16 caches
    assert [got.get(k) for k in range(len(prompts))] == want


def test_without_half_the_worker_serves_the_float32_graph(half_llama):
    models, _, _, _ = half_llama
    srv = start(models, half="off")
    try:
        model = srv.registry.models["llama"]
        assert model.kv.dtype is np.float32 and model.fast.get_inputs()[2].type == "tensor(float)"
    finally:
        srv.stop(grace=1)
