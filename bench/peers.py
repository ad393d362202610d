"""posenc against the engines people pick instead, on one real-size model (`make bench-peers`; not in make test).

The model: a LLaMA with SmolLM-135M's shape (bench/peers_model.py; random weights, fp32).  Every engine gets the
same 32 prompts of 128 token ids, greedy, 64 new tokens, at 1, 8 and 32 streams at once:

  posenc worker       python -m service, OpenAI /v1/completions over HTTP (fp32, and the int8 / int4 copies:
                      `export quantize` --method int8 (MatMulNBits), dynamic (MatMulInteger), int4, each with its
                      quantized fast graph)
  posenc in process   the artifact's onnxruntime session in a greedy loop, streams as rows of one batch
  posenc OpenVINO     the worker under onnxruntime's OpenVINO execution provider (--provider openvino, from
                      .venv-openvino: onnxruntime-openvino), fp32 and the int8 copy
  onnxruntime-genai   its model builder's graph (fp32, int8, int4), one Generator (in process, .venv-peers-ortgenai);
                      and its Generator driving posenc's own fast graph (ortgenai-posenc-graph: graph against loop)
  OpenVINO GenAI      optimum-intel's IR (weights fp32 or int8), the continuous-batching pipeline (in process)
  vLLM CPU            its OpenAI server (.venv-peers-vllm)
  llama.cpp           llama-server -np 32 (continuous batching) from llama-cpp-python's vendored source, f32 / q8_0 /
                      Q4_K_M

Every engine that has a setting for the new prompt tokens one call may take gets the same value, the 32 prompts'
4,096 (posenc --batch-tokens, OpenVINO GenAI's max_num_batched_tokens, vLLM's --max-num-batched-tokens;
onnxruntime-genai appends the batch's prompts in one call; llama.cpp keeps its own logical batch of 2,048).
HTTP servers are driven by one load generator (bench/peers_engines.py).  Engines take turns in rounds whose order
rotates, so a busy minute on a shared machine lands on each; the load is recorded.  Tokens/s = generated tokens
/ wall time of the call (prefill included); first token = request sent -> first text (HTTP) or first new token
(in process).  Ratios are posenc's tokens/s over the peer's of the same precision (bench/peers_targets.py), taken
within each round, the median over rounds; a throughput target is judged the same way against each round's best
peer.  Each quantized form's accuracy against fp32 is measured on a model trained here, by its own
engine (bench/peers_accuracy.py), and stated beside its row.  An engine that cannot be prepared or started here is
listed with the error text.  Benchmarks report; they never assert.

  python -m bench peers [--engines posenc,ortgenai,...] [--rounds 3] [--work /tmp/posenc-peers] [--no-accuracy]
                        [--name peers]
  python -m bench peers --rejudge [--out bench/results] [--name peers]   (the targets again, nothing measured)
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import statistics
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

from bench import peers_accuracy
from bench import peers_prepare as prep
from bench.lib.results import write
from bench.lib.worker import free_port
from bench.peers_engines import HttpEngine, PosencInProcess, SideEngine
from bench.peers_model import BATCH_TOKENS, NEW_TOKENS, SHAPE, make_folder, prompts, reference_tokens
from bench.peers_targets import quant_budget, ratio_rows, targets, worker_memory
from model.cli import Parser

ROOT = Path(__file__).resolve().parent.parent
STREAMS = (1, 8, 32)
THREADS = 2
ALL = ("posenc", "posenc-int8", "posenc-int8-dynamic", "posenc-int4", "posenc-inproc", "posenc-openvino",
       "posenc-int8-openvino", "ortgenai", "ortgenai-posenc-graph", "ortgenai-int8",
       "ortgenai-int4", "openvino", "openvino-int8", "vllm", "llamacpp", "llamacpp-q8", "llamacpp-q4km")
HTTP = "posenc worker HTTP, fp32"
EVERY = {"min_tokens": NEW_TOKENS}  # posenc's worker makes every token, as transformers' reference (min_new_tokens)


def venv_python(name: str) -> str:
    return str(ROOT / f".venv-peers-{name}" / "bin" / "python")


def starters(folder: Path, work: Path, llama_dir: Path) -> dict:
    """name -> (label, function making the started engine)."""
    logs = work / "logs"
    llama_src = llama_dir / "src"

    def posenc_worker(label, art):  # prefix cache off, as vLLM's and llama.cpp's are here: no two prompts share one
        return HttpEngine.posenc(label, art.parent, art.name, "--threads", str(THREADS), "--prefix-cache-mb", "0",
                                 "--batch-tokens", str(BATCH_TOKENS), log=logs / f"{art.name}.log", extra=EVERY)

    def fp32():
        return prep.posenc_artifact(folder, work)

    def posenc_openvino(art, precision="fp32"):  # the worker of .venv-openvino (make openvino) under OpenVINO
        py = ROOT / ".venv-openvino" / "bin" / "python"
        if not py.is_file():
            raise RuntimeError(f"{py} is missing (make openvino makes it)")
        port = free_port()
        return HttpEngine(f"posenc worker HTTP, {precision}, --provider openvino", [
            str(py), "-m", "service", "--model-dir", str(art.parent), "--port", "0", "--http-port", str(port),
            "--metrics-port", "-1", "--log-level", "WARNING", "--provider", "openvino", "--threads", str(THREADS),
            "--prefix-cache-mb", "0", "--batch-tokens", str(BATCH_TOKENS)], port, art.name, extra=EVERY,
            env={"POSENC_SPECULATE": "0"}, log=logs / f"{art.name}-openvino.log")  # plain decoding, as bench's Worker

    def ortgenai(precision):  # builder -p int8 / int4: MatMulNBits, accuracy_level 4
        name = "onnxruntime-genai" + ("" if precision == "fp32" else f" {precision}") + " (in process)"
        return SideEngine(name, venv_python("ortgenai"), "ortgenai",
                          prep.ortgenai_model(venv_python("ortgenai"), folder, work, precision), THREADS,
                          logs / f"ortgenai-{precision}.log")

    def ortgenai_posenc_graph():  # the same loop, posenc's fast graph: what the graph costs apart from the loop
        genai = prep.ortgenai_model(venv_python("ortgenai"), folder, work, "fp32")
        return SideEngine("onnxruntime-genai's Generator, posenc's fast graph (in process)", venv_python("ortgenai"),
                          "ortgenai", prep.posenc_for_genai(fp32(), genai, work), THREADS,
                          logs / "ortgenai-posenc-graph.log")

    def openvino(weights):  # optimum-intel --weight-format int8: weight compression, f32 inference as the fp32 row
        name = "OpenVINO GenAI" + ("" if weights == "fp32" else f" {weights} weights") + " (in process)"
        return SideEngine(name, venv_python("openvino"), "openvino",
                          prep.openvino_model(venv_python("openvino"), folder, work, weights), THREADS,
                          logs / f"openvino-{weights}.log", BATCH_TOKENS)

    def vllm():
        port = free_port()
        py = venv_python("vllm")
        return HttpEngine("vLLM CPU (OpenAI server, eager)", [
            py, "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder), "--served-model-name", "peer",
            "--port", str(port), "--host", "127.0.0.1", "--dtype", "float32", "--max-model-len", "512",
            "--max-num-seqs", "32", "--max-num-batched-tokens", str(BATCH_TOKENS), "--no-enable-prefix-caching",
            "--enforce-eager"],
            port, "peer", extra={"ignore_eos": True, "min_tokens": NEW_TOKENS},
            env={"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": "0-1", "OMP_NUM_THREADS": str(THREADS)},
            log=logs / "vllm.log")

    def llama(kind):  # -kvu: one KV cache the slots share; with a cache per slot 8 / 32 streams ran ~10x slower
        server = llama_dir / "build" / "bin" / "llama-server"
        if not server.is_file():
            raise RuntimeError(f"{server} was not built (make bench-peers builds it)")
        gguf = prep.gguf_model(venv_python("llamacpp"), llama_src, folder, work, kind)

        def start(extra):
            port = free_port()
            return HttpEngine(f"llama.cpp llama-server -np 32, {kind}" + (", --no-repack" if extra else ""), [
                str(server), "-m", str(gguf), "--port", str(port), "--host", "127.0.0.1", "-np", "32",
                "-c", str(32 * 256), "-kvu", "-t", str(THREADS), "-tb", str(THREADS), "--no-webui", *extra],
                port, "peer", extra={"ignore_eos": True, "cache_prompt": False}, ready_path="/health",
                log=logs / f"llamacpp-{kind}.log")

        try:
            return start([])
        except RuntimeError as exc:  # its CPU weight repacking can crash loading a quantized file (SIGSEGV here)
            if "status -11" not in str(exc):
                raise
            return start(["--no-repack"])

    return {
        "posenc": lambda: posenc_worker(HTTP, fp32()),
        "posenc-int8": lambda: posenc_worker("posenc worker HTTP, int8 (MatMulNBits)",
                                             prep.posenc_quantized(fp32(), work, "int8")),
        "posenc-int8-dynamic": lambda: posenc_worker("posenc worker HTTP, int8 dynamic (MatMulInteger)",
                                                     prep.posenc_quantized(fp32(), work, "dynamic")),
        "posenc-int4": lambda: posenc_worker("posenc worker HTTP, int4",
                                             prep.posenc_quantized(fp32(), work, "int4")),
        "posenc-inproc": lambda: PosencInProcess(fp32(), THREADS),
        "posenc-openvino": lambda: posenc_openvino(fp32()),
        "posenc-int8-openvino": lambda: posenc_openvino(prep.posenc_quantized(fp32(), work, "int8"),
                                                        "int8 (MatMulNBits)"),
        "ortgenai": lambda: ortgenai("fp32"),
        "ortgenai-posenc-graph": ortgenai_posenc_graph,
        "ortgenai-int8": lambda: ortgenai("int8"),
        "ortgenai-int4": lambda: ortgenai("int4"),
        "openvino": lambda: openvino("fp32"),
        "openvino-int8": lambda: openvino("int8"),
        "vllm": vllm,
        "llamacpp": lambda: llama("f32"),
        "llamacpp-q8": lambda: llama("q8_0"),
        "llamacpp-q4km": lambda: llama("Q4_K_M"),
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


def summarise(engines: dict, stats: dict, unavailable: dict, meta: dict, accuracy: dict | None = None) -> dict:
    rows, out = [], {}
    forms = (accuracy or {}).get("forms", {})
    for key, eng in engines.items():
        st = stats[key]
        acc = forms.get(key, {})
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
                     f"{row['equal']}/{row['compared']}",
                     acc.get("top1_agreement", acc.get("error") and "not scored"),
                     f"x{acc['nats_ratio']:.3f}" if "nats_ratio" in acc else None])
    tables = {"peers": {"columns": ["engine", "1 stream tok/s", "first token p50 ms", "first token p99 ms",
                                    "8 streams tok/s", "32 streams tok/s", "32 streams first token p50 / p99 ms",
                                    "peak RSS GB", "tokens equal to transformers",
                                    "top-1 agreement with fp32 (trained model)", "nats/byte vs fp32 (trained model)"],
                        "rows": rows}}
    tables["ratios"] = {"columns": ["posenc", "peer", "1 stream", "8 streams", "32 streams"],
                        "rows": ratio_rows(engines, stats)}
    if accuracy:
        tables["accuracy"] = peers_accuracy.table(accuracy)
    tables["unavailable"] = {"columns": ["engine", "why it did not run here"],
                             "rows": [[k, v] for k, v in unavailable.items()]}
    tables["targets"] = targets(out, quant_budget(), forms, worker_memory())
    return {"meta": meta, "tables": tables, "engines": out, "unavailable": unavailable, "accuracy": accuracy}


def rejudged(res: dict, command: str) -> dict:
    """A results file's targets table made again from its figures, nothing measured again: a change to how a run
    is judged, applied to that run.  The measurements, the ratios table and the accuracy are kept as they are; meta
    records the command and the date."""
    res["tables"]["targets"] = targets(res["engines"], quant_budget(), (res.get("accuracy") or {}).get("forms", {}),
                                       worker_memory())
    res["meta"]["judged"] = {"command": command, "date": datetime.now(UTC).isoformat(timespec="seconds")}
    return res


def markdown(res: dict) -> str:
    m = res["meta"]
    lines = [f"# Peer benchmark ({m['date']}, {m['machine']}, load {m['load']} -> {m['load_end']})", ""]
    if m.get("judged"):
        lines += [f"Targets judged again by `{m['judged']['command']}`, {m['judged']['date']}.", ""]
    for tid, t in res["tables"].items():
        lines += [f"## {tid}", "", "| " + " | ".join(t["columns"]) + " |", "|" + "---|" * len(t["columns"])]
        lines += ["| " + " | ".join("–" if c is None else str(c) for c in row) + " |" for row in t["rows"]] + [""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = Parser(prog="python -m bench peers", description=__doc__.split("\n\n")[0])
    p.add_argument("--engines", default=",".join(ALL))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--reference-prompts", type=int, default=32,
                   help="prompts whose tokens are checked against transformers' generate() (its time grows with it)")
    p.add_argument("--work", type=Path, default=Path("/tmp/posenc-peers"))
    p.add_argument("--llama-dir", type=Path, default=ROOT / ".venv-peers-llamacpp" / "llama.cpp")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    p.add_argument("--name", default="peers", help="the results' file name in --out (NAME.json, NAME.md)")
    p.add_argument("--no-accuracy", action="store_true",
                   help="skip scoring each form against fp32 on the trained model (bench/peers_accuracy.py)")
    p.add_argument("--rejudge", action="store_true",
                   help="measure nothing: make the targets table of --out/NAME.json again from its figures")
    args = p.parse_args(argv)
    if args.rejudge:
        path = args.out / f"{args.name}.json"
        try:
            res = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            p.exit(2, f"python -m bench peers: error: {path}: {exc}\n")
        command = " ".join(["python -m bench peers", *(sys.argv[1:] if argv is None else argv)])
        res = rejudged(res, command)
        print(write(args.out, args.name, res, markdown(res)))
        return 0
    wanted = [e for e in args.engines.split(",") if e]
    bad = [e for e in wanted if e not in ALL]
    if bad:
        p.exit(2, f"python -m bench peers: error: unknown engine {bad[0]!r}; known: {', '.join(ALL)}\n")
    meta = {"date": datetime.now(UTC).isoformat(timespec="seconds"),
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.node()}", "load": load(),
            "command": " ".join(["python -m bench peers", *(sys.argv[1:] if argv is None else argv)]),
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
    accuracy = None if args.no_accuracy else peers_accuracy.run(wanted, args.work, args.llama_dir, args.out,
                                                                 f"{meta['command']} (its accuracy part)")
    meta["load_end"] = load()
    if shutil.which("nvidia-smi") is None:  # the GPU run (--provider cuda) needs one
        unavailable["gpu (--provider cuda)"] = ("no NVIDIA GPU on this machine (nvidia-smi not found); on one, "
                                                "python -m bench peers-gpu runs the worker with --provider cuda")
    res = summarise(engines, stats, unavailable, meta, accuracy)
    print(write(args.out, args.name, res, markdown(res)))
    return 0

