"""The prefix cache measured (issue 35 item 3; docs/settings.md): one worker process with the cache, one without
(`--prefix-cache-mb 0`), the same model and requests, over HTTP.

- multiple choice as lm-evaluation-harness's local-completions backend scores it: per choice one
  /v1/completions request of context + choice token ids with echo, max_tokens 0 and logprobs 1, one request at a
  time; each choice's log-likelihood (the sum over its tokens) must be the same on both workers (1e-5, else exit 1),
  and the time of the whole run is compared;
- 32 streams sharing a system prompt: 32 streamed completions at once, each a shared system prompt and a question
  of its own, after one request has served the system prompt; time to each stream's first token.

The model: a LLaMA with random weights (8 layers, 512 wide, 8192 ids), imported with its compact fast graph.

  python -m bench prefix-cache [--work DIR] [--docs N] [--context T] [--out bench/results]
"""

from __future__ import annotations

import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import requests

from bench.lib import worker as launch
from bench.lib.results import write
from model.cli import Parser

ROOT = Path(__file__).resolve().parent.parent
VOCAB = 8192
IDS = 256  # prompts draw ids the tokenizer (a 300-id byte-level BPE) has
TOLERANCE = 1e-5


def build(work: Path) -> Path:
    """The Hugging Face folder, imported with its fast graph (kept in `work`)."""
    art = work / "artifacts" / "llama"
    if (art / "model.json").exists():
        return art.parent
    import torch
    import transformers as tf

    from export.fuse import add_to_artifact
    from export.hf import import_artifact
    from tests.hf.tokenizer_kinds import tokenizer_json

    folder = work / "hf"
    cfg = tf.LlamaConfig(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
                         intermediate_size=1408, vocab_size=VOCAB, max_position_embeddings=2048, rms_norm_eps=1e-6,
                         bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    tf.AutoModelForCausalLM.from_config(cfg).save_pretrained(folder, safe_serialization=True)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(tokenizer_json("bytelevel"))
    tf.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>").save_pretrained(folder)
    import_artifact(folder, art, validation_max_length=16)
    add_to_artifact(art)
    return art.parent


class Worker:
    """The launcher's worker with the prefix cache at `mb` MiB, and an HTTP session to it."""

    def __init__(self, models: Path, mb: float):
        self.worker = launch.Worker(models, "--prefix-cache-mb", str(mb), "--max-prompt-tokens", "2048", http=True)
        self.proc, self.port = self.worker.proc, self.worker.http_port
        self.url, self.http = f"http://127.0.0.1:{self.port}", requests.Session()

    def post(self, body: dict) -> dict:
        r = self.http.post(f"{self.url}/v1/completions", json=body, timeout=300)
        r.raise_for_status()
        return r.json()

    def close(self) -> None:
        self.http.close()
        self.worker.close()


def multiple_choice(worker: Worker, docs: list[tuple[list[int], list[list[int]]]]) -> tuple[float, list[float]]:
    """lm-evaluation-harness's requests, one at a time: seconds, each choice's log-likelihood."""
    out = []
    start = time.perf_counter()
    for context, choices in docs:
        for choice in choices:
            lps = worker.post({"model": "llama", "prompt": context + choice, "max_tokens": 0, "echo": True,
                               "logprobs": 1})["choices"][0]["logprobs"]["token_logprobs"]
            out.append(float(sum(lps[len(context):])))
    return time.perf_counter() - start, out


def first_tokens(worker: Worker, system: list[int], questions: list[list[int]]) -> list[float]:
    """32 streams at once on a served system prompt: each one's seconds to its first token."""
    worker.post({"model": "llama", "prompt": system + questions[0][:1], "max_tokens": 1})
    ttft = [0.0] * len(questions)
    go = threading.Barrier(len(questions))

    def one(i: int) -> None:
        body = {"model": "llama", "prompt": system + questions[i], "max_tokens": 8, "stream": True,
                "temperature": 0, "ignore_eos": True}
        with requests.Session() as client:
            go.wait()
            start = time.perf_counter()
            with client.post(f"{worker.url}/v1/completions", json=body, stream=True, timeout=300) as r:
                for line in r.iter_lines():
                    if line.startswith(b"data: ") and ttft[i] == 0.0:
                        ttft[i] = time.perf_counter() - start
    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(questions))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return ttft


def main(argv: list[str] | None = None) -> int:
    p = Parser(prog="python -m bench prefix-cache", description=__doc__.split("\n\n")[0])
    p.add_argument("--work", type=Path, default=None, help="folder for the model (kept between runs)")
    p.add_argument("--docs", type=int, default=24, help="multiple-choice documents (4 choices each)")
    p.add_argument("--context", type=int, default=384, help="tokens of each document's context")
    p.add_argument("--system", type=int, default=512, help="tokens of the 32 streams' system prompt")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    a = p.parse_args(argv)
    if a.docs < 1 or a.context < 1 or a.system < 1:
        p.error("--docs, --context and --system must be >= 1")
    work = a.work or Path(tempfile.mkdtemp(prefix="prefix-cache-"))
    models = build(work)
    rng = np.random.default_rng(0)
    docs = [(rng.integers(3, IDS, a.context).tolist(), [rng.integers(3, IDS, n).tolist() for n in (3, 5, 4, 6)])
            for _ in range(a.docs)]
    system = rng.integers(3, IDS, a.system).tolist()
    questions = [rng.integers(3, IDS, 16).tolist() for _ in range(32)]
    runs = {}
    for name, mb in (("off", 0), ("on", 128)):
        worker = Worker(models, mb)
        try:
            multiple_choice(worker, docs[:1])  # warm: the sessions' first calls
            seconds, lls = multiple_choice(worker, docs[1:])
            ttft = first_tokens(worker, system, questions)
        finally:
            worker.close()
        runs[name] = {"seconds": seconds, "lls": lls, "ttft": ttft}
    worst = max(abs(x - y) for x, y in zip(runs["off"]["lls"], runs["on"]["lls"], strict=True))
    ratio = runs["off"]["seconds"] / runs["on"]["seconds"]
    med = {k: statistics.median(v["ttft"]) * 1000 for k, v in runs.items()}
    p90 = {k: float(np.percentile(v["ttft"], 90)) * 1000 for k, v in runs.items()}
    rows = [["multiple choice, echo + logprobs (s)", round(runs["off"]["seconds"], 2), round(runs["on"]["seconds"], 2),
             round(ratio, 2)],
            ["32 streams' first token, median (ms)", round(med["off"], 1), round(med["on"], 1),
             round(med["off"] / med["on"], 2)],
            ["32 streams' first token, p90 (ms)", round(p90["off"], 1), round(p90["on"], 1),
             round(p90["off"] / p90["on"], 2)]]
    args = sys.argv[1:] if argv is None else argv
    command = " ".join(["python -m bench prefix-cache", *args])
    doc = {"meta": {"date": datetime.now(UTC).isoformat(timespec="seconds"),
                    "machine": f"{platform.machine()} {os.cpu_count()} CPUs, Python {platform.python_version()}",
                    "load": list(os.getloadavg()), "command": command},
           "mc": {"requests": len(runs["on"]["lls"]), "context": a.context, "ratio": ratio, "max_abs_diff": worst},
           "ttft": {"system": a.system, "streams": 32, "median_ms": med, "p90_ms": p90},
           "tables": {"prefix_cache": {"columns": ["run", "cache off", "cache on", "speed-up"], "rows": rows,
                                       "note": f"{a.docs - 1} documents of a {a.context}-token context and 4 "
                                               f"choices; a {a.system}-token system prompt"}}}
    print(write(a.out, "prefix_cache", doc))
    print(f"largest log-likelihood difference: {worst:.2e}")
    if worst > TOLERANCE:
        print(f"log-likelihoods differ by {worst:.2e} (over {TOLERANCE})", file=sys.stderr)
        return 1
    return 0

