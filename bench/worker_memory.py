"""Where the worker's memory goes at 32 streams: its peak resident set on the peer model, split by what holds it.

  python -m bench worker-memory [--work /tmp/posenc-peers] [--artifact DIR] [--streams 32] [--tokens 64] [--repeat 30]

The model is the peer benchmark's (bench/peers_model.py: SmolLM-135M's shape, a tied head, random weights, fp32,
128-token prompts), imported and exported as `make bench-peers` does (cached under --work).

  peak  a real worker (bench.lib.worker, its default settings, 2 threads among them, but the ports) with the
        prefix cache off, as in `make bench-peers` (no two prompts share one): at its default token budget
        (--batch-tokens 256) and at the peer benchmark's (4096, every prompt in one call).  --streams greedy
        streams of --tokens each over HTTP (the peer benchmark's load generator), while /proc/PID/smaps is read
        every 0.1 s; the largest sample's resident set split by mapping: private memory (onnxruntime's prepacked
        weights, its arena, the interpreter's heap), the weights file's mapped pages (what the graph reads from
        fast.onnx.data in place: the embedding's Gather reads the tied table there, while the head's MatMul reads
        its own prepacked copy), the KV cache (the compact layout's buffers, shared anonymous pages:
        service/compact.py's `buffer`), shared libraries and other files.  Beside them what the artifact implies:
        the weights' bytes and the KV cache of every stream at its last position.  The peak is the larger of the
        largest sample and the process's VmHWM (the kernel's own high-water mark, between samples too).
  head  the tied head alone, (rows, hidden) x (hidden, vocabulary), as onnxruntime runs it when its weights are a
        constant (prepacked: a second copy of the table, in private memory) and when they are read in place (the
        one copy the Gather reads too; the weights reach the MatMul through a Reshape onnxruntime cannot fold, so
        nothing prepacks them), --repeat calls each, alternating, the median.

Writes bench/results/worker_memory.{json,md}; `python -m bench peers --rejudge` reads the default budget's peak
into the peer benchmark's targets.  Reports; never asserts.
"""

from __future__ import annotations

import json
import re
import statistics
import threading
import time
from collections import Counter
from pathlib import Path

import numpy as np

from bench import peers_prepare as prep
from bench.lib.results import RESULTS, meta, write
from bench.peers_engines import HttpEngine, tree_rss_gb
from bench.peers_model import NEW_TOKENS, make_folder, prompts
from model.cli import Parser

BUDGETS = ((None, "256 (the worker's default)"), (4096, "4096 (make bench-peers)"))
PARTS = ("private", "weights file", "KV cache", "libraries and other files")
MAPPING = re.compile(r"^[0-9a-f]+-[0-9a-f]+$")


def parts(pid: int, weights: Path) -> Counter:
    """The resident MB of process pid, by part (PARTS), from /proc/PID/smaps."""
    out: Counter = Counter()
    part = "private"
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            head = line.split(maxsplit=5)
            if MAPPING.match(head[0]):  # a mapping's line: range perms offset dev inode [path]; else a field's
                path = head[5].strip() if len(head) > 5 else ""
                part = ("weights file" if path == str(weights) else "KV cache" if path.startswith("/dev/zero")
                        else "private" if not path or path.startswith("[") else "libraries and other files")
            elif head[0] == "Rss:":
                out[part] += int(head[1]) / 1000  # kB (KiB) / 1000: the unit of the peer benchmark's GB (KiB / 1e6)
    return out


def peak(art: Path, batch_tokens: int | None, streams: int, tokens: int, log: Path) -> dict:
    """One worker, its warm-up, then `streams` streams at once: the parts after the warm-up and at the peak."""
    args = ["--threads", "2", "--prefix-cache-mb", "0"]
    args += ["--batch-tokens", str(batch_tokens)] if batch_tokens else []
    eng = HttpEngine.posenc("worker", art.parent, art.name, *args, log=log, extra={"min_tokens": tokens})
    weights = (art / "fast.onnx.data").resolve()
    try:
        ids = prompts()[:streams].tolist()
        eng.run(ids[:1], tokens)
        ready = parts(eng.proc.pid, weights)
        best = Counter(ready)  # the largest sample's parts (this thread reads it once the sampler has ended)
        stop = threading.Event()

        def sample():
            while True:
                now = parts(eng.proc.pid, weights)
                if sum(now.values()) > sum(best.values()):
                    best.clear()
                    best.update(now)
                if stop.wait(0.1):
                    return

        t = threading.Thread(target=sample, daemon=True)
        t.start()
        try:
            out = eng.run(ids, tokens)
        finally:
            stop.set()
            t.join()  # its last sample is taken after the streams end
        hwm = tree_rss_gb(eng.proc.pid)[1] * 1000  # VmHWM: the kernel's own peak, which no sample can miss
        return {"ready": dict(ready), "peak": dict(best), "hwm": hwm,
                "tps": round(streams * tokens / out["wall_ms"] * 1000, 1)}
    finally:
        eng.close()


def head_times(hidden: int, vocab: int, rows: tuple[int, ...], repeat: int) -> list[list]:
    """The tied head's MatMul prepacked and read in place, ms per call (median of `repeat`, alternating)."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    table = np.random.default_rng(0).standard_normal((hidden, vocab), dtype=np.float32) * 0.02

    def session(in_place: bool) -> ort.InferenceSession:
        inits = [numpy_helper.from_array(table, "head")]
        nodes = [helper.make_node("MatMul", ["x", "head"], ["y"])]
        if in_place:  # the shape is made from x's at run time, so the weights are no constant: nothing prepacks them
            inits.append(numpy_helper.from_array(np.array([hidden, vocab], np.int64), "dims"))
            nodes = [helper.make_node("Shape", ["x"], ["width"], start=1),
                     helper.make_node("Sub", ["width", "width"], ["nought"]),
                     helper.make_node("Add", ["dims", "nought"], ["shape"]),
                     helper.make_node("Reshape", ["head", "shape"], ["read"]),
                     helper.make_node("MatMul", ["x", "read"], ["y"])]
        graph = helper.make_graph(nodes, "head",
                                  [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["rows", hidden])],
                                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["rows", vocab])], inits)
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = 2
        opts.log_severity_level = 3
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
        return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])

    sessions = {False: session(False), True: session(True)}
    table_rows = []
    for n in rows:
        x = np.random.default_rng(n).standard_normal((n, hidden), dtype=np.float32)
        a, b = (sessions[k].run(None, {"x": x})[0] for k in (False, True))
        if not np.allclose(a, b, rtol=1e-4, atol=1e-4):
            raise RuntimeError("the head read in place answers otherwise than the prepacked one")
        ms: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(repeat):
            for k in (False, True):
                start = time.perf_counter()
                sessions[k].run(None, {"x": x})
                ms[k].append((time.perf_counter() - start) * 1000)
        packed, in_place = statistics.median(ms[False]), statistics.median(ms[True])
        table_rows.append([n, round(packed, 2), round(in_place, 2), f"{in_place / packed:.2f}x"])
    return table_rows


def main(argv: list[str] | None = None) -> int:
    p = Parser(prog="python -m bench worker-memory", description=__doc__.split("\n\n")[0])
    p.add_argument("--work", type=Path, default=Path("/tmp/posenc-peers"))
    p.add_argument("--artifact", type=Path, help="serve this artifact folder instead of the peer model's")
    p.add_argument("--streams", type=int, default=32)
    p.add_argument("--tokens", type=int, default=NEW_TOKENS)
    p.add_argument("--repeat", type=int, default=30)
    p.add_argument("--out", type=Path, default=RESULTS)
    a = p.parse_args(argv)
    art = a.artifact
    if art is None:
        make_folder(a.work / "hf")
        art = prep.posenc_artifact(a.work / "hf", a.work)
    art = art.resolve()
    sizes = json.loads((art / "model.json").read_text())["sizes"]
    runs = [peak(art, budget, a.streams, a.tokens, a.work / f"worker-memory-{budget or 'default'}.log")
            for budget, _ in BUDGETS]
    weights_mb = (art / "fast.onnx.data").stat().st_size / 1024 / 1000
    positions = prompts().shape[1] + a.tokens
    kv_mb = 2 * sizes["n_layers"] * a.streams * sizes["n_kv_heads"] * positions * sizes["head_dim"] * 4 / 1024 / 1000
    rows = [[part] + [round(r["peak"].get(part, 0.0)) for r in runs] + [round(runs[0]["ready"].get(part, 0.0))]
            for part in PARTS]
    rows.append(["largest sample (the sum of the parts above)"] + [round(sum(r["peak"].values())) for r in runs]
                + [round(sum(runs[0]["ready"].values()))])
    rows.append(["peak resident set (VmHWM, the kernel's own)"] + [round(r["hwm"]) for r in runs] + [None])
    rows.append(["tokens/s over the streams, prompts included"] + [r["tps"] for r in runs] + [None])
    implied = [["the weights (fast.onnx.data)", round(weights_mb)],
               [f"the KV cache: {a.streams} streams x {positions} positions, fp32", round(kv_mb)],
               ["the weights and that KV cache", round(weights_mb + kv_mb)]]
    top = runs[0]["peak"]  # the default budget's largest sample
    runtime = top.get("private", 0.0) - weights_mb + top.get("libraries and other files", 0.0)
    implied += [["the rest at the default budget's peak: private memory beyond the weights' bytes, and the libraries",
                 round(runtime)],
                ["that peak without the table's mapped pages (the table held once)",
                 round(sum(top.values()) - top.get("weights file", 0.0))]]
    hidden, vocab = int(sizes["d_model"]), int(sizes["vocab_size"])
    head = head_times(hidden, vocab, (1, 8, a.streams), a.repeat)
    data = {"meta": meta(f"python -m bench worker-memory --streams {a.streams} --tokens {a.tokens}"),
            "peak_gb": {str(budget or 256): round(max(r["hwm"], sum(r["peak"].values())) / 1000, 3)
                        for (budget, _), r in zip(BUDGETS, runs, strict=True)},
            "tables": {
                "parts": {"columns": ["part", *(f"MB at the peak, --batch-tokens {label}" for _, label in BUDGETS),
                                      "MB after the warm-up (default budget)"], "rows": rows,
                          "note": f"{a.streams} streams of {a.tokens} tokens on 128-token prompts, prefix cache off; "
                                  "MB: 1000 KiB, as the peer benchmark's GB are 10^6 KiB"},
                "implied": {"columns": ["what the artifact implies, and what the peak leaves", "MB"], "rows": implied},
                "head": {"columns": ["rows", "head prepacked ms", "head read in place ms", "in place / prepacked"],
                         "rows": head,
                         "note": f"the tied head, ({hidden} x {vocab}) fp32, 2 intra-op threads; median of "
                                 f"{a.repeat} calls each, alternating"}}}
    print(write(a.out, "worker_memory", data))
    return 0
