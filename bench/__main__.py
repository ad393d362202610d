"""posenc's benchmarks, one command line: `python -m bench NAME [options]`; `python -m bench` lists the commands and
`python -m bench NAME --help` gives a command's options.  Each command is a module of bench/ with `main(argv)`; it
is imported only when run, so listing loads none of the engines the benchmarks measure.  Every results file goes
through bench/lib/results.py and every worker a benchmark starts through bench/lib/worker.py."""

from __future__ import annotations

import argparse
import importlib
import sys

from model.cli import Parser

# name -> (module, what it measures).  The Makefile's targets name the same commands.
COMMANDS: dict[str, tuple[str, str]] = {
    "run": ("bench.run", "make bench: onnxruntime against PyTorch, serving overhead, batching, generation, footprint"),
    "real-models": ("bench.real_models", "make bench-real: real-size imports against transformers and Optimum"),
    "compat": ("bench.compat", "make compat: lm-evaluation-harness against a posenc worker"),
    "peers": ("bench.peers", "make bench-peers: posenc against onnxruntime-genai, OpenVINO, vLLM and llama.cpp"),
    "peers-accuracy": ("bench.peers_accuracy", "each peer's 8-bit and 4-bit forms against fp32"),
    "peers-gpu": ("bench.peers_gpu", "the worker with onnxruntime's CUDA provider on the peer model"),
    "peers-profile": ("bench.peers_profile", "where one decode step of the peer model goes"),
    "peers-quant": ("bench.peers_quant", "the quantized copies' accuracy and speed"),
    "worker-memory": ("bench.worker_memory", "where the worker's memory goes at 32 streams on the peer model"),
    "gpu-carry": ("bench.gpu_carry", "what a GPU machine without a package index needs, made small"),
    "gpu-pack": ("bench.gpu_pack", "the peer model's artifact packed, and rebuilt bit for bit"),
    "gpu-step": ("bench.gpu_step", "one decode step of the fast graphs under the CUDA provider"),
    "soak": ("bench.soak", "make soak: a bounded load test of a real worker"),
    "soak-keys": ("bench.soak_keys", "make soak-keys: a noisy API key beside a quiet one"),
    "trees": ("bench.trees", "the same worker measurements from two revisions, in one run"),
    "logprobs": ("bench.logprobs", "what logprobs costs a streamed completion"),
    "mixed-steps": ("bench.mixed_steps", "running streams while prompts arrive"),
    "moe-cost": ("bench.moe_cost", "the dense mixture of experts against one dense MLP"),
    "prefix-cache": ("bench.prefix_cache", "the prefix cache on and off"),
    "speculative": ("bench.speculative", "speculative decoding by prompt lookup on and off, one stream"),
    "serving-cost": ("bench.serving_cost", "where the worker's time goes at 32 streams"),
    "serving-threads": ("bench.serving_threads", "the worker's CPU time and waits per token, thread by thread"),
    "profile-memory": ("bench.profile_memory", "the memory of an attention profile against a plain forward"),
    "bodies": ("bench.bodies", "what checking HTTP bodies with their pydantic models costs"),
    "export-speed": ("bench.export_speed", "an export's CPU time under torch's settings and under posenc's"),
    "interventions": ("bench.interventions", "make bench: intervention calls' cost; the plain path without the graph"),
}


def listing() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: python -m bench NAME [options]   (python -m bench NAME --help)", "", "commands:"]
    return "\n".join(lines + [f"  {name:<{width}}  {what}" for name, (_, what) in COMMANDS.items()])


def main(argv: list[str] | None = None) -> int:
    p = Parser(prog="python -m bench", description=__doc__.splitlines()[0], add_help=False)
    p.add_argument("-h", "--help", action="store_true")
    p.add_argument("name", nargs="?")
    p.add_argument("args", nargs=argparse.REMAINDER)
    a = p.parse_args(sys.argv[1:] if argv is None else argv)
    if a.name is None or a.help:
        print(listing())
        return 0
    if a.name not in COMMANDS:
        p.exit(2, f"python -m bench: no command {a.name!r} (python -m bench lists them)\n")
    module = importlib.import_module(COMMANDS[a.name][0])
    return module.main(a.args) or 0


if __name__ == "__main__":
    sys.exit(main())
