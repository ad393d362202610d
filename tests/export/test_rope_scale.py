"""python -m export rope-scale with every scaling type: --method for the ones a factor defines, --rope-scaling JSON
(transformers' rope_parameters keys) for all.  The frequencies the scaled graph carries are checked against
transformers' own rope functions for a LLaMA config of the same head, below and past the original length."""

import json

import numpy as np
import onnxruntime as ort
import pytest
import torch

from tests.export.test_export import run

SHORT, LONG = [1.0, 1.1, 1.3, 1.6], [1.0, 2.0, 4.0, 9.0]  # the tiny preset rotates 8 dims per head: 4 pairs


def transformers_inv_freq(rope: dict, length: int, context: int) -> tuple[np.ndarray, float]:
    """inv_freq and attention factor transformers computes for a head like the tiny preset's (32 wide, 4 heads)
    at `length`, through its rotary module's dynamic-update path (dynamic and longrope look at the length)."""
    import transformers as tf
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    cfg = tf.LlamaConfig(hidden_size=32, num_attention_heads=4, max_position_embeddings=context,
                         rope_parameters={"rope_theta": 10000.0, **rope})
    rotary = LlamaRotaryEmbedding(cfg)
    rotary(torch.zeros(1), torch.arange(length)[None])
    return rotary.inv_freq.numpy(), rotary.attention_scaling


@pytest.mark.parametrize("rope", [
    {"rope_type": "longrope", "short_factor": SHORT, "long_factor": LONG, "factor": 4.0},
    {"rope_type": "dynamic", "factor": 2.0},  # (the other types' import is proven in tests/hf/test_rope_scaling.py)
], ids=lambda r: r["rope_type"])
def test_rope_scale_json_carries_transformers_frequencies(tiny_artifacts, tmp_path, rope):
    root, _ = tiny_artifacts
    out = tmp_path / "scaled"
    # dynamic scaling's angles follow the length: its intervention graph, proven at export past the trained context
    graphs = "on" if rope["rope_type"] == "dynamic" else "off"
    res = run("rope-scale", root / "rope", "--rope-scaling", json.dumps(rope), "--out", out, "--interventions", graphs)
    assert res.returncode == 0, res.stderr
    assert (out / "intervene.onnx").exists() == (graphs == "on")
    meta = json.loads((out / "model.json").read_text())
    context = meta["config"]["context"]  # 16: the trained context is the original length
    assert meta["source"]["rope_scaling"] == rope and meta["source"]["method"] == rope["rope_type"]
    assert meta["config"]["rope_original_context"] == context
    assert json.loads((out / "manifest.json").read_text())["validation"]["passed"]
    session = ort.InferenceSession(str(out / "encoding.onnx"), providers=["CPUExecutionProvider"])
    for length in (context - 3, 3 * context):
        freqs, cos, sin = session.run(["rotary_frequencies", "rotary_cos", "rotary_sin"],
                                      {"positions": np.arange(length, dtype=np.int64)})
        want, factor = transformers_inv_freq(rope, length, context)
        np.testing.assert_allclose(freqs, want, rtol=1e-6)
        np.testing.assert_allclose(cos ** 2 + sin ** 2, factor ** 2, rtol=1e-5)
    assert rope["rope_type"] in meta["encoding"]["note"]


@pytest.mark.parametrize("args, match", [
    (["--method", "yarn"], "--method needs --factor"),
    (["--rope-scaling", '{"rope_type": "yarn"}', "--factor", "2"], "--factor goes with --method"),
    (["--method", "yarn", "--factor", "2", "--rope-scaling", "none"], "not allowed with argument"),
    (["--rope-scaling", '{"rope_type": "yarn", "factor": 2, "mscale": "big"}'], "rope_parameters.mscale = 'big'"),
    (["--rope-scaling", '{"rope_type": "llama3", "factor": 2, "low_freq_factor": 4, "high_freq_factor": 1}'],
     "high_freq_factor must exceed low_freq_factor"),
    (["--rope-scaling", "[1, 2]"], "--rope-scaling must be a JSON object"),
])
def test_rope_scale_refusals_are_one_line_exit_2(tiny_artifacts, tmp_path, args, match):
    root, _ = tiny_artifacts
    res = run("rope-scale", root / "rope", *args, "--out", tmp_path / "x")
    assert res.returncode == 2 and match in res.stderr and res.stderr.count("\n") == 1, res.stderr
    assert not (tmp_path / "x").exists()


def test_rope_scaling_at_export_needs_a_hugging_face_folder(tmp_path):
    res = run("--init", "random", "--variant", "rope", "--out", tmp_path / "x", "--rope-scaling", "none")
    assert res.returncode == 2 and "--rope-scaling applies to --from-hf" in res.stderr, res.stderr
    assert res.stderr.count("\n") == 1 and not (tmp_path / "x").exists()
