"""Each engine's 8-bit and 4-bit forms against fp32, on a model trained here (`python -m bench peers-accuracy`;
bench/peers.py runs it for the engines it measures, so every quantized row states its accuracy).

The model is bench/peers_trained.py's LLaMA; every form is made from it by the same tools and options as the
speed rows' forms of the peer model (bench/peers_prepare.py), and scored by its own engine's runtime on held-out
windows of its tokenizer's ids:
  posenc              the graph the worker serves (fast.onnx) in onnxruntime: fp32, and `export quantize`'s copies
  onnxruntime-genai   a Generator given the whole window, its logits output (bench/peers_score_side.py)
  OpenVINO            the exported IR's infer request (bench/peers_score_side.py)
  llama.cpp           llama-server /completion for every prefix of a window, one new token with the top 512
                      log-probabilities (the whole vocabulary) before sampling
The reference is transformers' fp32 forward of the folder.  Per form: top-1 agreement (the share of positions whose
most likely next token is the reference's) and nats per byte of the held-out text, and its ratio to the
reference's.  A form that cannot be made or scored here is listed with the error.

  python -m bench peers-accuracy [--forms posenc-int8,llamacpp-q8,...] [--work /tmp/posenc-peers]
"""

from __future__ import annotations

import http.client
import json
import os
import platform
import subprocess
import sys
import tempfile
from datetime import UTC, datetime
from pathlib import Path

import numpy as np

from bench import peers_prepare as prep
from bench.lib.results import write
from bench.lib.worker import free_port, http_ok, wait_ready
from bench.peers_trained import CONTEXT, VOCAB, make_trained
from model.cli import Parser

ROOT = Path(__file__).resolve().parent.parent
WINDOWS, THREADS = 8, 2
# bench.peers engine key -> (form, how it is made): the same keys as the speed rows
FORMS = {"posenc": "posenc fp32 (fast.onnx)", "posenc-int8": "posenc int8 (MatMulNBits, export quantize)",
         "posenc-int8-dynamic": "posenc int8 dynamic (MatMulInteger, export quantize)",
         "posenc-int4": "posenc int4 (MatMulNBits, export quantize)",
         "ortgenai": "onnxruntime-genai fp32", "ortgenai-int8": "onnxruntime-genai int8 (builder -p int8)",
         "ortgenai-int4": "onnxruntime-genai int4 (builder -p int4)", "openvino": "OpenVINO fp32",
         "openvino-int8": "OpenVINO int8 (optimum-intel --weight-format int8)", "llamacpp": "llama.cpp f32",
         "llamacpp-q8": "llama.cpp q8_0", "llamacpp-q4km": "llama.cpp Q4_K_M (llama-quantize)"}
POSENC_METHODS = {"posenc-int8": "int8", "posenc-int8-dynamic": "dynamic", "posenc-int4": "int4"}


def venv_python(name: str) -> str:
    return str(ROOT / f".venv-peers-{name}" / "bin" / "python")


def windows(folder: Path, count: int = WINDOWS, length: int = CONTEXT) -> tuple[list[list[int]], int]:
    """count consecutive windows of held-out token ids, and the UTF-8 bytes their scored tokens (all but each
    window's first) decode to."""
    from tokenizers import Tokenizer

    from model.corpus import heldout_bytes

    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    ids = tok.encode(bytes(heldout_bytes(None)).decode("utf-8", errors="replace"), add_special_tokens=False).ids
    out = [ids[i * length:(i + 1) * length] for i in range(count)]
    return out, sum(len(tok.decode(w[1:]).encode()) for w in out)


def from_logits(logits: np.ndarray, window: list[int]) -> tuple[list[int], list[float]]:
    x = logits.astype(np.float64)
    lp = x - x.max(-1, keepdims=True)
    lp -= np.log(np.exp(lp).sum(-1, keepdims=True))
    return lp[:-1].argmax(-1).tolist(), lp[np.arange(len(window) - 1), window[1:]].tolist()


def reference(folder: Path, wins: list[list[int]]) -> dict:
    import torch
    import transformers as tf

    torch.set_num_threads(THREADS)
    model = tf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    top1, logp = [], []
    with torch.inference_mode():
        for w in wins:
            t, lp = from_logits(model(torch.tensor([w])).logits[0].numpy(), w)
            top1.append(t)
            logp.append(lp)
    return {"top1": top1, "logp": logp}


def posenc(art: Path, wins: list[list[int]]) -> dict:
    """The served graph (fast.onnx where the artifact has one) in onnxruntime, every position's logits."""
    import onnxruntime as ort

    meta = json.loads((art / "model.json").read_text())
    graph = (meta.get("fast") or {}).get("file") or "model.onnx"
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = THREADS
    sess = ort.InferenceSession(str(art / graph), opts, providers=["CPUExecutionProvider"])
    names = {i.name for i in sess.get_inputs()}
    top1, logp = [], []
    for w in wins:
        n = len(w)
        feeds = {"input_ids": np.asarray([w], np.int64), "attention_mask": np.ones((1, n), np.int64)}
        for i in sess.get_inputs():
            if i.name.startswith("past"):
                feeds[i.name] = np.zeros((1, i.shape[1], 0, i.shape[3]), np.float32)
        if "logits_positions" in names:
            feeds["logits_positions"] = np.arange(n, dtype=np.int64)[None]
        if "seqlens_k" in names:
            feeds["seqlens_k"], feeds["total_sequence_length"] = np.array([n - 1], np.int32), np.array(n, np.int32)
        t, lp = from_logits(sess.run(["logits"], feeds)[0][0], w)
        top1.append(t)
        logp.append(lp)
    return {"top1": top1, "logp": logp, "graph": graph}


def side(engine: str, model: Path, wins: list[list[int]], log: Path) -> dict:
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(wins, f)
    try:
        with open(log, "w") as err:
            res = subprocess.run([venv_python(engine), "-P", str(ROOT / "bench" / "peers_score_side.py"),
                                  "--engine", engine, "--model", str(model), "--windows", f.name,
                                  "--threads", str(THREADS)], cwd=ROOT, stdout=subprocess.PIPE, stderr=err,
                                 text=True, timeout=3600)
    finally:
        os.unlink(f.name)
    if res.returncode != 0:
        lines = [t for t in log.read_text(errors="replace").splitlines() if t.strip()]
        raise RuntimeError(f"{engine} scoring failed (exit {res.returncode}): {' | '.join(lines[-3:])[-600:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def llamacpp(server: Path, gguf: Path, wins: list[list[int]], log: Path) -> dict:
    """llama-server, one slot: each prefix of a window asks for one greedy token with the top VOCAB log-probabilities
    before sampling (the prefix before it is reused from the slot's cache).  --no-repack: this llama.cpp's CPU weight
    repacking crashes (SIGSEGV) while loading the trained model's q8_0 and Q4_K_M files (the peer model's load
    and are repacked in the speed rows); the blocks keep their format, in the layout they were written in."""
    port = free_port()
    with open(log, "w") as out:
        proc = subprocess.Popen([str(server), "-m", str(gguf), "--port", str(port), "--host", "127.0.0.1", "-np", "1",
                                 "-c", str(2 * CONTEXT), "-t", str(THREADS), "-tb", str(THREADS), "--no-webui",
                                 "--no-repack"], stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_ready(proc, http_ok(port, "/health"), 300, "llama-server", log, every=0.5)
        top1, logp = [], []
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        for w in wins:
            t_row, lp_row = [], []
            for p in range(len(w) - 1):
                body = {"prompt": w[:p + 1], "n_predict": 1, "n_probs": VOCAB, "temperature": 0,
                        "cache_prompt": True}
                c.request("POST", "/completion", body=json.dumps(body), headers={"content-type": "application/json"})
                r = c.getresponse()
                ans = json.loads(r.read())
                if r.status != 200:
                    raise RuntimeError(f"llama-server: HTTP {r.status}: {str(ans)[:300]}")
                probs = {q["id"]: q["logprob"] for q in ans["completion_probabilities"][0]["top_logprobs"]}
                if w[p + 1] not in probs:
                    raise RuntimeError(f"llama-server answered {len(probs)} of {VOCAB} log-probabilities")
                t_row.append(max(probs, key=probs.get))
                lp_row.append(float(probs[w[p + 1]]))
            top1.append(t_row)
            logp.append(lp_row)
        return {"top1": top1, "logp": logp}
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def score(key: str, folder: Path, work: Path, llama_dir: Path, wins: list[list[int]]) -> dict:
    """One form made (or reused) under work and scored by its own engine."""
    if key.startswith("posenc"):
        art = prep.posenc_artifact(folder, work, "trained")
        if key in POSENC_METHODS:
            art = prep.posenc_quantized(art, work, POSENC_METHODS[key])
        return posenc(art, wins)
    if key.startswith("ortgenai"):
        precision = key.partition("-")[2] or "fp32"
        return side("ortgenai", prep.ortgenai_model(venv_python("ortgenai"), folder, work, precision), wins,
                    work / f"score-{key}.log")
    if key.startswith("openvino"):
        weights = key.partition("-")[2] or "fp32"
        return side("openvino", prep.openvino_model(venv_python("openvino"), folder, work, weights), wins,
                    work / f"score-{key}.log")
    kind = {"llamacpp": "f32", "llamacpp-q8": "q8_0", "llamacpp-q4km": "Q4_K_M"}[key]
    server = llama_dir / "build" / "bin" / "llama-server"
    if not server.is_file():
        raise RuntimeError(f"{server} was not built (make bench-peers builds it)")
    gguf = prep.gguf_model(venv_python("llamacpp"), llama_dir / "src", folder, work, kind)
    return llamacpp(server, gguf, wins, work / f"score-{key}.log")


def figures(ref: dict, got: dict, nbytes: int) -> dict:
    a, b = np.concatenate([np.asarray(r) for r in ref["top1"]]), np.concatenate([np.asarray(r) for r in got["top1"]])
    nats_ref = -sum(map(sum, ref["logp"])) / nbytes
    nats = -sum(map(sum, got["logp"])) / nbytes
    return {"top1_agreement": round(float((a == b).mean()), 4), "nats_per_byte": round(nats, 4),
            "nats_per_byte_fp32": round(nats_ref, 4), "nats_ratio": round(nats / nats_ref, 4), "positions": len(a)}


def measure(keys: list[str], work: Path, llama_dir: Path, steps: int | None = None) -> dict:
    """{"model": the trained model's stamp, "forms": {key: figures or {"error": text}}} for the keys of FORMS."""
    work = work / "trained"
    folder = work / "hf"
    work.mkdir(parents=True, exist_ok=True)
    print("accuracy: the trained model ...", flush=True)
    stamp = make_trained(folder, **({"steps": steps} if steps else {}))
    wins, nbytes = windows(folder)
    ref = reference(folder, wins)
    forms: dict = {}
    for key in (k for k in keys if k in FORMS):
        print(f"accuracy: {key} ...", flush=True)
        try:
            forms[key] = {"form": FORMS[key], **figures(ref, score(key, folder, work, llama_dir, wins), nbytes),
                          "date": datetime.now(UTC).isoformat(timespec="seconds")}
        except Exception as exc:  # noqa: BLE001 — the reason goes into the results
            forms[key] = {"form": FORMS[key], "error": f"{type(exc).__name__}: {exc}"[:600]}
        print(f"  {forms[key]}", flush=True)
    return {"model": stamp, "windows": len(wins), "bytes": nbytes, "forms": forms}


def table(acc: dict) -> dict:
    rows = [[k, f["form"], f.get("top1_agreement"), f.get("nats_per_byte"), f.get("nats_per_byte_fp32"),
             None if "nats_ratio" not in f else f"x{f['nats_ratio']:.3f}", f.get("error")]
            for k, f in acc["forms"].items()]
    return {"columns": ["engine", "form", "top-1 agreement with fp32", "nats/byte", "nats/byte fp32 (transformers)",
                        "ratio", "not scored because"], "rows": rows}


def run(keys: list[str], work: Path, llama_dir: Path, out: Path, command: str, steps: int | None = None) -> dict:
    """measure() written to out/peers_accuracy.{json,md} in the results convention; returns the measurement."""
    meta = {"date": datetime.now(UTC).isoformat(timespec="seconds"),
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.node()}",
            "load": [round(x, 2) for x in os.getloadavg()], "command": command}
    acc = measure(keys, work, llama_dir, steps)
    meta["load_end"] = [round(x, 2) for x in os.getloadavg()]
    try:  # forms scored before on the same trained model and windows, not scored again now, are kept
        old = json.loads((out / "peers_accuracy.json").read_text())
    except (OSError, ValueError):
        old = {}
    kept = {k: f for k, f in old.get("forms", {}).items() if k not in acc["forms"]}
    if kept and old.get("model") == acc["model"] and old.get("bytes") == acc["bytes"]:
        acc["forms"] = {**kept, **acc["forms"]}
        meta["command"] += f" ({', '.join(kept)} kept from `{old['meta']['command']}`, {old['meta']['date']})"
    print(write(out, "peers_accuracy", {"meta": meta, **acc, "tables": {"accuracy": table(acc)}}))
    return acc


def main(argv: list[str] | None = None) -> int:
    p = Parser(prog="python -m bench peers-accuracy", description=__doc__.split("\n\n")[0])
    p.add_argument("--forms", default=",".join(FORMS))
    p.add_argument("--work", type=Path, default=Path("/tmp/posenc-peers"))
    p.add_argument("--llama-dir", type=Path, default=ROOT / ".venv-peers-llamacpp" / "llama.cpp")
    p.add_argument("--steps", type=int, default=None, help="training steps of the trained model (default: its own)")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = p.parse_args(argv)
    keys = [k for k in args.forms.split(",") if k]
    if bad := [k for k in keys if k not in FORMS]:
        p.exit(2, f"python -m bench peers-accuracy: error: unknown form {bad[0]!r}; known: {', '.join(FORMS)}\n")
    run(keys, args.work, args.llama_dir, args.out,
        " ".join(["python -m bench peers-accuracy", *(sys.argv[1:] if argv is None else argv)]), args.steps)
    return 0

