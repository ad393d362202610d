"""make compat: a real client in the loop.  lm-evaluation-harness (its own virtualenv, .venv-compat) evaluates the
same tiny imported models twice: its `hf` backend on the Hugging Face folder (transformers) and its
`local-completions` backend on a posenc worker serving the imported artifact (OpenAI completions over loopback).
Three tasks made from local text: multiple choice (log-likelihoods), rolling perplexity (loglikelihood_rolling
over several windows) and generate-until (greedy, with five stop strings and the end of sequence).  Fails (exit
1) when any per-request log-likelihood differs by more than 1e-3 or any greedy generation differs.

  python -m bench compat [--compat-python .venv-compat/bin/python] [--work DIR] [--out bench/results]
  python -m bench compat --prefix [--work DIR]   the prefix cache off and on under one multiple-choice run
                                                 (bench/results/compat_prefix.json; docs/settings.md)

lm-evaluation-harness's hf backend decodes a generation's tokens alone, so a SentencePiece-style tokenizer drops the
space before its first word there; posenc (like vLLM) returns the text the whole sequence decodes to, with that
space.  Generations that differ only so are counted apart and do not fail the run.

Models: GPT-2 with a ByteLevel BPE, LLaMA with a ByteLevel BPE, LLaMA with a SentencePiece-style tokenizer
(Metaspace spaces, byte fallback), random weights, built by the compat virtualenv's transformers (the version
lm-evaluation-harness runs on) and imported by posenc's exporter.  Results: bench/results/compat.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.lib.worker import Worker, free_port
from model.cli import Parser

ROOT = Path(__file__).resolve().parent.parent
MODELS = {"gpt2-bytelevel": ("gpt2", "bytelevel"), "llama-bytelevel": ("llama", "bytelevel"),
          "llama-sentencepiece": ("llama", "sentencepiece")}
TASKS = ["posenc_mc", "posenc_rolling", "posenc_until"]
MAX_LENGTH = 96  # hf backend's window: rolling perplexity spans several windows; local-completions gets +2
TOLERANCE = 1e-3
UNTIL = ["\n\n", ". ", "Question:", "def ", "#"]  # five stop strings, as humaneval sends (plus the EOS string)


# --- runs inside .venv-compat: build the Hugging Face folders -------------------------------------------------

def build(work: Path) -> None:
    sys.path.insert(0, str(ROOT))
    from tests.hf.tokenizer_kinds import save_model

    for name, (family, kind) in MODELS.items():
        save_model(family, kind, work / "hf" / name, seed=11)


# --- the tasks ------------------------------------------------------------------------------------------------

def texts() -> list[str]:
    from pydoc_data.topics import topics

    paragraphs = [p.strip() for t in list(topics.values())[:60] for p in t.split("\n\n")]
    return [" ".join(p.split()) for p in paragraphs if 200 < len(p) < 600]


def write_tasks(folder: Path) -> None:
    """Three lm-evaluation-harness task YAMLs over JSON-lines files made from CPython's documentation text."""
    folder.mkdir(parents=True, exist_ok=True)
    paras = texts()
    mc, rolling, until = [], [], []
    for i, p in enumerate(paras[:24]):
        words = p.split()
        others = [paras[(i + k) % len(paras)].split() for k in (5, 11, 17)]
        choices = [" ".join(words[8:14])] + [" ".join(o[8:14]) for o in others]
        mc.append({"question": " ".join(words[:8]), "choices": choices, "answer": 0})
        # short (under 40 characters): both backends cut a longer context to max_length - max_gen_toks, each by its
        # own arithmetic, and would then see different prompts
        head = next((" ".join(words[:k]) for k in range(4, 0, -1) if len(" ".join(words[:k])) <= 32), words[0][:32])
        until.append({"prompt": "中文 " + head, "target": " ".join(words[4:8])})
    rolling = [{"text": p} for p in paras[24:36]]
    for name, rows in (("mc", mc), ("rolling", rolling), ("until", until)):
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))

    def data(name: str) -> str:
        return (f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {folder / name}.jsonl\n"
                "test_split: test\n")

    (folder / "posenc_mc.yaml").write_text(
        "task: posenc_mc\n" + data("mc") + "output_type: multiple_choice\ndoc_to_text: '{{question}}'\n"
        "doc_to_choice: '{{choices}}'\ndoc_to_target: '{{answer}}'\ntarget_delimiter: ' '\n"
        "metric_list:\n  - metric: acc\n")
    (folder / "posenc_rolling.yaml").write_text(
        "task: posenc_rolling\n" + data("rolling") + "output_type: loglikelihood_rolling\ndoc_to_text: ''\n"
        "doc_to_target: '{{text}}'\nmetric_list:\n  - metric: word_perplexity\n  - metric: bits_per_byte\n")
    (folder / "posenc_until.yaml").write_text(
        "task: posenc_until\n" + data("until") + "output_type: generate_until\ndoc_to_text: '{{prompt}}'\n"
        "doc_to_target: '{{target}}'\ngeneration_kwargs:\n  until: " + json.dumps(UNTIL) + "\n"
        "  do_sample: false\n  max_gen_toks: 24\nmetric_list:\n  - metric: exact_match\n")


# --- the two backends -----------------------------------------------------------------------------------------

def lm_eval(python: str, model: str, model_args: str, tasks: Path, out: Path, *extra: str,
            names: list[str] = TASKS) -> None:
    cmd = [python, "-m", "lm_eval", "--model", model, "--model_args", model_args, "--tasks", ",".join(names),
           "--include_path", str(tasks), "--log_samples", "--output_path", str(out), "--batch_size", "1",
           "--seed", "1234", *extra]
    env = os.environ | {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"lm_eval --model {model} failed:\n{done.stderr[-4000:]}")


def samples(out: Path, names: list[str] = TASKS) -> dict[str, dict[int, list]]:
    """task -> doc_id -> the per-request answers lm-evaluation-harness logged (resps)."""
    found: dict[str, dict[int, list]] = {}
    for path in out.rglob("samples_*.jsonl"):
        task = next(t for t in names if path.name.startswith(f"samples_{t}_"))
        for line in path.read_text().splitlines():
            row = json.loads(line)
            found.setdefault(task, {})[row["doc_id"]] = [r[0] for r in row["resps"]]
    return found


def compare(hf: dict, served: dict) -> dict:
    """Per task: requests compared, the largest log-likelihood difference, generations that differ."""
    report = {}
    for task in TASKS:
        a, b = hf.get(task, {}), served.get(task, {})
        if set(a) != set(b) or not a:
            raise RuntimeError(f"{task}: the backends logged different documents ({len(a)} vs {len(b)})")
        worst, differ, spaced, n, example = 0.0, 0, 0, 0, None
        for doc in sorted(a):
            for x, y in zip(a[doc], b[doc], strict=True):
                n += 1
                if task == "posenc_until":
                    if x != y and y.startswith(" ") and x == y[1:]:
                        spaced += 1  # the hf backend decodes the continuation alone: SentencePiece drops its space
                    elif x != y:
                        differ += 1
                        example = example or {"doc": doc, "hf": x, "posenc": y}
                else:
                    lx = x[0] if isinstance(x, list) else x
                    ly = y[0] if isinstance(y, list) else y
                    worst = max(worst, abs(float(lx) - float(ly)))
        report[task] = {"requests": n, "max_abs_diff": worst, "generations_differing": differ,
                        "first_space_only": spaced, "example": example}
    return report


def run(compat_python: str, work: Path, out: Path, command: str = "make compat") -> int:
    from export.hf import import_artifact

    art = work / "artifacts"
    if not all((work / "hf" / name / "config.json").exists() for name in MODELS):  # a --work folder keeps them
        subprocess.run([compat_python, "-m", "bench", "compat", "--build", str(work)], cwd=ROOT, check=True)
    for name in MODELS:
        if not (art / name / "manifest.json").exists():
            import_artifact(work / "hf" / name, art / name, validation_max_length=16)
    write_tasks(work / "tasks")
    worker = Worker(art, http=True)
    port = worker.http_port
    results = {}
    try:
        for name in MODELS:
            folder = work / "hf" / name
            hf_out, served_out = work / "out" / name / "hf", work / "out" / name / "posenc"
            shutil.rmtree(served_out, ignore_errors=True)
            if not list(hf_out.rglob("samples_*.jsonl")):  # transformers' side of a kept --work folder stands
                lm_eval(compat_python, "hf", f"pretrained={folder},dtype=float32,max_length={MAX_LENGTH}",
                        work / "tasks", hf_out, "--device", "cpu")
            lm_eval(compat_python, "local-completions",
                    f"model={name},base_url=http://127.0.0.1:{port}/v1/completions,tokenizer={folder},"
                    f"tokenizer_backend=huggingface,tokenized_requests=True,max_length={MAX_LENGTH + 2},"
                    "num_concurrent=1,max_retries=1,timeout=120", work / "tasks", served_out)
            results[name] = compare(samples(hf_out), samples(served_out))
    finally:
        worker.close()
    ok = all(t["max_abs_diff"] <= TOLERANCE and t["generations_differing"] == 0
             for r in results.values() for t in r.values())
    versions = subprocess.run([compat_python, "-c", "import importlib.metadata as m; print(', '.join(f'{p} "
                               "{m.version(p)}' for p in ('lm-eval', 'transformers', 'torch')))"],
                              capture_output=True, text=True).stdout.strip()
    write_results(out, results, ok, versions, command)
    return 0 if ok else 1


def write_results(out: Path, results: dict, ok: bool, versions: str, command: str) -> None:
    rows = [[name, task, r["requests"], f"{r['max_abs_diff']:.2e}", r["generations_differing"], r["first_space_only"],
             "yes" if r["max_abs_diff"] <= TOLERANCE and r["generations_differing"] == 0 else "NO"]
            for name, tasks in results.items() for task, r in tasks.items()]
    doc = {"meta": {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                    "machine": f"{os.cpu_count()} CPUs ({platform.processor() or platform.machine()}), Python "
                               f"{platform.python_version()}; {versions}",
                    "load": list(os.getloadavg()), "command": command},
           "tables": {"agreement": {"columns": ["model", "task", "requests",
                                                "largest log-likelihood difference (absolute)",
                                                "greedy generations differing",
                                                "differing only by the hf backend's dropped first space", "agrees"],
                                    "rows": rows}},
           "passed": ok, "tolerance": TOLERANCE, "results": results}
    out.mkdir(parents=True, exist_ok=True)
    md = ["# make compat: lm-evaluation-harness, hf backend vs local-completions on posenc", "",
          "| " + " | ".join(doc["tables"]["agreement"]["columns"]) + " |",
          "|" + "---|" * len(doc["tables"]["agreement"]["columns"])]
    md += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    md += ["", f"{'passed' if ok else 'FAILED'} (tolerance {TOLERANCE} on log-likelihoods; generations exact); "
               f"{doc['meta']['date']}, load {doc['meta']['load']}"]
    for name, text in (("compat.json", json.dumps(doc, indent=2, ensure_ascii=False)), ("compat.md", "\n".join(md))):
        tmp = out / f".{name}.tmp"
        tmp.write_text(text + "\n")
        os.replace(tmp, out / name)
    print("\n".join(md))


# --- the prefix cache under lm-evaluation-harness (docs/settings.md) -------------------------------------------

PREFIX_TASK = "posenc_mc_context"


def prefix_tasks(folder: Path) -> None:
    """Multiple choice over a long shared context: four paragraphs, then four six-word choices."""
    folder.mkdir(parents=True, exist_ok=True)
    paras = texts()
    rows = []
    for i in range(24):
        words = paras[(i + 1) % len(paras)].split()
        context = " ".join(paras[(i + k) % len(paras)] for k in (2, 3))[:900] + " " + " ".join(words[:8])
        choices = [" ".join(words[8:14])] + [" ".join(paras[(i + k) % len(paras)].split()[8:14]) for k in (5, 11, 17)]
        rows.append({"question": context, "choices": choices, "answer": 0})
    (folder / "mc_context.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / f"{PREFIX_TASK}.yaml").write_text(
        f"task: {PREFIX_TASK}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: "
        f"{folder / 'mc_context'}.jsonl\ntest_split: test\noutput_type: multiple_choice\n"
        "doc_to_text: '{{question}}'\ndoc_to_choice: '{{choices}}'\ndoc_to_target: '{{answer}}'\n"
        "target_delimiter: ' '\nmetric_list:\n  - metric: acc\n")


def prefix_run(compat_python: str, work: Path, out: Path, command: str) -> int:
    """The same lm-evaluation-harness multiple-choice run through /v1/completions against a worker without the
    prefix cache and one with it: the same log-likelihoods (1e-5), and the seconds the worker spent answering
    (its own /v1/completions latency histogram's sum) and the whole run's."""
    import urllib.request

    from bench.lib.results import write
    from bench.prefix_cache import build

    models = build(work / "model")
    prefix_tasks(work / "tasks")
    tokenizer = work / "tokenizer"  # the tokenizer alone, as the compat virtualenv's transformers reads it
    tokenizer.mkdir(exist_ok=True)
    shutil.copy(work / "model" / "hf" / "tokenizer.json", tokenizer / "tokenizer.json")
    (tokenizer / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast",
                                                                 "eos_token": "<|endoftext|>"}))
    runs = {}
    for mb in (0, 128):
        metrics = free_port()
        worker = Worker(models, "--metrics-port", str(metrics), "--prefix-cache-mb", str(mb), "--max-prompt-tokens",
                        "2048", http=True)
        port = worker.http_port
        served = work / "out" / f"mb{mb}"
        shutil.rmtree(served, ignore_errors=True)
        try:
            begun = time.perf_counter()
            lm_eval(compat_python, "local-completions",
                    f"model=llama,base_url=http://127.0.0.1:{port}/v1/completions,tokenizer={tokenizer},"
                    "tokenizer_backend=huggingface,tokenized_requests=True,max_length=2048,num_concurrent=1,"
                    "max_retries=1,timeout=300", work / "tasks", served, names=[PREFIX_TASK])
            wall = time.perf_counter() - begun
            body = urllib.request.urlopen(f"http://127.0.0.1:{metrics}/metrics", timeout=30).read().decode()
        finally:
            worker.close()
        served_s = sum(float(line.rsplit(" ", 1)[1]) for line in body.splitlines()
                       if line.startswith("posenc_http_request_seconds_sum") and "/v1/completions" in line)
        runs[mb] = {"wall_s": wall, "served_s": served_s, "answers": samples(served, [PREFIX_TASK])[PREFIX_TASK]}
    a, b = runs[0]["answers"], runs[128]["answers"]
    lls = [(float(x[0]), float(y[0])) for d in sorted(a) for x, y in zip(a[d], b[d], strict=True)]
    worst = max(abs(x - y) for x, y in lls)
    ratio = runs[0]["served_s"] / runs[128]["served_s"]
    doc = {"meta": {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                    "machine": f"{os.cpu_count()} CPUs, Python {platform.python_version()}",
                    "load": list(os.getloadavg()), "command": command},
           "requests": len(lls), "max_abs_diff": worst, "ratio": ratio,
           "tables": {"lm_eval": {"columns": ["prefix cache", "requests", "worker's seconds answering",
                                              "lm_eval's whole run (s)"],
                                  "rows": [["off", len(lls), round(runs[0]["served_s"], 2),
                                            round(runs[0]["wall_s"], 1)],
                                           ["on (128 MiB)", len(lls), round(runs[128]["served_s"], 2),
                                            round(runs[128]["wall_s"], 1)]],
                                  "note": f"{PREFIX_TASK}: 24 documents, 4 choices sharing a ~900-character "
                                          f"context; log-likelihoods differ by at most {worst:.1e}"}}}
    write(out, "compat_prefix", doc)
    print(f"{len(lls)} requests, worker seconds {runs[0]['served_s']:.2f} off, {runs[128]['served_s']:.2f} on: "
          f"{ratio:.2f}x; largest log-likelihood difference {worst:.1e}")
    return 0 if worst <= 1e-5 else 1


def main(argv: list[str] | None = None) -> int:
    p = Parser(prog="python -m bench compat", description=__doc__.splitlines()[0])
    p.add_argument("--compat-python", default=str(ROOT / ".venv-compat" / "bin" / "python"))
    p.add_argument("--work", help="working folder (default: a temporary one, removed after)")
    p.add_argument("--out", default=str(ROOT / "bench" / "results"))
    p.add_argument("--build", help=argparse.SUPPRESS)  # inside .venv-compat: build the folders there
    p.add_argument("--prefix", action="store_true", help="time a multiple-choice run with the prefix cache off and "
                                                         "on instead (bench/results/compat_prefix.json)")
    args = p.parse_args(argv)
    if args.build:
        build(Path(args.build))
        return 0
    if not Path(args.compat_python).exists():
        print(f"python -m bench compat: {args.compat_python} does not exist (make compat creates it)",
              file=sys.stderr)
        return 2
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="posenc-compat-"))
    try:
        command = "make compat" if not args.work else "python -m bench compat " + " ".join(
            argv if argv is not None else sys.argv[1:])
        if args.prefix:
            return prefix_run(args.compat_python, work, Path(args.out), command)
        return run(args.compat_python, work, Path(args.out), command)
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)

