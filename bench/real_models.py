"""Real-size Hugging Face imports (not part of make test): random-weight models of real sizes built from configs
(GPT2Config() = GPT-2 small, 124M; BLOOM-560m's sizes), saved with save_pretrained, then imported with
`python -m export --from-hf` in a fresh process: import + export + validation wall time and peak RSS, the import
alone's peak RSS per billion parameters, and Predict-shaped latency at 128 tokens (logits + attention maps) in
onnxruntime vs transformers eager.  optimum-onnx's ORTModelForCausalLM is timed when importable.

  python -m bench.real_models [--models gpt2,bloom-560m] [--work /tmp/posenc-real] [--out bench/results]

Benchmarks report; they never assert.  Needs transformers (build requirements) and several GB of memory.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SIZES = {
    "gpt2": ("GPT2Config", {}),  # GPT-2 small defaults: 12 layers, 768 wide, 12 heads, 1024 positions
    "bloom-560m": ("BloomConfig", {"hidden_size": 1024, "n_layer": 24, "n_head": 16, "vocab_size": 250880}),
}
LENGTH = 128


def tokenizer_json(vocab: int = 1000) -> str:
    """A byte-level BPE trained here on CPython's documentation (the real tokenizers need a download)."""
    from pydoc_data.topics import topics

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(list(topics.values()), trainer)
    return tok.to_str()


def make_folder(name: str, folder: Path) -> int:
    """folder <- config.json, model.safetensors, tokenizer.json of a random model of `name`'s size; parameters."""
    import torch
    import transformers as tf

    torch.manual_seed(0)
    cls, kwargs = SIZES[name]
    model = tf.AutoModelForCausalLM.from_config(getattr(tf, cls)(**kwargs))
    model.save_pretrained(folder, safe_serialization=True)
    (folder / "tokenizer.json").write_text(tokenizer_json())
    return sum(p.numel() for p in model.parameters())


def measured(cmd: list[str]) -> dict:
    """Run cmd under /usr/bin/time -v: wall seconds, peak RSS (GB), exit code and the last output lines."""
    start = time.perf_counter()
    res = subprocess.run(["/usr/bin/time", "-v", *cmd], capture_output=True, text=True, cwd=ROOT)
    wall = time.perf_counter() - start
    rss_kb = next((int(line.split(":")[1]) for line in res.stderr.splitlines()
                   if "Maximum resident set size" in line), 0)
    own_err = res.stderr.split("\tCommand being timed")[0]  # what the command printed, before time's report
    tail = [line for line in (res.stdout + own_err).splitlines() if line.strip()][-3:]
    return {"wall_s": round(wall, 1), "peak_rss_gb": round(rss_kb / 1e6, 2), "exit": res.returncode, "tail": tail}


def median_ms(fn, runs: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1000)
    return round(statistics.median(times), 1)


def latencies(folder: Path, artifact: Path, runs: int) -> dict:
    """Median ms of one 128-token forward (batch 1, logits + every attention map) per engine."""
    import numpy as np
    import onnxruntime as ort
    import torch
    import transformers as tf

    torch.set_num_threads(2)
    meta = json.loads((artifact / "model.json").read_text())
    ids = np.random.default_rng(0).integers(0, 1000, (1, LENGTH), dtype=np.int64)
    out = {}
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 2
    opts.log_severity_level = 3
    sess = ort.InferenceSession(str(artifact / "model.onnx"), opts, providers=["CPUExecutionProvider"])
    s = meta["sizes"]
    feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids)}
    feeds.update({st["input"]: np.zeros((1, s["n_kv_heads"], 0, s["head_dim"]), np.float32) for st in meta["state"]})
    out["onnxruntime (posenc artifact)"] = median_ms(lambda: sess.run(["logits", "attentions"], feeds), runs)
    hf = tf.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
    t = torch.from_numpy(ids)
    with torch.inference_mode():
        out["transformers eager, output_attentions"] = median_ms(lambda: hf(t, output_attentions=True), runs)
        out["transformers eager, logits only"] = median_ms(lambda: hf(t), runs)
    try:
        from optimum.onnxruntime import ORTModelForCausalLM  # noqa: F401
        out["optimum ORTModelForCausalLM"] = "importable but not timed here"
    except ImportError as err:
        out["optimum ORTModelForCausalLM"] = (f"unavailable ({err.name or err}): optimum-onnx 0.1.0 requires "
                                             "transformers 4.57, this project pins 5.24")
    return out


def run_one(name: str, work: Path, runs: int) -> dict:
    folder, artifact = work / "hf" / name, work / "artifacts" / name
    folder.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    params = make_folder(name, folder)
    row = {"model": name, "parameters": params, "save_s": round(time.perf_counter() - start, 1)}
    base = measured([sys.executable, "-c", "import model.hf"])  # python + torch + safetensors before any weight
    imp = measured([sys.executable, "-c", IMPORT_ONLY.format(folder=str(folder))])
    over = imp["peak_rss_gb"] - base["peak_rss_gb"]
    row["import_only"] = {**imp, "baseline_rss_gb": base["peak_rss_gb"],
                          "peak_rss_gb_per_billion_params": round(over / (params / 1e9), 2)}
    row["import_export_validate"] = measured([sys.executable, "-m", "export", "--from-hf", str(folder), "--out",
                                              str(artifact), "--force", "--validate-max-length", str(LENGTH)])
    if row["import_export_validate"]["exit"] != 0:  # still time the export and the graph, without validation
        row["import_export_only"] = measured([sys.executable, "-c", EXPORT_ONLY.format(folder=str(folder),
                                                                                         out=str(artifact))])
    if (artifact / "model.onnx").exists():
        row["files_mb"] = {p.name: round(p.stat().st_size / 1e6, 1) for p in sorted(artifact.iterdir())}
        row["latency_ms_128_tokens"] = latencies(folder, artifact, runs)
    return row


# The import alone, in a fresh process: /proc's resident anonymous memory (the model's own copy of the weights) vs
# file-backed pages (the memory-mapped safetensors the kernel may drop) after the import.
IMPORT_ONLY = """
from model.hf import import_folder
m, _ = import_folder({folder!r})
status = dict(l.split(':', 1) for l in open('/proc/self/status'))
print('RssAnon', status['RssAnon'].strip(), 'RssFile', status['RssFile'].strip())
"""
EXPORT_ONLY = """
import json, pathlib, shutil
from export.build import export_onnx
from model.hf import import_folder
out = pathlib.Path({out!r}); shutil.rmtree(out, ignore_errors=True); out.mkdir(parents=True)
m, info = import_folder({folder!r})
spec = export_onnx(m, out / 'model.onnx', 23)
meta = {{'sizes': {{'n_kv_heads': m.cfg.kv_heads, 'head_dim': m.cfg.head_dim}}, 'state': spec['state']}}
(out / 'model.json').write_text(json.dumps(meta))
print('exported without validation')
"""


def markdown(rows: list[dict]) -> str:
    lines = ["| model | params | import only: wall s / peak RSS GB (GB per 1e9 params) | import+export+validate: "
             "wall s / peak RSS GB | latency at 128 tokens (ms) |", "|---|---|---|---|---|"]
    for r in rows:
        imp, full = r["import_only"], r["import_export_validate"]
        lat = "; ".join(f"{k} {v}" for k, v in (r.get("latency_ms_128_tokens") or {}).items())
        status = "" if full["exit"] == 0 else f" (exit {full['exit']}: {' '.join(full['tail'])[:200]})"
        lines.append(f"| {r['model']} | {r['parameters'] / 1e6:.0f}M | {imp['wall_s']} / {imp['peak_rss_gb']} "
                     f"({imp['peak_rss_gb_per_billion_params']}) | {full['wall_s']} / {full['peak_rss_gb']}{status} "
                     f"| {lat} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.real_models", description=__doc__.splitlines()[0])
    p.add_argument("--models", default=",".join(SIZES))
    p.add_argument("--work", default="/tmp/posenc-real")
    p.add_argument("--out", default=str(ROOT / "bench" / "results"))
    p.add_argument("--runs", type=int, default=10)
    args = p.parse_args(argv)
    try:
        import transformers  # noqa: F401
    except ImportError:
        print("bench.real_models: transformers is not installed (requirements/build.txt); skipped", file=sys.stderr)
        return 0
    rows = []
    for name in args.models.split(","):
        rows.append(run_one(name, Path(args.work), args.runs))
        print(json.dumps(rows[-1]), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {"machine": platform.platform(), "python": platform.python_version(), "rows": rows}
    (out / "real_models.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "real_models.md").write_text(markdown(rows))
    print(markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
