"""posenc's worker with onnxruntime's CUDA execution provider (`--provider cuda`), on the peer benchmark's model,
serving its float16 fast graph (fast16.onnx, export/half.py) and its float32 one, beside the same worker on that
machine's CPUs and beside `make bench-peers`' CPU figures.

It runs on a machine with an NVIDIA GPU and onnxruntime-gpu, over an artifact rebuilt there by bench/gpu_pack.py
(the peer model's graphs and shapes; weights drawn from a seed, so the 1 GB artifact need not travel).  Each
engine is the worker over HTTP (OpenAI /v1/completions, streamed), driven by bench/peers.py's load generator: the
same 32 prompts of 128 ids, greedy, 64 new tokens, at 1, 8 and 32 streams, in rounds whose order rotates.  Tokens
are compared with transformers' greedy tokens on the redrawn model (computed where it was packed; float16 rounds
apart from float32, so a greedy stream may part from them at a near tie).  Before the runs, onnxruntime's own log
says which execution provider each node of each decoding graph was placed on.

  python -m bench peers-gpu --models /tmp/gpu-models --reference .gpu/pack/reference-32x128-64.json \
      --engines cuda16,cuda,cpu:16 --rounds 3 --out bench/results

Writes peers_gpu.json and peers_gpu.md under --out.  Benchmarks report; they never assert.
"""

from __future__ import annotations

import json
import os
import platform
import re
import statistics
import subprocess
import sys
import threading
from datetime import UTC, datetime
from pathlib import Path

from bench.lib.results import write
from bench.peers import STREAMS, load, measure, pct
from bench.peers_engines import HttpEngine
from bench.peers_model import NEW_TOKENS, prompts
from model.cli import Parser

ROOT = Path(__file__).resolve().parent.parent


def gpu_query(fields: str) -> list[str]:
    """nvidia-smi --query-gpu for the first GPU, or [] when there is none."""
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [x.strip() for x in out.splitlines()[0].split(",")] if out.strip() else []


class GpuMemory:
    """The GPU's used memory, sampled every 0.2 s while a block runs: the largest sample, in GB."""

    def __init__(self) -> None:
        self.peak = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self._stop.wait(0.2):
            used = gpu_query("memory.used")
            if used:
                self.peak = max(self.peak, float(used[0]) / 1024)

    def __enter__(self) -> GpuMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def placements(folder: Path, provider: str) -> dict:
    """Which execution provider onnxruntime placed each node of the decoding graph on (cuda16: fast16.onnx; else
    fast.onnx, or model.onnx): its verbose log, read in a child process (the log goes to stderr).
    {provider: {"nodes": n, op_type: count}}."""
    code = ("import onnxruntime as ort, sys; o = ort.SessionOptions(); o.log_severity_level = 0; "
            "o.log_verbosity_level = 1; ort.InferenceSession(sys.argv[1], o, providers=sys.argv[2].split(','))")
    prov = "CPUExecutionProvider" if provider == "cpu" else "CUDAExecutionProvider,CPUExecutionProvider"
    graph = folder / ("fast.onnx" if (folder / "fast.onnx").is_file() else "model.onnx")  # the one decoding runs
    if provider == "cuda16":
        graph = folder / "fast16.onnx"
    res = subprocess.run([sys.executable, "-c", code, str(graph), prov], capture_output=True,
                         text=True, timeout=600)
    found: dict[str, dict[str, int]] = {}
    current = None
    for line in res.stderr.splitlines():
        text = line.split("]", 1)[-1] if line.startswith("20") else line  # the text after the log line's prefix
        m = re.search(r"(?:All nodes|Node\(s\)) placed on \[(\w+)\]\. Number of nodes: (\d+)", text)
        if m:
            current = found.setdefault(m.group(1), {"nodes": int(m.group(2))})
            continue
        m = re.match(r"^\s+(\w+) \(", text) if current is not None else None
        if m is None:
            current = None  # the end of that provider's node list
            continue
        current[m.group(1)] = current.get(m.group(1), 0) + 1
    if res.returncode != 0:
        tail = res.stderr.strip().splitlines()[-1][:300] if res.stderr.strip() else f"exit status {res.returncode}"
        found["error"] = {tail: 1}
    return found


def worker(label: str, models: Path, name: str, provider: str, threads: int, logs: Path) -> HttpEngine:
    """The worker over HTTP; provider cuda16 is --provider cuda serving the float16 fast graph (--half on), cuda
    the float32 one (--half off)."""
    half = "on" if provider == "cuda16" else "off"
    return HttpEngine.posenc(label, models, name, "--threads", str(threads), "--provider", provider.removesuffix("16"),
                             "--half", half, log=logs / f"{provider}-{threads}.log")


def summary(engines: dict, stats: dict) -> dict:
    out = {}
    for key, eng in engines.items():
        st = stats[key]
        out[key] = {"engine": eng.name, **{f"tps_{s}": round(statistics.median(st[s]["tps"]), 1) for s in STREAMS},
                    "first_p50_ms_1": round(pct(st[1]["first"], 0.5)),
                    "first_p50_ms_32": round(pct(st[32]["first"], 0.5)),
                    "peak_rss_gb": round(eng.peak, 2), "equal": sum(st[s]["equal"] for s in STREAMS),
                    "compared": sum(st[s]["total"] for s in STREAMS),
                    "rounds_tps": {s: [round(x, 1) for x in st[s]["tps"]] for s in STREAMS}}
    return out


def tables(engines: dict, place: dict, unavailable: dict, cpu: dict | None) -> dict:
    cols = ["engine", "1 stream tok/s", "first token p50 ms", "8 streams tok/s", "32 streams tok/s",
            "32 streams first token p50 ms", "peak RSS GB", "tokens equal to transformers"]
    rows = [[r["engine"], r["tps_1"], r["first_p50_ms_1"], r["tps_8"], r["tps_32"], r["first_p50_ms_32"],
             r["peak_rss_gb"], f"{r['equal']}/{r['compared']}"] for r in engines.values()]
    if cpu:
        rows.append([f"{cpu['engine']} ({cpu['source']})", cpu["tps_1"], cpu["first_p50_ms_1"], cpu["tps_8"],
                     cpu["tps_32"], cpu["first_p50_ms_32"], cpu["peak_rss_gb"], f"{cpu['equal']}/{cpu['compared']}"])
    out = {"gpu": {"columns": cols, "rows": rows},
           "placement": {"columns": ["--provider", "execution provider", "nodes", "operators"],
                         "rows": [[prov, ep, ops.get("nodes"), ", ".join(
                             f"{k} {v}" for k, v in sorted(ops.items(), key=lambda kv: -kv[1]) if k != "nodes")]
                             for prov, eps in place.items() for ep, ops in eps.items()]}}
    if unavailable:
        out["unavailable"] = {"columns": ["engine", "why it did not run"], "rows": [[k, v] for k, v in
                                                                                     unavailable.items()]}
    return out


def markdown(res: dict) -> str:
    m = res["meta"]
    lines = [f"# posenc worker on a GPU ({m['date']}, {m['gpu']}, {m['machine']}, load {m['load']} -> "
             f"{m['load_end']})", "", f"`{m['command']}`; onnxruntime {m['onnxruntime']}; GPU memory peak "
             f"{m['gpu_memory_peak_gb']} GB (nvidia-smi, the whole run).", ""]
    for tid, t in res["tables"].items():
        lines += [f"## {tid}", "", "| " + " | ".join(t["columns"]) + " |", "|" + "---|" * len(t["columns"])]
        lines += ["| " + " | ".join("–" if c is None else str(c) for c in row) + " |" for row in t["rows"]] + [""]
    return "\n".join(lines)


def cpu_reference() -> dict | None:
    """make bench-peers' fp32 posenc worker row (bench/results/peers_fp32.json), with its machine and date."""
    path = ROOT / "bench" / "results" / "peers_fp32.json"
    if not path.is_file():
        return None
    d = json.loads(path.read_text())
    row = d["engines"].get("posenc")
    if row is None:
        return None
    return {**{k: row[k] for k in ("engine", "tps_1", "tps_8", "tps_32", "first_p50_ms_1", "first_p50_ms_32",
                                   "peak_rss_gb", "equal", "compared")},
            "source": f"bench/results/peers_fp32.json, {d['meta']['machine']}, {d['meta']['threads']} threads, "
                      f"{d['meta']['date'][:10]}, original weights"}


def main(argv: list[str] | None = None) -> int:
    p = Parser(prog="python -m bench peers-gpu", description=__doc__.split("\n\n")[0])
    p.add_argument("--models", type=Path, required=True, help="a model directory holding the rebuilt artifact")
    p.add_argument("--reference", type=Path, required=True, help="transformers' greedy tokens (gpu_pack's file)")
    p.add_argument("--engines", default="cuda16,cuda,cpu:16,cpu:2",
                   help="cuda16 (the float16 fast graph), cuda (float32), or cpu:THREADS, comma-separated")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = p.parse_args(argv)
    names = [d.name for d in sorted(args.models.iterdir()) if d.is_dir() and not d.name.startswith(".")]
    if len(names) != 1:
        p.exit(2, f"python -m bench peers-gpu: error: {args.models} must hold one artifact, found {names}\n")
    folder = args.models / names[0]
    gpu = gpu_query("name,memory.total,driver_version")
    import onnxruntime as ort

    meta = {"date": datetime.now(UTC).isoformat(timespec="seconds"),
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {gpu[0] if gpu else 'no GPU'}, {platform.node()}",
            "gpu": f"{gpu[0]} ({float(gpu[1]) / 1024:.0f} GiB, driver {gpu[2]})" if gpu else "no GPU",
            "load": load(),
            "onnxruntime": f"{ort.__version__} ({', '.join(ort.get_available_providers())})",
            "command": " ".join(["python -m bench peers-gpu", *(sys.argv[1:] if argv is None else argv)]),
            "artifact": names[0], "prompt_tokens": 128, "new_tokens": NEW_TOKENS, "rounds": args.rounds}
    wanted, make = [], {}
    logs = args.out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    for spec in [e for e in args.engines.split(",") if e]:
        provider, _, threads = spec.partition(":")
        n = int(threads or 2)
        kind = {"cuda16": "float16 (fast16.onnx), CUDA", "cuda": "fp32, CUDA"}.get(provider, "fp32, CPU")
        label = f"posenc worker HTTP, {kind}, {n} threads"
        make[spec] = (lambda label=label, provider=provider, n=n:
                      worker(label, args.models, names[0], provider, n, logs))
        wanted.append(spec)
    place = {prov: placements(folder, prov) for prov in sorted({s.partition(":")[0] for s in wanted})}
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    ref = json.loads(args.reference.read_text())
    with GpuMemory() as mem:
        engines, stats, unavailable = measure(make, wanted, prompts(), ref,
                                              lambda ids: tok.decode(ids, skip_special_tokens=False), args.rounds)
    meta["load_end"] = load()
    meta["gpu_memory_peak_gb"] = round(mem.peak, 2)
    rows = summary(engines, stats)
    res = {"meta": meta, "tables": tables(rows, place, unavailable, cpu_reference()), "engines": rows,
           "placements": place, "unavailable": unavailable}
    print(write(args.out, "peers_gpu", res, markdown(res)))
    return 0

