"""Speed of a real-size imported model, every engine timed in one run (bench.real_models calls it): one 128-token
forward (batch 1) and greedy generation of 32 tokens after the 128-token prompt with the KV cache, for

  posenc's artifact in onnxruntime, in process: logits only (no maps) and logits + every attention map
  posenc's worker (python -m service, its own process): gRPC Predict without and with maps, Generate
  transformers eager on the same folder, in process (logits; output_attentions)
  optimum-onnx's export of the same folder through ORTModelForCausalLM, in its own virtualenv (bench/optimum_side.py
    as a subprocess answering one command at a time), and its graph through a bare session (logits)

all on the same number of threads (intra_op for onnxruntime, torch.set_num_threads for transformers), timed in
alternating blocks (bench.timing.interleaved) so a busy minute on a shared machine lands on every engine; ratios
are medians of per-round ratios.  Benchmarks report; they never assert.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np

from bench.engines import feeds as engine_feeds
from bench.engines import session
from bench.timing import interleaved, paired_ratio

LENGTH, NEW_TOKENS, THREADS = 128, 32, 2
TARGETS = {"no maps": 1.05, "with maps": 1.15}  # posenc / Optimum at 128 tokens, at most (issue 14)
ROOT = Path(__file__).resolve().parent.parent


class OptimumSide:
    """bench/optimum_side.py in the optimum virtualenv, driven one JSON line at a time."""

    def __init__(self, python: str, folder: Path, onnx_dir: Path, threads: int = THREADS):
        # -P: bench/ is not put on sys.path (bench/http.py would shadow the standard library's http)
        self.proc = subprocess.Popen([python, "-P", str(ROOT / "bench" / "optimum_side.py"), "--folder", str(folder),
                                      "--onnx", str(onnx_dir), "--threads", str(threads), "--length", str(LENGTH),
                                      "--new-tokens", str(NEW_TOKENS)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()
        if not line:
            err = self.proc.stderr.read().strip().splitlines()
            raise RuntimeError(f"optimum side failed: {err[-1] if err else 'no output'}")
        self.ready = json.loads(line)

    def call(self, cmd: str) -> dict:
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def close(self) -> None:
        try:
            self.call("quit")
        except (BrokenPipeError, ValueError):
            pass
        self.proc.wait(timeout=30)


def posenc_session(artifact: Path):
    return session(artifact / "model.onnx", threads=THREADS)


def posenc_greedy(sess, meta: dict, ids: np.ndarray, new_tokens: int) -> list[int]:
    """The worker's decode loop, in process: prefill, then one token per call feeding the present cache back;
    fetches logits and the cache only (no maps), as Generate does."""
    states = meta["state"]
    names = ["logits"] + [st["output"] for st in states]
    feeds = engine_feeds(sess, ids)
    out, cur = [], ids
    for _ in range(new_tokens):
        res = sess.run(names, feeds)
        nxt = int(res[0][0, -1].argmax())
        out.append(nxt)
        cur = np.array([[nxt]], np.int64)
        feeds = {"input_ids": cur, "attention_mask": np.ones((1, feeds["attention_mask"].shape[1] + 1), np.int64),
                 **{st["input"]: r for st, r in zip(states, res[1:], strict=True)}}
    return out


def worker_rss(pid: int) -> dict:
    status = dict(line.split(":", 1) for line in open(f"/proc/{pid}/status"))
    return {k: round(int(status[key].split()[0]) / 1e6, 2) for k, key in
            (("rss_gb", "VmRSS"), ("peak_rss_gb", "VmHWM"), ("rss_anon_gb", "RssAnon"), ("rss_file_gb", "RssFile"))}


def measure_speed(folder: Path, artifact: Path, optimum: tuple[str, Path] | None, runs: int,
                  block: int = 3) -> dict:
    """Forward latency and generation speed of every engine on the same weights and prompt (see the module)."""
    import grpc
    import torch
    import transformers as tf

    from bench.lib.worker import Worker
    from protos.posenc.v1 import posenc_pb2 as pb
    from protos.posenc.v1 import posenc_pb2_grpc

    torch.set_num_threads(THREADS)
    meta = json.loads((artifact / "model.json").read_text())
    name = meta["name"]
    ids = np.random.default_rng(0).integers(0, 1000, (1, LENGTH), dtype=np.int64)  # bench/optimum_side.py's too
    t_ids = torch.from_numpy(ids)
    out: dict = {"length": LENGTH, "threads": THREADS, "new_tokens": NEW_TOKENS}
    opt = worker = channel = None
    try:
        if optimum:
            opt = OptimumSide(optimum[0], folder, optimum[1])
            out["optimum"] = {k: v for k, v in opt.ready.items() if k != "ready"}
        sess = posenc_session(artifact)
        feeds = engine_feeds(sess, ids)
        hf = tf.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
        worker = Worker(artifact.parent, "--threads", str(THREADS), "--max-wait-ms", "0")
        port, start_s = worker.port, worker.started_s
        channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.max_receive_message_length", -1)])
        stub = posenc_pb2_grpc.PosencStub(channel)
        prompt = pb.Prompt(tokens=pb.TokenIds(ids=ids[0].tolist()))
        stub.Predict(pb.PredictRequest(model=name, prompt=prompt))
        out["worker"] = {"start_to_serving_s": round(start_s, 1), **worker_rss(worker.proc.pid)}

        def eager(**kw):
            with torch.inference_mode():
                return hf(t_ids, **kw)

        fns = {
            "posenc onnxruntime, logits (no maps)": lambda: sess.run(["logits"], feeds),
            "posenc onnxruntime, logits + attentions": lambda: sess.run(["logits", "attentions"], feeds),
            "posenc worker gRPC Predict (no maps)": lambda: stub.Predict(pb.PredictRequest(model=name, prompt=prompt)),
            "posenc worker gRPC Predict (full maps)": lambda: stub.Predict(pb.PredictRequest(
                model=name, prompt=prompt, attention=pb.ATTENTION_FULL)),
            "transformers eager, logits": lambda: eager(),
            "transformers eager, output_attentions": lambda: eager(output_attentions=True),
        }
        if opt:
            fns["optimum ORTModelForCausalLM forward"] = lambda: opt.call("forward")
            fns["optimum graph, bare session (logits)"] = lambda: opt.call("bare")
        times = interleaved(fns, runs, block=block, warmup=1, block_warmup=1, pause_s=0.1)
        out["worker_after_predicts"] = worker_rss(worker.proc.pid)
        out["forward_ms"] = {k: {"median_ms": round(v["median_ms"], 1), "p10_ms": round(v["p10_ms"], 1),
                                 "p90_ms": round(v["p90_ms"], 1), "n": v["n"]} for k, v in times.items()}
        eager_key = "transformers eager, logits"
        out["speedup_vs_eager"] = {k: round(paired_ratio(times, eager_key, k), 2) for k in times}
        if opt:
            base = "optimum ORTModelForCausalLM forward"
            out["ratio_vs_optimum"] = {k: round(paired_ratio(times, k, base), 3) for k in times}
            pairs = {"no maps": "posenc onnxruntime, logits (no maps)",
                     "with maps": "posenc onnxruntime, logits + attentions"}
            out["targets"] = {k: {"engine": pairs[k], "ratio": out["ratio_vs_optimum"][pairs[k]], "at_most": t,
                                  "met": out["ratio_vs_optimum"][pairs[k]] <= t} for k, t in TARGETS.items()}
        out["generate"] = generate_speed(sess, meta, ids, hf, opt, stub, name, runs=max(2, runs // 4))
    finally:
        if channel is not None:
            channel.close()
        if worker is not None:
            worker.close()
        if opt is not None:
            opt.close()
    return out


def generate_speed(sess, meta, ids, hf, opt, stub, name: str, runs: int) -> dict:
    """Greedy NEW_TOKENS tokens after the prompt, KV cache, per engine: tokens/s (prefill included) and whether
    the tokens equal transformers' generate()."""
    import torch

    from protos.posenc.v1 import posenc_pb2 as pb

    got: dict[str, list[int]] = {}

    def keep(key, tokens):
        got[key] = list(tokens)

    def hf_generate():
        with torch.inference_mode():
            seq = hf.generate(torch.from_numpy(ids), attention_mask=torch.ones_like(torch.from_numpy(ids)),
                              max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                              use_cache=True, pad_token_id=0)
        keep("transformers eager generate()", seq[0, ids.shape[1]:].tolist())

    def worker_generate():
        call = stub.Generate(pb.GenerateRequest(model=name, prompt=pb.Prompt(tokens=pb.TokenIds(ids=ids[0].tolist())),
                                                max_new_tokens=NEW_TOKENS))
        keep("posenc worker gRPC Generate", [r.token.id for r in call])

    fns = {
        "posenc onnxruntime greedy loop": lambda: keep("posenc onnxruntime greedy loop",
                                                       posenc_greedy(sess, meta, ids, NEW_TOKENS)),
        "posenc worker gRPC Generate": worker_generate,
        "transformers eager generate()": hf_generate,
    }
    if opt:
        fns["optimum ORTModelForCausalLM generate()"] = lambda: keep("optimum ORTModelForCausalLM generate()",
                                                                    opt.call("generate")["tokens"])
    times = interleaved(fns, runs, block=1, warmup=1, block_warmup=0, pause_s=0.1)
    want = got["transformers eager generate()"]
    out = {}
    for k, t in times.items():
        n = len(got[k])
        out[k] = {"median_ms": round(t["median_ms"], 1), "tokens": n,
                  "tokens_per_s": round(n / (t["median_ms"] / 1000), 1), "same_tokens_as_transformers": got[k] == want}
    base = "optimum ORTModelForCausalLM generate()" if opt else "transformers eager generate()"
    for k in times:
        out[k][f"speed_vs_{'optimum' if opt else 'eager'}"] = round(paired_ratio(times, base, k), 3)
    return out


def summary(speed: dict) -> dict:
    """The few figures the row's summary keeps."""
    f, g = speed["forward_ms"], speed["generate"]
    row = {"posenc_no_maps_ms": f["posenc onnxruntime, logits (no maps)"]["median_ms"],
           "posenc_maps_ms": f["posenc onnxruntime, logits + attentions"]["median_ms"],
           "eager_ms": f["transformers eager, logits"]["median_ms"],
           "eager_attentions_ms": f["transformers eager, output_attentions"]["median_ms"],
           "predict_grpc_ms": f["posenc worker gRPC Predict (no maps)"]["median_ms"],
           "predict_grpc_maps_ms": f["posenc worker gRPC Predict (full maps)"]["median_ms"],
           "worker_rss_gb": speed["worker"]["rss_gb"],
           "generate_tokens_per_s": {k: v["tokens_per_s"] for k, v in g.items()}}
    if "optimum ORTModelForCausalLM forward" in f:
        row["optimum_ms"] = f["optimum ORTModelForCausalLM forward"]["median_ms"]
        row["targets"] = speed["targets"]
    row["speedup_vs_eager"] = speed["speedup_vs_eager"]
    return row

