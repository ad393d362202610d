"""One in-process peer engine inside its own virtualenv, driven by bench/peers.py one JSON line at a time.

    <venv>/bin/python -P bench/peers_side.py --engine ortgenai|openvino --model DIR --threads 2

Answers {"ready": true, ...} once loaded, then for each line {"prompts": [[id, ...], ...], "new_tokens": n} runs
greedy generation of every prompt at once (one prompt = one stream) and answers {"tokens": [[...], ...],
"first_ms": [...], "wall_ms": w}: the tokens, each stream's time to its first new token and the wall time of the
whole call.  "quit" ends it.  Run with -P: bench/ must not shadow the standard library (bench/http.py).
Imports only the engine's own packages and numpy: it runs in the peer's virtualenv, not posenc's.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np


class OrtGenai:
    """onnxruntime-genai: one Generator per call, every prompt a row of its batch (same length: no padding)."""

    def __init__(self, folder: str, threads: int):
        import onnxruntime_genai as og

        self.og = og
        cfg_path = f"{folder}/genai_config.json"
        with open(cfg_path) as f:
            cfg = json.load(f)
        opts = cfg["model"]["decoder"].setdefault("session_options", {})
        opts["intra_op_num_threads"] = threads
        opts.setdefault("provider_options", [])
        with open(cfg_path, "w") as f:
            json.dump(cfg, f, indent=2)
        config = og.Config(folder)
        config.clear_providers()
        self.model = og.Model(config)
        self.version = og.__version__

    def run(self, prompts: list[list[int]], new_tokens: int) -> dict:
        og = self.og
        ids = np.asarray(prompts, np.int32)
        start = time.perf_counter()
        params = og.GeneratorParams(self.model)
        length = ids.shape[1] + new_tokens
        params.set_search_options(max_length=length, min_length=length, do_sample=False, batch_size=len(ids))
        gen = og.Generator(self.model, params)
        gen.append_tokens(ids)
        first = None
        out: list[list[int]] = [[] for _ in prompts]
        while not gen.is_done():
            gen.generate_next_token()
            nxt = gen.get_next_tokens()
            if first is None:
                first = (time.perf_counter() - start) * 1000
            for row, t in zip(out, nxt, strict=True):
                row.append(int(t))
        wall = (time.perf_counter() - start) * 1000
        return {"tokens": out, "first_ms": [first] * len(prompts), "wall_ms": wall}


class OpenVino:
    """OpenVINO GenAI's continuous-batching pipeline (paged KV cache; what its model server runs): every prompt a
    request added at once, stepped until all finish.  f32 inference and KV cache (its CPU default is bf16 / u8 on
    processors that have them)."""

    def __init__(self, folder: str, threads: int, batch_tokens: int = 4096):
        import openvino as ov
        import openvino_genai as og

        self.ov, self.og = ov, og
        sched = og.SchedulerConfig()
        sched.cache_size = 2  # GB of KV cache
        sched.max_num_batched_tokens = batch_tokens  # its default is 256
        sched.max_num_seqs = 32
        sched.enable_prefix_caching = False
        props = {"INFERENCE_NUM_THREADS": threads, "INFERENCE_PRECISION_HINT": "f32", "KV_CACHE_PRECISION": "f32"}
        self.pipe = og.ContinuousBatchingPipeline(folder, sched, "CPU", props)
        self.version = og.__version__
        self.next_id = 0

    def run(self, prompts: list[list[int]], new_tokens: int) -> dict:
        og, ov = self.og, self.ov
        cfg = og.GenerationConfig()
        cfg.max_new_tokens = new_tokens
        cfg.min_new_tokens = new_tokens
        cfg.do_sample = False
        cfg.ignore_eos = True
        start = time.perf_counter()
        handles = []
        for p in prompts:
            handles.append(self.pipe.add_request(self.next_id, ov.Tensor(np.asarray([p], np.int64)), cfg))
            self.next_id += 1
        first = [None] * len(prompts)
        out: list[list[int]] = [[] for _ in prompts]
        while self.pipe.has_non_finished_requests():
            self.pipe.step()
            now = (time.perf_counter() - start) * 1000
            for i, h in enumerate(handles):
                if h.can_read():
                    for o in h.read().values():
                        out[i] += list(o.generated_ids)
                    if first[i] is None and out[i]:
                        first[i] = now
        for i, h in enumerate(handles):
            while h.can_read():
                for o in h.read().values():
                    out[i] += list(o.generated_ids)
        wall = (time.perf_counter() - start) * 1000
        return {"tokens": out, "first_ms": first, "wall_ms": wall}


ENGINES = {"ortgenai": OrtGenai, "openvino": OpenVino}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--engine", choices=ENGINES, required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batch-tokens", type=int, help="new prompt tokens in one step (OpenVINO's max_num_batched_tokens)")
    args = p.parse_args()
    extra = {"batch_tokens": args.batch_tokens} if args.batch_tokens and args.engine == "openvino" else {}
    engine = ENGINES[args.engine](args.model, args.threads, **extra)
    print(json.dumps({"ready": True, "version": engine.version}), flush=True)
    for line in sys.stdin:
        line = line.strip()
        if line == "quit":
            break
        req = json.loads(line)
        try:
            ans = engine.run(req["prompts"], req["new_tokens"])
        except Exception as exc:  # noqa: BLE001 — reported to the bench, which records it
            ans = {"error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(ans), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
