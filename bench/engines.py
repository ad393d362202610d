"""The engines compared: PyTorch eager on the checkpoint's weights and onnxruntime sessions on the artifact."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort


def session(path: Path, threads: int = 2, level: str = "ALL", optimized_out: Path | None = None,
            spinning: bool = True) -> ort.InferenceSession:
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.log_severity_level = 3
    opts.graph_optimization_level = {
        "DISABLE": ort.GraphOptimizationLevel.ORT_DISABLE_ALL, "BASIC": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
        "EXTENDED": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED, "ALL": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
    }[level]
    if not spinning:
        opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if optimized_out is not None:
        opts.optimized_model_filepath = str(optimized_out)
    return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])


def feeds(sess: ort.InferenceSession, ids: np.ndarray, past: list[np.ndarray] | None = None) -> dict:
    inputs = sess.get_inputs()
    B, T = ids.shape
    H, Dh = inputs[2].shape[1], inputs[2].shape[3]
    P = 0 if past is None else past[0].shape[2]
    out = {"input_ids": ids, "attention_mask": np.ones((B, P + T), np.int64)}
    for i, spec in enumerate(inputs[2:]):
        out[spec.name] = np.zeros((B, H, 0, Dh), np.float32) if past is None else past[i]
    return out


def iobinding_runner(sess: ort.InferenceSession, f: dict):
    """Inputs bound once as OrtValues, outputs allocated by onnxruntime: the per-call copy of inputs is gone."""
    binding = sess.io_binding()
    for name, value in f.items():
        binding.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(value))
    for out in sess.get_outputs():
        binding.bind_output(out.name, "cpu")
    return lambda: sess.run_with_iobinding(binding)


def torch_model(checkpoint_dir: Path, threads: int = 2):
    import torch

    from model import checkpoint

    torch.set_num_threads(threads)
    model, _ = checkpoint.load(checkpoint_dir)
    return model


def torch_forward(model, ids: np.ndarray):
    import torch

    t = torch.from_numpy(ids)

    def run():
        with torch.inference_mode():
            return model(t)

    return run
