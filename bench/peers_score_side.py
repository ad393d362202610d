"""One in-process peer's next-token log-probabilities, inside the peer's own virtualenv (bench/peers_accuracy.py).

    <venv>/bin/python -P bench/peers_score_side.py --engine ortgenai|openvino --model DIR --windows FILE --threads 2

FILE is JSON: a list of windows, each a list of token ids.  For every window the engine's own runtime computes the
logits of every position in one call (onnxruntime-genai: a Generator given the whole window, its `logits` output;
OpenVINO: the exported stateful IR's infer request, its state reset per window), and the answer, one JSON line on
stdout, holds per window and position the top-1 token and the log-probability of the window's next token.
Imports only the engine's own packages and numpy (run with -P: bench/ must not shadow the standard library).
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def ortgenai(folder: str, threads: int):
    import onnxruntime_genai as og

    path = f"{folder}/genai_config.json"
    with open(path) as f:
        cfg = json.load(f)
    cfg["model"]["decoder"].setdefault("session_options", {})["intra_op_num_threads"] = threads
    with open(path, "w") as f:
        json.dump(cfg, f, indent=2)
    config = og.Config(folder)
    config.clear_providers()
    model = og.Model(config)

    def logits(window: list[int]) -> np.ndarray:
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=len(window) + 1, batch_size=1)
        gen = og.Generator(model, params)
        gen.append_tokens(np.asarray([window], np.int32))
        out = np.asarray(gen.get_output("logits"))
        return out.reshape(-1, out.shape[-1])[-len(window):]

    return logits, og.__version__


def openvino(folder: str, threads: int):
    import openvino as ov

    core = ov.Core()
    compiled = core.compile_model(f"{folder}/openvino_model.xml", "CPU",
                                  {"INFERENCE_NUM_THREADS": threads, "INFERENCE_PRECISION_HINT": "f32"})
    request = compiled.create_infer_request()
    names = {n for p in compiled.inputs for n in p.get_names()}

    def logits(window: list[int]) -> np.ndarray:
        n = len(window)
        feeds = {"input_ids": np.asarray([window], np.int64), "attention_mask": np.ones((1, n), np.int64)}
        if "position_ids" in names:
            feeds["position_ids"] = np.arange(n, dtype=np.int64)[None]
        if "beam_idx" in names:
            feeds["beam_idx"] = np.zeros(1, np.int32)
        request.reset_state()
        request.infer(feeds)
        return np.asarray(request.get_tensor("logits").data)[0]

    return logits, ov.__version__


ENGINES = {"ortgenai": ortgenai, "openvino": openvino}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--engine", choices=ENGINES, required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--windows", required=True)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    with open(args.windows) as f:
        windows = json.load(f)
    logits, version = ENGINES[args.engine](args.model, args.threads)
    top1, logp = [], []
    for w in windows:
        lp = log_softmax(logits(w))
        if lp.shape[0] != len(w):
            raise SystemExit(f"{args.engine} gave logits for {lp.shape[0]} positions of a {len(w)}-token window")
        top1.append(lp[:-1].argmax(-1).tolist())
        logp.append(lp[np.arange(len(w) - 1), w[1:]].tolist())
    print(json.dumps({"version": version, "top1": top1, "logp": logp}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
