"""A fast graph run directly in onnxruntime as one stream decodes, the reference the worker's served tokens are
compared with (tests/export/test_quantize_fast.py, tests/hf/test_half.py)."""

import json
from pathlib import Path

import numpy as np
import onnxruntime as ort


def greedy_direct(folder: Path, prompt: list[int], n: int, graph: str = "fast.onnx") -> list[int]:
    """The artifact's `graph` alone: the prompt in one call (its last position's logits), then one token per call
    over the present cache, in the graph's own cache type (float16 for fast16.onnx)."""
    meta = json.loads((folder / "model.json").read_text())
    sess = ort.InferenceSession(str(folder / graph), providers=["CPUExecutionProvider"])
    inputs = {i.name: i for i in sess.get_inputs()}
    pasts = [st["input"] for st in meta["state"]]
    outs = ["logits"] + [st["output"] for st in meta["state"]]
    cache = [np.zeros((1, inputs[p].shape[1], 0, inputs[p].shape[3]),
                      np.float16 if inputs[p].type == "tensor(float16)" else np.float32) for p in pasts]
    ids, total, tokens = list(prompt), 0, []
    for _ in range(n):
        total += len(ids)
        feeds = {"input_ids": np.array([ids], np.int64), "attention_mask": np.ones((1, total), np.int64),
                 "logits_positions": np.array([[len(ids) - 1]], np.int64), **dict(zip(pasts, cache, strict=True))}
        if "seqlens_k" in inputs:
            feeds["seqlens_k"], feeds["total_sequence_length"] = (np.array([total - 1], np.int32),
                                                                  np.array(total, np.int32))
        res = sess.run(outs, feeds)
        cache = res[1:]
        tokens.append(int(res[0][0, -1].argmax()))
        ids = [tokens[-1]]
    return tokens


def every_logits(folder: Path, rows: np.ndarray, graph: str = "fast.onnx") -> np.ndarray:
    """Every position's logits (N, T, vocab) of each row of `rows` (N, T) alone, from position 0 with no past."""
    meta = json.loads((folder / "model.json").read_text())
    sess = ort.InferenceSession(str(folder / graph), providers=["CPUExecutionProvider"])
    inputs = {i.name: i for i in sess.get_inputs()}
    n = rows.shape[1]
    out = []
    for row in rows:
        feeds = {"input_ids": row[None].astype(np.int64), "attention_mask": np.ones((1, n), np.int64),
                 "logits_positions": np.arange(n, dtype=np.int64)[None]}
        for st in meta["state"]:
            feeds[st["input"]] = np.zeros((1, inputs[st["input"]].shape[1], 0, inputs[st["input"]].shape[3]),
                                          np.float32)
        if "seqlens_k" in inputs:
            feeds["seqlens_k"], feeds["total_sequence_length"] = np.array([n - 1], np.int32), np.array(n, np.int32)
        out.append(sess.run(["logits"], feeds)[0][0])
    return np.stack(out)


def exact_outputs(folder: Path, ids: np.ndarray, mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The exact graph (model.onnx) on a batch with no past: (logits, attentions)."""
    meta = json.loads((folder / "model.json").read_text())
    sess = ort.InferenceSession(str(folder / "model.onnx"), providers=["CPUExecutionProvider"])
    sizes = meta["sizes"]
    empty = np.zeros((ids.shape[0], sizes["n_kv_heads"], 0, sizes["head_dim"]), np.float32)
    feeds = {"input_ids": ids, "attention_mask": mask, **{st["input"]: empty for st in meta["state"]}}
    logits, attentions = sess.run([o["name"] for o in meta["outputs"][:2]], feeds)
    return logits, attentions


def main(argv: list[str]) -> None:
    """The runs above in a process of their own (tests/emulated.py runs it on an emulated CPU), each result with the
    CPU features numpy found (read with CPUID, as onnxruntime reads them: what an emulated CPU presents):

        python -m tests.direct fast FOLDER GRAPH ROWS.npy OUT.npz          every_logits of the rows
        python -m tests.direct exact IN.npz FOLDER OUT.npz [FOLDER OUT.npz ...]   exact_outputs of IN's ids, mask
    """
    from numpy._core._multiarray_umath import __cpu_features__ as cpu

    features = np.array(sorted(k for k, v in cpu.items() if v))
    if argv[0] == "fast":
        folder, graph, rows, out = argv[1:]
        np.savez(out, logits=every_logits(Path(folder), np.load(rows), graph), features=features)
        return
    batch = np.load(argv[1])
    for folder, out in zip(argv[2::2], argv[3::2], strict=True):
        logits, attentions = exact_outputs(Path(folder), batch["ids"], batch["mask"])
        np.savez(out, logits=logits, attentions=attentions, features=features)


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
