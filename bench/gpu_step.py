"""One decode step of the fast graphs under onnxruntime's CUDA provider, with the KV cache where the worker keeps it
and where it could be kept: what a cache in GPU memory would save a step.

The worker's compact layout keeps each cache tensor in one host buffer (numpy) bound through IOBinding as both past
and present.  Under the CUDA provider onnxruntime then copies every buffer to the GPU before a step and back after
it, whole: at 32 rows of 192 positions that is the cache's every byte, twice a step.  Bound instead as OrtValues in
GPU memory, past and present are the same device buffer and GroupQueryAttention writes the new slots in place.
This times, in one process and in alternating blocks, the decode step (one new token per row over a past of
`--past` positions, capacity `--capacity`) of fast16.onnx with host buffers and with device buffers, and of the
float32 fast.onnx with host buffers (its GroupQueryAttention runs on the CPU, so a device cache would only move the
copies); only the logits come back to the host.

  python -m bench gpu-step --artifact /tmp/gpu-models/smollm-redrawn --out bench/results

Writes gpu_step.json and gpu_step.md under --out.  Benchmarks report; they never assert.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import numpy as np

from bench.lib.results import write
from bench.peers import load
from bench.peers_gpu import gpu_query
from model.cli import Parser

BATCHES = (1, 32)


class Step:
    """A graph's decode step bound once: cache buffers (host numpy or device OrtValues) as past and present."""

    def __init__(self, ort, sess, batch: int, past: int, capacity: int, where: str, logits: str = "bound"):
        inputs = {i.name: i for i in sess.get_inputs()}
        pasts = [n for n in inputs if n.startswith("past_key_values.")]
        dtype = np.float16 if inputs[pasts[0]].type == "tensor(float16)" else np.float32
        shape = (batch, inputs[pasts[0]].shape[1], capacity, inputs[pasts[0]].shape[3])
        self.sess, self.io = sess, sess.io_binding()
        self.values = []
        for name in pasts:
            host = np.zeros(shape, dtype)
            value = ort.OrtValue.ortvalue_from_numpy(host, "cuda", 0) if where == "cuda" else \
                ort.OrtValue.ortvalue_from_numpy(host)
            self.values.append((host, value))  # the host array outlives its OrtValue
            self.io.bind_ortvalue_input(name, value)
            self.io.bind_ortvalue_output(name.replace("past_key_values.", "present."), value)
        self.io.bind_cpu_input("input_ids", np.full((batch, 1), 7, np.int64))
        self.io.bind_cpu_input("attention_mask", np.ones((batch, past + 1), np.int64))
        self.io.bind_cpu_input("seqlens_k", np.full(batch, past, np.int32))
        self.io.bind_cpu_input("total_sequence_length", np.array(past + 1, np.int32))
        self.io.bind_cpu_input("logits_positions", np.zeros((batch, 1), np.int64))
        if logits == "host":  # a preallocated host buffer the logits are written into
            self.logits = np.zeros((batch, 1, sess.get_outputs()[0].shape[2]), np.float32)
            self.io.bind_ortvalue_output("logits", ort.OrtValue.ortvalue_from_numpy(self.logits))
        elif logits == "device":  # left in GPU memory; copied to the host below
            self.io.bind_output("logits", "cuda", 0)
        else:  # onnxruntime places it (the worker's binding); copied to the host below
            self.io.bind_output("logits")
        self.bytes = sum(h.nbytes for h, _ in self.values)

    def __call__(self) -> float:
        t = time.perf_counter()
        self.sess.run_with_iobinding(self.io)
        self.io.copy_outputs_to_cpu()
        return (time.perf_counter() - t) * 1e3


def operators(ort, args, providers: list[str], batch: int = 32, top: int = 12) -> dict:
    """onnxruntime's own profile of fast16.onnx's step at `batch` rows with the cache in GPU memory: time per
    operator type (kernel time as the provider reports it, summed over the steps), the run's total beside it."""
    import tempfile

    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    opts.enable_profiling = True
    with tempfile.TemporaryDirectory() as tmp:
        opts.profile_file_prefix = str(Path(tmp) / "step")
        sess = ort.InferenceSession(str(args.artifact / "fast16.onnx"), opts, providers=providers)
        step = Step(ort, sess, batch, args.past, args.capacity, "cuda")
        for _ in range(3):
            step()
        ms = [step() for _ in range(args.steps)]
        events = json.loads(Path(sess.end_profiling()).read_text())
    by: dict[tuple[str, str], float] = {}
    runs = [e for e in events if e.get("cat") == "Session" and e.get("name") == "model_run"][-args.steps:]
    start = runs[0]["ts"] if runs else 0
    for e in events:
        if e.get("cat") == "Node" and e.get("name", "").endswith("_kernel_time") and e["ts"] >= start:
            a = e.get("args", {})
            key = (a.get("op_name", "?"), a.get("provider", "?"))
            by[key] = by.get(key, 0.0) + e["dur"] / 1e3 / args.steps
    total = statistics.median(e["dur"] / 1e3 for e in runs) if runs else float("nan")
    rows = [[op, prov.replace("ExecutionProvider", ""), round(t, 3), f"{t / total:.1%}"]
            for (op, prov), t in sorted(by.items(), key=lambda kv: -kv[1])[:top]]
    rows.append(["(the run, onnxruntime's model_run)", "", round(total, 3), "100%"])
    rows.append(["(the step as timed above, logits copied)", "", round(statistics.median(ms), 3), ""])
    return {"title": f"fast16.onnx at {batch} rows, cache in GPU memory: ms per step by operator (onnxruntime's "
                     f"profiler, median run of {args.steps})",
            "columns": ["operator", "provider", "ms per step", "share of the run"], "rows": rows}


def main(argv: list[str] | None = None) -> int:
    p = Parser(prog="python -m bench gpu-step", description=__doc__.split("\n\n")[0])
    p.add_argument("--artifact", type=Path, required=True, help="an artifact with fast.onnx and fast16.onnx")
    p.add_argument("--past", type=int, default=160)
    p.add_argument("--capacity", type=int, default=192)
    p.add_argument("--steps", type=int, default=30, help="steps per block")
    p.add_argument("--blocks", type=int, default=3)
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = p.parse_args(argv)
    import onnxruntime as ort

    if "CUDAExecutionProvider" not in ort.get_available_providers():
        p.exit(2, "python -m bench gpu-step: error: this onnxruntime has no CUDA execution provider\n")
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    providers = ["CUDAExecutionProvider", "CPUExecutionProvider"]
    sessions = {g: ort.InferenceSession(str(args.artifact / g), opts, providers=providers)
                for g in ("fast16.onnx", "fast.onnx")}
    cases = [(g, b, where) for b in BATCHES for g, where in
             (("fast16.onnx", "host"), ("fast16.onnx", "cuda"), ("fast16.onnx", "cuda+host logits"),
              ("fast16.onnx", "cuda+device logits"), ("fast.onnx", "host"))]
    steps = {c: Step(ort, sessions[c[0]], c[1], args.past, args.capacity, c[2].partition("+")[0],
                     c[2].partition("+")[2].split(" ")[0] or "bound") for c in cases}
    times: dict = {c: [] for c in cases}
    for step in steps.values():  # warm-up: each binding's first runs allocate
        for _ in range(3):
            step()
    for _ in range(args.blocks):
        for c in cases:
            times[c] += [steps[c]() for _ in range(args.steps)]
    rows = []
    for g, b, where in cases:
        ms = statistics.median(times[(g, b, where)])
        base = statistics.median(times[(g, b, "host")])
        place = {"host": "host memory (numpy, the worker's)", "cuda": "GPU memory (OrtValues on cuda:0)",
                 "cuda+host logits": "GPU memory; logits into a host buffer bound once",
                 "cuda+device logits": "GPU memory; logits bound on the GPU, then copied"}[where]
        rows.append([b, g, place,
                     round(steps[(g, b, where)].bytes / 1e6, 1), round(ms, 2),
                     round(float(np.percentile(times[(g, b, where)], 90)), 2), round(b / ms * 1e3, 1),
                     f"{base / ms:.2f}x"])
    gpu = gpu_query("name,memory.total,driver_version")
    meta = {"date": datetime.now(UTC).isoformat(timespec="seconds"),
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.node()}",
            "gpu": f"{gpu[0]} ({float(gpu[1]) / 1024:.0f} GiB, driver {gpu[2]})" if gpu else "no GPU",
            "load": load(), "onnxruntime": ort.__version__,
            "command": " ".join(["python -m bench gpu-step", *(sys.argv[1:] if argv is None else argv)]),
            "artifact": args.artifact.name, "past": args.past, "capacity": args.capacity,
            "steps": args.steps * args.blocks}
    res = {"meta": meta, "tables": {"step": {
        "title": f"one decode step after {args.past} positions (buffers of {args.capacity}), median of "
                 f"{args.steps * args.blocks}",
        "columns": ["batch", "graph", "KV cache in", "cache MB", "ms per step", "p90 ms", "tokens/s",
                    "vs host memory, same graph"],
        "rows": rows}}}
    res["tables"]["operators"] = operators(ort, args, providers)
    print(write(args.out, "gpu_step", res))
    print(json.dumps({"load_end": load()}))
    return 0

