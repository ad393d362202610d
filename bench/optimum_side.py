"""The Optimum side of bench.real_models, run in its own virtualenv (requirements/optimum.txt: optimum-onnx 0.1.0
needs transformers 4.57, the build venv pins 5.x).  Never imports posenc: it only needs this file.

  .venv-optimum/bin/python -P bench/optimum_side.py --folder HF_DIR --onnx OUT_DIR [--threads 2] [--length 128]

Exports HF_DIR with optimum (task text-generation-with-past) into OUT_DIR when OUT_DIR has no model.onnx, loads
it with ORTModelForCausalLM on the CPU provider (intra_op threads as given), then prints one JSON line (ready:
export and load seconds, RSS) and answers one JSON line per command read from stdin, so the caller can time
this engine in blocks interleaved with its own:
  forward   one forward of the 128-token prompt through ORTModelForCausalLM (logits and the present cache)
  bare      the same graph through its bare InferenceSession, fetching logits only (graph against graph)
  generate  N greedy tokens after the prompt with the KV cache (generate(do_sample=False)); answers the tokens
  quit
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def rss_gb() -> float:
    status = dict(line.split(":", 1) for line in open("/proc/self/status"))
    return round(int(status["VmRSS"].split()[0]) / 1e6, 3)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--folder", required=True)
    p.add_argument("--onnx", required=True)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--length", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    import numpy as np
    import onnxruntime as ort
    import torch
    from optimum.exporters.onnx import main_export
    from optimum.onnxruntime import ORTModelForCausalLM

    torch.set_num_threads(args.threads)
    out = Path(args.onnx)
    export_s = None
    if not (out / "model.onnx").is_file():
        start = time.perf_counter()
        main_export(args.folder, output=out, task="text-generation-with-past", device="cpu")
        export_s = round(time.perf_counter() - start, 1)
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = args.threads
    opts.log_severity_level = 3
    start = time.perf_counter()
    model = ORTModelForCausalLM.from_pretrained(out, provider="CPUExecutionProvider", session_options=opts,
                                                use_io_binding=False)
    load_s = round(time.perf_counter() - start, 1)
    ids = np.random.default_rng(args.seed).integers(0, 1000, (1, args.length), dtype=np.int64)
    t_ids, t_mask = torch.from_numpy(ids), torch.ones((1, args.length), dtype=torch.int64)

    # the bare session's feeds: the prompt, an all-ones mask, positions 0.., empty pasts
    sess = model.session
    feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids)}
    for i in sess.get_inputs():
        if i.name == "position_ids":
            feeds[i.name] = np.arange(args.length, dtype=np.int64)[None]
        elif i.name.startswith("past_key_values"):
            heads, dim = i.shape[1], i.shape[3]
            feeds[i.name] = np.zeros((1, heads, 0, dim), np.float32)

    def forward():
        with torch.inference_mode():
            return model(input_ids=t_ids, attention_mask=t_mask, use_cache=True)

    def generate():
        with torch.inference_mode():
            seq = model.generate(input_ids=t_ids, attention_mask=t_mask, max_new_tokens=args.new_tokens,
                                 min_new_tokens=args.new_tokens, do_sample=False, use_cache=True,
                                 pad_token_id=0)
        return seq[0, args.length:].tolist()

    forward()
    print(json.dumps({"ready": True, "export_s": export_s, "load_s": load_s, "rss_gb": rss_gb(),
                      "onnx_mb": round(sum(f.stat().st_size for f in out.glob("model.onnx*")) / 1e6, 1),
                      "versions": {"onnxruntime": ort.__version__, "torch": torch.__version__,
                                   "transformers": __import__("transformers").__version__,
                                   "optimum-onnx": _version("optimum-onnx")}}), flush=True)
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "forward":
            forward()
            print(json.dumps({"ok": True}), flush=True)
        elif cmd == "bare":
            sess.run(["logits"], feeds)
            print(json.dumps({"ok": True}), flush=True)
        elif cmd == "generate":
            print(json.dumps({"ok": True, "tokens": generate()}), flush=True)
        elif cmd == "rss":
            print(json.dumps({"ok": True, "rss_gb": rss_gb()}), flush=True)
        elif cmd == "quit":
            break
        else:
            print(json.dumps({"ok": False, "error": f"unknown command {cmd!r}"}), flush=True)
    return 0


def _version(dist: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None


if __name__ == "__main__":
    sys.exit(main())
