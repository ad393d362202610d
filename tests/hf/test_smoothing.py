"""Smoothing before dynamic int8 (export/smooth.py) on an imported LLaMA whose down projections read an outlier
channel, as trained LLMs' do: the fp32 graph computes the same after smoothing, and the quantized copy's logits
stay much closer to fp32's than without it."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from safetensors.torch import load_file, save_file

from export import budget, quantize, smooth
from tests.hf.helpers import save_family

pytestmark = pytest.mark.xdist_group("smoothing")  # one worker imports the outlier LLaMA once (make test)

ROOT = Path(__file__).resolve().parents[2]
OUTLIERS = (5, 40)  # channels of the down projections' input made large
FACTOR = 60.0  # how much larger: up's row times FACTOR, down's column divided by it (the model computes the same)
LOOSE = ["--min-top1", "0", "--max-nats-ratio", "10"]  # the budget is not what these tests judge


@pytest.fixture(scope="module")
def outlier_llama(tmp_path_factory):
    """An imported tiny LLaMA (transformers' random weights) with OUTLIERS planted in every layer's MLP: an fp32
    model equal to the original up to rounding whose down-projection inputs have two channels FACTOR x the rest."""
    from export.hf import import_artifact

    root = tmp_path_factory.mktemp("smooth")
    folder = root / "hf"
    model = save_family("llama", folder)
    weights = load_file(str(folder / "model.safetensors"))
    for i in range(model.config.num_hidden_layers):
        up, down = f"model.layers.{i}.mlp.up_proj.weight", f"model.layers.{i}.mlp.down_proj.weight"
        for j in OUTLIERS:
            weights[up][j] *= FACTOR  # (intermediate, hidden): row j makes input channel j of down
            weights[down][:, j] /= FACTOR
    save_file({k: v.contiguous() for k, v in weights.items()}, str(folder / "model.safetensors"),
              metadata={"format": "pt"})
    art = root / "llama"
    import_artifact(folder, art, validation_max_length=8, interventions=False)
    return art, model.config.num_hidden_layers


def _logits(path: Path, meta: dict, ids: np.ndarray) -> np.ndarray:
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return sess.run(["logits"], budget.feeds(sess, meta, ids))[0][0]


def _heldout(art: Path, meta: dict) -> np.ndarray:
    ids, _ = budget.heldout_ids(meta, art, None)
    return np.asarray(ids[:96], np.int64)


def test_the_planted_channels_are_outliers_and_smoothing_keeps_the_fp32_logits(outlier_llama, tmp_path):
    art, layers = outlier_llama
    meta = json.loads((art / "model.json").read_text())
    folded = tmp_path / "folded.onnx"
    onnx.save_model(quantize.fold_weight_transposes(onnx.load(str(art / "model.onnx"))), str(folded))
    windows = quantize.calibration_windows(meta, art, None)
    found = smooth.targets(onnx.load(str(folded)))
    assert len(found) == layers  # one down projection per layer
    maxima = smooth.channel_maxima(folded, [t["x"] for t in found], windows, lambda s, x: budget.feeds(s, meta, x))
    for m in maxima:  # the planted channels are the largest, by far
        assert set(np.argsort(m)[-len(OUTLIERS):]) == set(OUTLIERS)
        assert m[list(OUTLIERS)].min() > 10 * np.median(m)
    record = smooth.smooth(folded, tmp_path / "smoothed.onnx", windows, lambda s, x: budget.feeds(s, meta, x))
    assert record["activations"] == layers and record["input_max_over_median"] > 10
    assert record["calibration_tokens"] == sum(len(w) for w in windows) > 0
    ids = _heldout(art, meta)
    before, after = _logits(folded, meta, ids), _logits(tmp_path / "smoothed.onnx", meta, ids)
    assert np.abs(after - before).max() <= 1e-4 * max(1.0, float(np.abs(before).max()))
    # the smoothed graph's down inputs have no outlier channel left
    again = smooth.channel_maxima(tmp_path / "smoothed.onnx", [t["x"] for t in found], windows,
                                  lambda s, x: budget.feeds(s, meta, x))
    assert all(m.max() < 4 * np.median(m) for m in again)


def test_a_smoothed_dynamic_copy_stays_closer_to_fp32(outlier_llama, tmp_path):
    art, layers = outlier_llama
    meta = json.loads((art / "model.json").read_text())
    ids = _heldout(art, meta)
    fp32 = _logits(art / "model.onnx", meta, ids)
    errors = {}
    for mode in ("on", "off"):
        out = tmp_path / f"llama-{mode}"
        res = subprocess.run([sys.executable, "-m", "export", "quantize", str(art), "--out", str(out),
                              "--smoothing", mode, *LOOSE], capture_output=True, text=True, cwd=ROOT, timeout=300)
        assert res.returncode == 0, res.stderr
        q = json.loads((out / "model.json").read_text())["quantization"]
        assert (q["smoothing"] or {}).get("activations") == (layers if mode == "on" else None)
        got = _logits(out / "model.onnx", meta, ids)
        errors[mode] = float(np.abs(got - fp32).mean())
        p = torch.log_softmax(torch.from_numpy(fp32), -1)
        errors[f"{mode} kl"] = float((p.exp() * (p - torch.log_softmax(torch.from_numpy(got), -1))).sum(-1).mean())
    assert errors["on"] < 0.5 * errors["off"], errors
    assert errors["on kl"] < 0.5 * errors["off kl"], errors
