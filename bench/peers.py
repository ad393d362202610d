"""posenc against the engines people pick instead, on one real-size model (`make bench-peers`; not in make test).

The model: a LLaMA with SmolLM-135M's shape (bench/peers_model.py; random weights, fp32).  Every engine gets the
same 32 prompts of 128 token ids, greedy, 64 new tokens, at 1, 8 and 32 streams at once:

  posenc worker       python -m service, OpenAI /v1/completions over HTTP (fp32, and the int8 / int4 copies:
                      `export quantize` --method int8 (MatMulNBits), dynamic (MatMulInteger), int4)
  posenc in process   the artifact's onnxruntime session in a greedy loop, streams as rows of one batch
  onnxruntime-genai   its model builder's graph, one Generator (in process, .venv-peers-ortgenai)
  OpenVINO GenAI      optimum-intel's IR, the continuous-batching pipeline (in process, .venv-peers-openvino)
  vLLM CPU            its OpenAI server (.venv-peers-vllm)
  llama.cpp           llama-server -np 32 (continuous batching) from llama-cpp-python's vendored source, f32 / q8_0

HTTP servers are driven by one load generator (bench/peers_engines.py).  Engines take turns in rounds whose order
rotates, so a busy minute on a shared machine lands on each; the load is recorded.  Tokens/s = generated tokens
/ wall time of the call (prefill included); first token = request sent -> first text (HTTP) or first new token
(in process).  Ratios are posenc's tokens/s over the peer's, the median over rounds.  An engine that cannot be
prepared or started here is listed with the error text.  Benchmarks report; they never assert.

  python -m bench.peers [--engines posenc,ortgenai,...] [--rounds 2] [--work /tmp/posenc-peers]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

from bench import peers_prepare as prep
from bench.peers_engines import HttpEngine, PosencInProcess, SideEngine
from bench.peers_model import NEW_TOKENS, SHAPE, make_folder, prompts, reference_tokens
from bench.serving import free_port

ROOT = Path(__file__).resolve().parent.parent
STREAMS = (1, 8, 32)
THREADS = 2
ALL = ("posenc", "posenc-int8", "posenc-int8-dynamic", "posenc-int4", "posenc-inproc", "ortgenai", "openvino", "vllm",
       "llamacpp", "llamacpp-q8")
INT8 = ("posenc-int8", "posenc-int8-dynamic")  # both int8 methods within the budget; the int8 target takes the faster
HTTP = "posenc worker HTTP, fp32"


def venv_python(name: str) -> str:
    return str(ROOT / f".venv-peers-{name}" / "bin" / "python")


def starters(folder: Path, work: Path, llama_dir: Path) -> dict:
    """name -> (label, function making the started engine)."""
    logs = work / "logs"
    llama_src = llama_dir / "src"

    def posenc_worker(label, art):
        port = free_port()
        return HttpEngine(label, [sys.executable, "-m", "service", "--model-dir", str(art.parent), "--port", "0",
                                  "--http-port", str(port), "--metrics-port", "-1", "--log-level", "WARNING",
                                  "--threads", str(THREADS)], port, art.name, log=logs / f"{art.name}.log")

    def fp32():
        return prep.posenc_artifact(folder, work)

    def vllm():
        port = free_port()
        py = venv_python("vllm")
        return HttpEngine("vLLM CPU (OpenAI server, eager)", [
            py, "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder), "--served-model-name", "peer",
            "--port", str(port), "--host", "127.0.0.1", "--dtype", "float32", "--max-model-len", "512",
            "--max-num-seqs", "32", "--no-enable-prefix-caching", "--enforce-eager"],
            port, "peer", extra={"ignore_eos": True, "min_tokens": NEW_TOKENS},
            env={"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": "0-1", "OMP_NUM_THREADS": str(THREADS)},
            log=logs / "vllm.log")

    def llama(kind):  # -kvu: one KV cache the slots share; with a cache per slot 8 / 32 streams ran ~10x slower
        server = llama_dir / "build" / "bin" / "llama-server"
        if not server.is_file():
            raise RuntimeError(f"{server} was not built (make bench-peers builds it)")
        gguf = prep.gguf_model(venv_python("llamacpp"), llama_src, folder, work, kind)
        port = free_port()
        return HttpEngine(f"llama.cpp llama-server -np 32, {kind}", [
            str(server), "-m", str(gguf), "--port", str(port), "--host", "127.0.0.1", "-np", "32",
            "-c", str(32 * 256), "-kvu", "-t", str(THREADS), "-tb", str(THREADS), "--no-webui"],
            port, "peer", extra={"ignore_eos": True, "cache_prompt": False}, ready_path="/health",
            log=logs / f"llamacpp-{kind}.log")

    return {
        "posenc": lambda: posenc_worker(HTTP, fp32()),
        "posenc-int8": lambda: posenc_worker("posenc worker HTTP, int8 (MatMulNBits)",
                                             prep.posenc_quantized(fp32(), work, "int8")),
        "posenc-int8-dynamic": lambda: posenc_worker("posenc worker HTTP, int8 dynamic (MatMulInteger)",
                                                     prep.posenc_quantized(fp32(), work, "dynamic")),
        "posenc-int4": lambda: posenc_worker("posenc worker HTTP, int4",
                                             prep.posenc_quantized(fp32(), work, "int4")),
        "posenc-inproc": lambda: PosencInProcess(fp32(), THREADS),
        "ortgenai": lambda: SideEngine("onnxruntime-genai (in process)", venv_python("ortgenai"), "ortgenai",
                                       prep.ortgenai_model(venv_python("ortgenai"), folder, work), THREADS,
                                       logs / "ortgenai.log"),
        "openvino": lambda: SideEngine("OpenVINO GenAI (in process)", venv_python("openvino"), "openvino",
                                       prep.openvino_model(venv_python("openvino"), folder, work), THREADS,
                                       logs / "openvino.log"),
        "vllm": vllm,
        "llamacpp": lambda: llama("f32"),
        "llamacpp-q8": lambda: llama("q8_0"),
    }


def equal_count(ans: dict, idx: list[int], ref: list[list[int]], decode) -> tuple[int, int]:
    """(streams whose output equals transformers', streams compared): prompts past len(ref) have no reference."""
    pairs = [(k, i) for k, i in enumerate(idx) if i < len(ref)]
    if "tokens" in ans:
        return sum(ans["tokens"][k] == ref[i] for k, i in pairs), len(pairs)
    return sum(ans["texts"][k] == decode(ref[i]) for k, i in pairs), len(pairs)


def pct(xs: list[float], q: float) -> float:
    xs = sorted(x for x in xs if x is not None)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))] if xs else float("nan")


def turn(eng, r: int, P, ref, decode, stats: dict) -> None:
    """One engine's turn in round r: 1 stream (two prompts, one after the other), then 8 and 32 at once."""
    for s in STREAMS:
        time.sleep(0.3)
        runs = [[(2 * r + k) % len(P)] for k in range(2)] if s == 1 else [[(r * s + k) % len(P) for k in range(s)]]
        for idx in runs:
            ans = eng.measured([P[i].tolist() for i in idx], NEW_TOKENS)
            n = sum(ans["counts"]) if "counts" in ans else sum(len(t) for t in ans["tokens"])
            st = stats[s]
            st["tps"].append(n / (ans["wall_ms"] / 1000))
            st["first"] += ans["first_ms"]
            eq, tot = equal_count(ans, idx, ref, decode)
            st["equal"], st["total"] = st["equal"] + eq, st["total"] + tot


def measure(make: dict, wanted: list[str], P, ref, decode, rounds: int) -> tuple[dict, dict, dict]:
    """Rounds of every engine at 1, 8 and 32 streams, order rotating per round.  An engine is started for its turn
    and stopped after it (converted models are reused), so one engine at a time holds memory and its peak RSS is
    its own.  An engine that fails to start or to answer, in any round, is listed as unavailable with the error.
    Returns (the last started engine of each key, stats, unavailable)."""
    stats = {k: {s: {"tps": [], "first": [], "equal": 0, "total": 0} for s in STREAMS} for k in wanted}
    engines: dict = {}
    unavailable: dict = {}
    for r in range(rounds):
        shift = r % len(wanted)
        for key in wanted[shift:] + wanted[:shift]:
            if key in unavailable:
                continue
            print(f"round {r + 1}: starting {key} ...", flush=True)
            eng = None
            try:
                eng = make[key]()
                if key in engines:
                    eng.peak = max(eng.peak, engines[key].peak)
                engines[key] = eng
                eng.run([P[-1].tolist()], NEW_TOKENS)  # warm-up, not counted (vLLM needs min_tokens <= max_tokens)
                turn(eng, r, P, ref, decode, stats[key])
            except Exception as exc:  # noqa: BLE001 — the reason goes into the results
                unavailable[key] = f"{type(exc).__name__}: {exc}"
                print(f"  {key} unavailable: {unavailable[key][:300]}", flush=True)
                engines.pop(key, None)
                continue
            finally:
                if eng is not None:
                    eng.close()
            print(f"  round {r + 1}: {eng.name}: " + ", ".join(
                f"{s}: {stats[key][s]['tps'][-1]:.1f} tok/s" for s in STREAMS), flush=True)
    return engines, {k: v for k, v in stats.items() if k in engines}, unavailable


def load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def summarise(engines: dict, stats: dict, unavailable: dict, meta: dict) -> dict:
    rows, out = [], {}
    for key, eng in engines.items():
        st = stats[key]
        row = {"engine": eng.name, "version": eng.version,
               **{f"tps_{s}": round(statistics.median(st[s]["tps"]), 1) for s in STREAMS},
               "first_p50_ms_1": round(pct(st[1]["first"], 0.5)), "first_p99_ms_1": round(pct(st[1]["first"], 0.99)),
               "first_p50_ms_32": round(pct(st[32]["first"], 0.5)),
               "first_p99_ms_32": round(pct(st[32]["first"], 0.99)),
               "peak_rss_gb": round(eng.peak, 2) if eng.peak else None,
               "equal": sum(st[s]["equal"] for s in STREAMS), "compared": sum(st[s]["total"] for s in STREAMS)}
        out[key] = {**row, "rounds_tps": {s: [round(x, 1) for x in st[s]["tps"]] for s in STREAMS}}
        rows.append([row["engine"], row["tps_1"], row["first_p50_ms_1"], row["first_p99_ms_1"], row["tps_8"],
                     row["tps_32"], f"{row['first_p50_ms_32']} / {row['first_p99_ms_32']}",
                     "n/a (bench process)" if row["peak_rss_gb"] is None else row["peak_rss_gb"],
                     f"{row['equal']}/{row['compared']}"])
    tables = {"peers": {"columns": ["engine", "1 stream tok/s", "first token p50 ms", "first token p99 ms",
                                    "8 streams tok/s", "32 streams tok/s", "32 streams first token p50 / p99 ms",
                                    "peak RSS GB", "tokens equal to transformers"], "rows": rows}}
    ratio_rows = []
    for mine in ("posenc", "posenc-inproc", *INT8):
        if mine not in stats:
            continue
        for key in engines:
            if key.startswith("posenc") or (mine in INT8) != (key == "llamacpp-q8"):
                continue  # fp32 against every peer, int8 against llama.cpp's q8_0
            pairs = {s: zip(stats[mine][s]["tps"], stats[key][s]["tps"], strict=True) for s in STREAMS}
            ratio_rows.append([engines[mine].name, engines[key].name]
                              + [f"{statistics.median(a / b for a, b in pairs[s]):.2f}x" for s in STREAMS])
    tables["ratios"] = {"columns": ["posenc", "peer", "1 stream", "8 streams", "32 streams"], "rows": ratio_rows}
    tables["unavailable"] = {"columns": ["engine", "why it did not run here"],
                             "rows": [[k, v] for k, v in unavailable.items()]}
    tables["targets"] = targets(out, quant_budget())
    return {"meta": meta, "tables": tables, "engines": out, "unavailable": unavailable}


def quant_budget(path: Path = ROOT / "bench" / "results" / "peers_quant.json") -> dict | None:
    """The int8 accuracy budget as bench/peers_quant.py last measured it on a model trained here: {method: (rows
    within budget, rows, date)}; None when it has not been run."""
    try:
        res = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    t = res["tables"]["budget"]
    col = {c: i for i, c in enumerate(t["columns"])}
    out: dict = {}
    for row in t["rows"]:
        ok, n, _ = out.get(row[col["method"]], (0, 0, None))
        out[row[col["method"]]] = (ok + bool(row[col["within"]]), n + 1, res["meta"]["date"])
    return out


def targets(out: dict, budget: dict | None = None) -> dict:
    def get(key, field):
        return out.get(key, {}).get(field)

    def ratio(a, b, field):
        x, y = get(a, field), get(b, field)
        return None if x is None or y is None else x / y

    rows = []
    r = ratio("posenc", "ortgenai", "tps_1")
    rows.append(["1 stream fp32 tok/s >= 1.0x onnxruntime-genai", None if r is None else f"{r:.2f}x",
                 None if r is None else r >= 1.0])
    r = ratio("posenc", "ortgenai", "first_p50_ms_1")
    rows.append(["first token <= 1.0x onnxruntime-genai", None if r is None else f"{r:.2f}x",
                 None if r is None else r <= 1.0])
    best = max((get(k, "tps_32") or 0 for k in ("vllm", "openvino")), default=0)
    r = get("posenc", "tps_32") / best if best and get("posenc", "tps_32") else None
    rows.append(["32 streams HTTP >= 1.0x best of vLLM / OpenVINO", None if r is None else f"{r:.2f}x",
                 None if r is None else r >= 1.0])
    fast = max((k for k in INT8 if get(k, "tps_1")), key=lambda k: get(k, "tps_1"), default=None)
    r = ratio(fast, "llamacpp-q8", "tps_1") if fast else None
    rows.append(["int8 1 stream >= 1.2x llama.cpp q8_0", None if r is None else f"{r:.2f}x ({out[fast]['engine']})",
                 None if r is None else r >= 1.2])
    method = {"posenc-int8": "int8", "posenc-int8-dynamic": "dynamic"}.get(fast, "int8")
    if budget and method in budget:
        ok, n, date = budget[method]
        rows.append([f"int8 ({method}) within the accuracy budget on a model trained here (top-1 >= 0.97, nats/byte "
                     "<= +2%)", f"{ok}/{n} lengths within (bench.peers_quant, {date})", ok == n])
    else:
        rows.append(["int8 within the accuracy budget on a model trained here", "not measured (python -m "
                     "bench.peers_quant)", None])
    rss = get("posenc", "peak_rss_gb")
    rows.append(["peak RSS fp32 (32 streams) <= 1.3 GB", rss, None if rss is None else rss <= 1.3])
    if fast and get(fast, "peak_rss_gb") and get("llamacpp-q8", "peak_rss_gb"):
        rows.append(["peak RSS int8 (32 streams), llama.cpp q8_0's beside it (no target)",
                     f"{get(fast, 'peak_rss_gb')} GB (q8_0: {get('llamacpp-q8', 'peak_rss_gb')} GB)", None])
    return {"columns": ["target", "measured", "met"], "rows": rows}


def markdown(res: dict) -> str:
    m = res["meta"]
    lines = [f"# Peer benchmark ({m['date']}, {m['machine']}, load {m['load']} -> {m['load_end']})", ""]
    for tid, t in res["tables"].items():
        lines += [f"## {tid}", "", "| " + " | ".join(t["columns"]) + " |", "|" + "---|" * len(t["columns"])]
        lines += ["| " + " | ".join("–" if c is None else str(c) for c in row) + " |" for row in t["rows"]] + [""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.peers", description=__doc__.split("\n\n")[0])
    p.add_argument("--engines", default=",".join(ALL))
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--reference-prompts", type=int, default=32,
                   help="prompts whose tokens are checked against transformers' generate() (its time grows with it)")
    p.add_argument("--work", type=Path, default=Path("/tmp/posenc-peers"))
    p.add_argument("--llama-dir", type=Path, default=ROOT / ".venv-peers-llamacpp" / "llama.cpp")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = p.parse_args(argv)
    wanted = [e for e in args.engines.split(",") if e]
    bad = [e for e in wanted if e not in ALL]
    if bad:
        p.exit(2, f"python -m bench.peers: error: unknown engine {bad[0]!r}; known: {', '.join(ALL)}\n")
    meta = {"date": datetime.now(UTC).isoformat(timespec="seconds"),
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.node()}", "load": load(),
            "command": " ".join(["python -m bench.peers", *(sys.argv[1:] if argv is None else argv)]),
            "model": {"family": "llama", **SHAPE}, "prompt_tokens": 128, "new_tokens": NEW_TOKENS, "threads": THREADS,
            "rounds": args.rounds}
    folder = args.work / "hf"
    (args.work / "logs").mkdir(parents=True, exist_ok=True)
    print("model folder and transformers' reference tokens ...", flush=True)
    meta["parameters"] = make_folder(folder)["parameters"]
    P = prompts()
    ref = reference_tokens(folder, P[:args.reference_prompts])
    meta["reference_prompts"] = len(ref)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))

    def decode(ids):
        return tok.decode(ids, skip_special_tokens=False)

    make = starters(folder, args.work, args.llama_dir)
    engines, stats, unavailable = measure(make, wanted, P, ref, decode, args.rounds)
    meta["load_end"] = load()
    if shutil.which("nvidia-smi") is None:  # the GPU run (--provider cuda) needs one
        unavailable["gpu (--provider cuda)"] = "no NVIDIA GPU on this machine (nvidia-smi not found): CPU engines only"
    res = summarise(engines, stats, unavailable, meta)
    args.out.mkdir(parents=True, exist_ok=True)
    for suffix, text in (("json", json.dumps(res, indent=1)), ("md", markdown(res))):
        tmp = args.out / f".peers.{suffix}.tmp"
        tmp.write_text(text)
        tmp.replace(args.out / f"peers.{suffix}")
    print(markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
