"""What posenc's dense mixture of experts costs against one dense MLP of an expert's width.

  python -m bench moe-cost [--repeat 200] [--threads 2]

posenc computes every expert on every token and weighs their outputs by the router's weights (zero outside each
token's top k: model/layers.py MoE), so one graph has no data-dependent shapes and equals transformers' sparse loop.
This measures the price: gpt-oss-shaped models (RMSNorm, sinks, the clamped SwiGLU, biases) with random weights,
exported as posenc exports every model, with 8 experts (top 2) and 32 (top 4, gpt-oss-20b's ratio), against the same
model with one dense MLP of an expert's width (n_experts 0).  Per model: model.onnx's bytes and nodes, and the
median time of a decode step (batch 1, 1 new token over a 128-token cache) and of a 128-token prefill in
onnxruntime (CPU, --threads intra-op threads).  The machine's load is recorded.  Writes bench/results/moe_cost.json
(docs/real-models.md's table: make docs).  Reports; never asserts.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.lib.results import machine, meta, write
from model.cli import Parser

RESULTS = Path(__file__).resolve().parent / "results"
SHAPE = {"variant": "rope", "vocab_size": 1024, "d_model": 256, "n_layers": 4, "n_heads": 8, "n_kv_heads": 2,
         "d_head": 32, "d_mlp": 256, "context": 4096, "norm": "rmsnorm", "mlp": "clamped_swiglu", "attn_sinks": True,
         "tie_head": False}
MODELS = {"dense (one MLP, 256 wide)": {}, "8 experts, top 2": {"n_experts": 8, "experts_top_k": 2},
          "32 experts, top 4": {"n_experts": 32, "experts_top_k": 4}}
PAST, PREFILL = 128, 128


def session(path: Path, threads: int):
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads, opts.inter_op_num_threads, opts.log_severity_level = threads, 1, 3
    return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])


def feeds(sess, cfg, new: int, past: int) -> dict[str, np.ndarray]:
    out = {}
    for i in sess.get_inputs():
        if i.name == "input_ids":
            out[i.name] = np.ones((1, new), np.int64)
        elif i.name == "attention_mask":
            out[i.name] = np.ones((1, past + new), np.int64)
        else:  # a past key or value
            out[i.name] = np.zeros((1, cfg.kv_heads, past, cfg.head_dim), np.float32)
    return out


def timed(sess, inputs: dict, repeat: int) -> float:
    for _ in range(5):
        sess.run(None, inputs)
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        sess.run(None, inputs)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


def measure(name: str, extra: dict, folder: Path, repeat: int, threads: int) -> dict:
    import onnx
    import torch

    from export.build import export_onnx
    from model.config import ModelConfig
    from model.transformer import Transformer

    torch.manual_seed(0)
    cfg = ModelConfig(**SHAPE, **extra)
    model = Transformer(cfg).eval()
    path = folder / name.split()[0] / "model.onnx"  # weights past 64 MiB go to model.onnx.data beside it
    path.parent.mkdir()
    export_onnx(model, path, opset=23, attention="onnx")
    proto = onnx.load(str(path))
    sess = session(path, threads)
    return {"model": name, "n_experts": cfg.n_experts, "top_k": cfg.experts_top_k,
            "parameters": sum(p.numel() for p in model.parameters()),
            "onnx_bytes": sum(f.stat().st_size for f in path.parent.iterdir()),
            "nodes": len(proto.graph.node),
            "step_ms": timed(sess, feeds(sess, cfg, 1, PAST), repeat),
            "prefill_ms": timed(sess, feeds(sess, cfg, PREFILL, 0), max(repeat // 10, 5))}


def table(rows: list[dict]) -> dict:
    base = rows[0]
    return {"columns": ["model", "parameters", "model.onnx (MiB)", "nodes", "decode step (ms)", "x dense",
                        "128-token prefill (ms)", "x dense"],
            "rows": [[r["model"], r["parameters"], round(r["onnx_bytes"] / 2**20, 1), r["nodes"],
                      round(r["step_ms"], 2), round(r["step_ms"] / base["step_ms"], 1), round(r["prefill_ms"], 1),
                      round(r["prefill_ms"] / base["prefill_ms"], 1)] for r in rows],
            "note": "d_model 256, 4 layers, experts 256 wide, gpt-oss's block (sinks, clamped SwiGLU, biases); "
                    "decode step: 1 new token over a 128-token cache, batch 1; medians"}


def main(argv: list[str] | None = None) -> int:
    parser = Parser(prog="python -m bench moe-cost", description=__doc__.split("\n")[0])
    parser.add_argument("--repeat", type=int, default=200)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        rows = [measure(name, extra, Path(tmp), args.repeat, args.threads) for name, extra in MODELS.items()]
    result = {"meta": meta("python -m bench moe-cost", machine=f"{machine()}, onnxruntime {args.threads} threads"),
              "tables": {"cost": table(rows)}, "rows": rows}
    write(RESULTS, "moe_cost", result, indent=2)
    for row in result["tables"]["cost"]["rows"]:
        print(" | ".join(str(c) for c in row))
    return 0
