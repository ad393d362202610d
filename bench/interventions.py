"""Per-request interventions measured (docs/interventions.md, issue 49 item 6), in one run on one machine:

1. the plain path with and without the intervention graph in the artifact: the same model exported twice by
   `python -m export --from-hf` (`--interventions on` and `--interventions off`), each served by its own worker, the
   two timed side by side in alternating blocks: gRPC Predict on a short and a longer prompt, and Generate's
   tokens/s for one stream.  The plain graphs (model.onnx, fast.onnx) are the same in both artifacts, so the ratios
   should be about 1; whether their bytes are equal is recorded with them;
2. what an intervention call costs, on the worker whose artifact has the graph: Predict and Score with an
   intervention (a shift, one layer's encoding off, a head ablated, another RoPE scaling; with `baseline`, the
   unmodified run beside it in the same call) against the plain call on the same prompt, and Generate's tokens/s
   under an intervention against the plain stream's.

Both workers run without the prefix cache (`--prefix-cache-mb 0`): an intervention call never uses it, and a plain
call repeating one prompt would otherwise be served from it.  The model: a LLaMA with random weights (grouped-query
attention, RoPE), large enough for its export to write the fast graph the worker's plain calls run.

  python -m bench interventions [--work DIR] [--width N] [--layers N] [--repeat N] [--out bench/results]
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import grpc
import numpy as np

from bench.lib import worker as launch
from bench.lib.results import write
from bench.timing import interleaved, paired_ratio
from model.cli import Parser
from protos.posenc.v1 import posenc_pb2 as pb
from protos.posenc.v1 import posenc_pb2_grpc

ROOT = Path(__file__).resolve().parent.parent
NAME = "llama"
VOCAB = 8192
IDS = 256  # prompts draw ids the tokenizer (a byte-level BPE of about 300 ids) has

# The interventions timed, as posenc.v1 messages: (row label, Intervention).  shift 1000 stays below the model's
# 2048 positions for every prompt and stream here.
PREDICT: list[tuple[str, pb.Intervention]] = [
    ("shift 1000", pb.Intervention(shift=1000)),
    ("positional_off [0]", pb.Intervention(positional_off=[0])),
    ("ablate_heads (0, 0)", pb.Intervention(ablate_heads=[pb.HeadRef(layer=0, head=0)])),
    ("rope_scaling yarn x4", pb.Intervention(rope_scaling=json.dumps({"rope_type": "yarn", "factor": 4}))),
    ("shift 1000, baseline", pb.Intervention(shift=1000, baseline=True)),
]
SCORE = [PREDICT[0], PREDICT[1], PREDICT[4]]
GENERATE = [PREDICT[0], PREDICT[1], PREDICT[2],
            ("rope_scaling linear x2", pb.Intervention(rope_scaling=json.dumps({"rope_type": "linear", "factor": 2})))]


def hf_folder(work: Path, width: int, layers: int) -> Path:
    """A random LLaMA saved as transformers saves one, with a small byte-level tokenizer (kept in `work`)."""
    folder = work / "hf"
    if (folder / "config.json").exists():
        return folder
    import torch  # lazy: only when the model is made; a kept --work folder needs neither torch nor transformers
    import transformers as tf  # lazy: as torch
    from tokenizers import Tokenizer  # lazy: as torch

    from tests.hf.tokenizer_kinds import tokenizer_json  # lazy: as torch

    heads = max(width // 64, 2)
    cfg = tf.LlamaConfig(hidden_size=width, num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=heads // 2, intermediate_size=width * 11 // 4, vocab_size=VOCAB,
                         max_position_embeddings=2048, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    tf.AutoModelForCausalLM.from_config(cfg).save_pretrained(folder, safe_serialization=True)
    tok = Tokenizer.from_str(tokenizer_json("bytelevel"))
    tf.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>").save_pretrained(folder)
    return folder


def export(folder: Path, out: Path, interventions: str) -> Path:
    """`python -m export --from-hf` into out/llama, in its own process, as a user runs it: the models folder."""
    if not (out / NAME / "model.json").exists():
        subprocess.run([sys.executable, "-m", "export", "--from-hf", str(folder), "--out", str(out / NAME),
                        "--interventions", interventions, "--validate-max-length", "16", "--no-verify", "--force"],
                       cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    return out


def plain_graphs_equal(on: Path, off: Path) -> tuple[bool, bool, list[str]]:
    """Whether the off artifact lacks the intervention graph and the on one has it, and whether every graph of the
    off artifact is byte for byte the same file in the on one (their manifests' sha256): (split, equal, graphs)."""
    man = {k: json.loads((p / NAME / "manifest.json").read_text())["files"] for k, p in (("on", on), ("off", off))}
    meta = {k: json.loads((p / NAME / "model.json").read_text()) for k, p in (("on", on), ("off", off))}
    split = ("intervene" in meta["on"] and "intervene" not in meta["off"] and "intervene.onnx" in man["on"]
             and not any(f.startswith("intervene") for f in man["off"]))
    graphs = sorted(f for f in man["off"] if ".onnx" in f)
    same = all(f in man["on"] and man["on"][f]["sha256"] == man["off"][f]["sha256"] for f in graphs)
    return split, same, graphs


class Calls:
    """One worker's gRPC calls on fixed token ids (posenc.v1): Predict, Score, and a whole Generate stream."""

    def __init__(self, port: int, new_tokens: int):
        self.channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        self.stub = posenc_pb2_grpc.PosencStub(self.channel)
        self.new_tokens = new_tokens

    def predict(self, ids: list[int], edit: pb.Intervention | None = None) -> Callable[[], object]:
        req = pb.PredictRequest(model=NAME, prompt=pb.Prompt(tokens=pb.TokenIds(ids=ids)), intervention=edit)
        return lambda: self.stub.Predict(req)

    def score(self, ids: list[int], edit: pb.Intervention | None = None) -> Callable[[], object]:
        req = pb.ScoreRequest(model=NAME, prompt=pb.Prompt(tokens=pb.TokenIds(ids=ids)), intervention=edit)
        return lambda: self.stub.Score(req)

    def generate(self, ids: list[int], edit: pb.Intervention | None = None) -> Callable[[], object]:
        req = pb.GenerateRequest(model=NAME, prompt=pb.Prompt(tokens=pb.TokenIds(ids=ids)),
                                 max_new_tokens=self.new_tokens, ignore_eos=True, intervention=edit)

        def run() -> int:
            n = sum(1 for r in self.stub.Generate(req) if r.HasField("token"))
            if n != self.new_tokens:
                raise RuntimeError(f"Generate gave {n} tokens, not {self.new_tokens}")
            return n
        return run

    def close(self) -> None:
        self.channel.close()


def spread(t: dict) -> str:
    return f"{t['p10_ms']:.2f}-{t['p90_ms']:.2f}"


def rate(t: dict, tokens: int, *keys: str) -> str:
    """Tokens/s of a stream's median time, or with two keys the spread (the slow end's first)."""
    return "-".join(f"{tokens / (t[k] / 1000):.1f}" for k in keys or ("median_ms",))


def timed(fns: dict[str, Callable[[], object]], repeat: int, block: int, block_warmup: int = 1) -> dict[str, dict]:
    return interleaved(fns, repeat, block=block, warmup=2, block_warmup=block_warmup, pause_s=0.02)


def plain_rows(on: Calls, off: Calls, prompts: dict[int, list[int]], a) -> tuple[list[list], dict]:
    """Part 1: the plain calls on both workers, side by side."""
    rows, raw = [], {}
    for n, ids in prompts.items():
        t = timed({"off": off.predict(ids), "on": on.predict(ids)}, a.repeat, a.block)
        raw[f"predict_{n}"] = t
        rows.append([f"Predict, {n}-token prompt (ms)", f"{t['off']['median_ms']:.2f}", spread(t["off"]),
                     f"{t['on']['median_ms']:.2f}", spread(t["on"]), f"{paired_ratio(t, 'on', 'off'):.3f}"])
    ids = prompts[min(prompts)]
    t = timed({"off": off.generate(ids), "on": on.generate(ids)}, a.generate_repeat, a.generate_block, 0)
    raw["generate"] = t
    rows.append([f"Generate, one stream, {a.new_tokens} tokens (tokens/s)", rate(t["off"], a.new_tokens),
                 rate(t["off"], a.new_tokens, "p90_ms", "p10_ms"), rate(t["on"], a.new_tokens),
                 rate(t["on"], a.new_tokens, "p90_ms", "p10_ms"), f"{1 / paired_ratio(t, 'on', 'off'):.3f}"])
    return rows, raw


def cost_rows(calls: Calls, kind: str, cases: list[tuple[str, pb.Intervention]], ids: list[int], a
              ) -> tuple[list[list], dict]:
    """Part 2: one call kind (predict or score) plain and under each intervention, on the same prompt."""
    make = getattr(calls, kind)
    fns = {"plain": make(ids)} | {label: make(ids, edit) for label, edit in cases}
    t = timed(fns, a.repeat, a.block)
    call = kind.capitalize()
    rows = [[call, label, len(ids), f"{v['median_ms']:.2f}", spread(v),
             f"{paired_ratio(t, label, 'plain'):.2f}x"] for label, v in t.items()]
    return rows, t


def generate_rows(calls: Calls, ids: list[int], a) -> tuple[list[list], dict]:
    fns = {"plain": calls.generate(ids)} | {label: calls.generate(ids, edit) for label, edit in GENERATE}
    t = timed(fns, a.generate_repeat, a.generate_block, 0)
    rows = [[label, rate(v, a.new_tokens), rate(v, a.new_tokens, "p90_ms", "p10_ms"),
             f"{1 / paired_ratio(t, label, 'plain'):.2f}"] for label, v in t.items()]
    return rows, t


def main(argv: list[str] | None = None) -> int:
    p = Parser(prog="python -m bench interventions", description=__doc__.split("\n\n")[0])
    p.add_argument("--work", type=Path, default=None, help="folder for the model and its two exports (kept)")
    p.add_argument("--width", type=int, default=384, help="the LLaMA's hidden size (64 per head)")
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--short", type=int, default=16, help="tokens of the short prompt")
    p.add_argument("--long", type=int, default=256, help="tokens of the longer prompt")
    p.add_argument("--new-tokens", type=int, default=32, help="tokens of each Generate stream")
    p.add_argument("--repeat", type=int, default=80, help="timed Predict / Score calls per row")
    p.add_argument("--block", type=int, default=2, help="calls per alternating block")
    p.add_argument("--generate-repeat", type=int, default=30, help="timed Generate streams per row")
    p.add_argument("--generate-block", type=int, default=1)
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    a = p.parse_args(argv)
    if min(a.width, a.layers, a.short, a.long, a.new_tokens, a.repeat, a.block, a.generate_repeat,
           a.generate_block) < 1:
        p.error("every size and count must be >= 1")
    if a.width % 128 or a.short + 1000 + a.new_tokens > 2048 or a.long + 1000 > 2048:
        p.error("--width must be a multiple of 128, and a prompt shifted by 1000 must stay below 2048 positions")
    if a.work is not None:
        return measure(a, a.work / f"llama-{a.width}x{a.layers}", argv)
    with tempfile.TemporaryDirectory(prefix="interventions-") as tmp:
        return measure(a, Path(tmp), argv)


def measure(a, work: Path, argv: list[str] | None) -> int:
    """The model made and exported twice in `work` (kept where it already is), both workers measured."""
    folder = hf_folder(work, a.width, a.layers)
    models = {k: export(folder, work / k, k) for k in ("on", "off")}
    split, same, files = plain_graphs_equal(models["on"], models["off"])
    if not split:
        print("the two exports do not differ by the intervention graph alone", file=sys.stderr)
        return 1
    rng = np.random.default_rng(0)
    prompts = {n: rng.integers(3, IDS, n).tolist() for n in sorted({a.short, a.long})}
    flags = ("--prefix-cache-mb", "0", "--max-prompt-tokens", "2048")
    workers = {k: launch.Worker(v, *flags) for k, v in models.items()}
    calls = {k: Calls(w.port, a.new_tokens) for k, w in workers.items()}
    try:
        plain, raw_plain = plain_rows(calls["on"], calls["off"], prompts, a)
        cost, raw_cost = [], {}
        for kind, cases in (("predict", PREDICT), ("score", SCORE)):
            for n, ids in prompts.items():
                rows, raw_cost[f"{kind}_{n}"] = cost_rows(calls["on"], kind, cases, ids, a)
                cost += rows
        generate, raw_generate = generate_rows(calls["on"], prompts[min(prompts)], a)
    finally:
        for c in calls.values():
            c.close()
        for w in workers.values():
            w.close()
    meta = json.loads((models["on"] / NAME / "model.json").read_text())
    size = (f"a random LLaMA of {meta['sizes']['parameters'] / 1e6:.1f}M parameters ({a.layers} layers, "
            f"{a.width} wide, grouped-query attention, RoPE), imported by `python -m export --from-hf`")
    args = sys.argv[1:] if argv is None else argv
    plain_graph = "fast graph" if "fast" in meta else "exact graph"
    equal = "byte for byte the same file" if same else "not the same file"
    doc = {"meta": {"command": " ".join(["python -m bench interventions", *args])},
           "model": {"parameters": meta["sizes"]["parameters"], "width": a.width, "layers": a.layers,
                     "fast_graph": "fast" in meta, "plain_graphs": files, "plain_graphs_equal": same},
           "raw": {"plain": raw_plain, "cost": raw_cost, "generate": raw_generate},
           "tables": {
               "plain": {"title": "The plain path with and without the intervention graph in the artifact",
                         "columns": ["call", "--interventions off", "p10-p90", "--interventions on", "p10-p90",
                                     "on / off"],
                         "rows": plain,
                         "note": f"{size}, exported twice; one worker per export, timed side by side in alternating "
                                 f"blocks ({a.repeat} Predict calls, {a.generate_repeat} Generate streams each). "
                                 f"Every graph of the off artifact ({', '.join(files)}) is {equal} in the on one. "
                                 "A ratio is the median of per-round ratios; Generate's is of tokens/s."},
               "cost": {"title": "What an intervention call costs against the plain call",
                        "columns": ["call", "intervention", "tokens", "median ms", "p10-p90", "vs plain"],
                        "rows": cost,
                        "note": "The worker with the intervention graph; each prompt's calls timed side by side in "
                                f"alternating blocks. A plain call runs the {plain_graph} through the engine's "
                                "batch; an intervention call runs the intervention graph (the exact graph with the "
                                "intervention's inputs) on the request's thread; with baseline, the intervened and "
                                "the unmodified rows in one call of it. A ratio is the median of per-round ratios."},
               "generate": {"title": "Generate under an intervention",
                            "columns": ["intervention", "tokens/s", "p10-p90", "tokens/s vs plain"],
                            "rows": generate,
                            "note": f"One stream of {a.new_tokens} tokens after a {min(prompts)}-token prompt, "
                                    "prompt included; an intervened stream calls the intervention graph once for "
                                    "the prompt and once per token, with its cache as the graph's inputs. A ratio "
                                    "is the median of per-round ratios of tokens/s."}}}
    print(write(a.out, "interventions", doc))
    return 0
