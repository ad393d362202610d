"""make scaling-study: RoPE scaling types compared on a LLaMA-architecture model trained here at a short context.

1. A byte-level BPE tokenizer and a tiny transformers LlamaForCausalLM are trained on the first 90% of the built-in
   corpus (model/corpus.py) at a context of CONTEXT tokens, and saved as a Hugging Face folder.
2. The folder is imported under each scaling (`posenc-export --from-hf DIR --rope-scaling JSON`): none, linear,
   dynamic, yarn and llama3, each with factor FACTOR.
3. The lab's extrapolation study (lab/studies.py: non-overlapping windows of 1x..8x the trained context over the
   held-out 10%, perplexity per byte) runs against a worker serving the five artifacts.

Writes bench/results/scaling.json (the results convention: meta + tables) and docs/scaling.png, drawn from that
JSON alone (`--plot-only` draws it again from the JSON without training).
  python -m lab.experiments.scaling [--steps N] [--work DIR] [--plot-only]
"""

from __future__ import annotations

import json
import math
import shutil
import sys
import time
from pathlib import Path

from bench.lib.results import meta, write
from lab.experiments.lm_train import train_causal_lm
from model.cli import Parser
from model.corpus import train_text

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results" / "scaling.json"
PLOT = ROOT / "docs" / "scaling.png"
CONTEXT, FACTOR, VOCAB = 64, 8, 512
FACTORS = (1, 2, 4, 8)
ORDER = ("none", "linear", "dynamic", "yarn", "llama3")


def scalings(factor: float) -> dict[str, dict]:
    """The rope_parameters each artifact is imported with (transformers' names and defaults)."""
    return {"none": {"rope_type": "default"},
            "linear": {"rope_type": "linear", "factor": factor},
            "dynamic": {"rope_type": "dynamic", "factor": factor},
            "yarn": {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": CONTEXT},
            "llama3": {"rope_type": "llama3", "factor": factor, "original_max_position_embeddings": CONTEXT,
                       "low_freq_factor": 1.0, "high_freq_factor": 4.0}}


def train_tokenizer(text: str):
    # lazy: torch (213 MB) loads only when a study trains; --plot-only and the figure tests draw without it
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([text], trainer)
    return tok


def train_model(tok, text: str, steps: int, seed: int = 0):
    """A LLaMA (RMSNorm, SwiGLU, grouped-query attention, RoPE) trained on windows of CONTEXT + 1 tokens."""
    # lazy: torch (213 MB) loads only when a study trains; --plot-only and the figure tests draw without it
    import torch
    import transformers as tf

    torch.manual_seed(seed)
    ids = torch.tensor(tok.encode(text).ids, dtype=torch.int64)
    cfg = tf.LlamaConfig(vocab_size=tok.get_vocab_size(), hidden_size=128, intermediate_size=384,
                         num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=CONTEXT, rope_parameters={"rope_type": "default",
                                                                           "rope_theta": 10000.0},
                         rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=0, eos_token_id=0)
    model = tf.LlamaForCausalLM(cfg)
    model.config._attn_implementation = "sdpa"
    batch = 16
    losses = train_causal_lm(model, ids, steps, batch, CONTEXT, seed)
    tail = losses[-50:]
    return model, {"steps": steps, "batch": batch, "context": CONTEXT, "tokens": len(ids),
                   "final_train_loss": round(sum(tail) / len(tail), 4), "parameters": model.num_parameters(),
                   "config": {"hidden_size": 128, "layers": 3, "heads": 4, "kv_heads": 2, "vocab": VOCAB}}


def save_folder(model, tok, folder: Path) -> None:
    # lazy: torch (213 MB) loads only when a study trains; --plot-only and the figure tests draw without it
    import transformers as tf

    if folder.exists():
        shutil.rmtree(folder)
    model.save_pretrained(folder, safe_serialization=True)
    tf.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>").save_pretrained(folder)


def import_all(folder: Path, out: Path, factor: float) -> list[str]:
    # lazy: export pulls onnxscript (92 MB) and torch; only the training run exports
    from export.__main__ import main as export

    names = []
    for kind, rope in scalings(factor).items():
        name = f"llama-{kind}"
        code = export(["--from-hf", str(folder), "--out", str(out / name), "--force", "--rope-scaling",
                       json.dumps(rope), "--validate-max-length", str(2 * CONTEXT)])
        if code:
            raise SystemExit(f"import under {kind} failed")
        names.append(name)
    return names


def evaluate(artifacts: Path, names: list[str], text_bytes: int) -> dict:
    # lazy: the worker and its gRPC stack load only when a study serves its models; --plot-only never does
    import grpc

    from lab.studies import extrapolate
    from protos.posenc.v1 import posenc_pb2_grpc
    from service.server import Server
    from service.settings import Limits, Settings

    # imported models answer past their own max_position_embeddings only when the worker is told so
    limits = Limits(long_context=True) if "long_context" in Limits.__dataclass_fields__ else Limits()
    server = Server(Settings(model_dir=artifacts, host="127.0.0.1", port=0, threads=2, metrics_port=-1,
                             http_port=-1, limits=limits)).start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = posenc_pb2_grpc.PosencStub(channel)
            return extrapolate(stub, names, factors=FACTORS, text_bytes=text_bytes, concurrency=2)
    finally:
        server.stop(grace=1)


def tables(result: dict, factor: float) -> dict:
    cols = ["scaling", *(f"{f}x ({f * CONTEXT})" for f in FACTORS), "8x / 1x"]
    rows = []
    for kind in ORDER:
        cells = result["rows"][f"llama-{kind}"]["cells"]
        values = [cells[str(f)].get("perplexity_per_byte") for f in FACTORS]
        shown = [round(v, 4) if v else None for v in values]
        rows.append([kind if kind == "none" else f"{kind} x{factor:g}", *shown,
                     round(values[-1] / values[0], 3) if values[0] and values[-1] else None])
    return {"perplexity_per_byte": {"columns": cols, "rows": rows}}


def plot(doc: dict, path: Path) -> None:
    """Draw docs/scaling.png from the results document alone (bench/results/scaling.json): the same JSON gives
    the same pixels (matplotlib's default style whatever matplotlibrc says, no metadata that changes: tests compare
    the committed picture with one drawn from the committed JSON)."""
    # lazy: matplotlib (55 MB) only to draw; the study's other paths never load it
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    study, context = doc["study"], doc["trained_context"]
    factors = study["factors"]
    lengths = [f * context for f in factors]
    with plt.style.context("default"):
        fig, ax = plt.subplots(figsize=(6.4, 3.8), dpi=120)
        for kind in doc["scalings"]:
            cells = study["rows"][f"llama-{kind}"]["cells"]
            ax.plot(lengths, [cells[str(f)].get("perplexity_per_byte") or math.nan for f in factors], marker="o",
                    label=kind)
        ax.set_xscale("log", base=2)
        ax.set_xticks(lengths, [str(n) for n in lengths])
        ax.set_yscale("log")
        ax.axvline(context, color="#999", lw=0.8, ls="--")
        ax.set_xlabel("window length (tokens); dashed: trained context")
        ax.set_ylabel("perplexity per byte (held-out)")
        ax.set_title(f"LLaMA trained at {context} tokens, RoPE scaled x{doc['factor']:g}")
        ax.legend(fontsize=8)
        fig.tight_layout()
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp.png")
        fig.savefig(tmp, metadata={"Software": None})
        plt.close(fig)
    tmp.replace(path)


def main(argv: list[str] | None = None) -> int:
    p = Parser(prog="python -m lab.experiments.scaling", description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=800, help="training steps (batch 16 x 64 tokens)")
    p.add_argument("--work", default="/tmp/posenc-scaling", help="where the HF folder and artifacts go")
    p.add_argument("--text-bytes", type=int, default=32768, help="held-out bytes the study scores")
    p.add_argument("--out", default=str(RESULTS))
    p.add_argument("--plot", default=str(PLOT))
    p.add_argument("--plot-only", action="store_true",
                   help="draw --plot from the results in --out alone (no training, no worker)")
    args = p.parse_args(argv)
    if args.plot_only:
        plot(json.loads(Path(args.out).read_text()), Path(args.plot))
        print(f"drew {args.plot} from {args.out}")
        return 0
    # lazy: torch (213 MB) loads only when a study trains; --plot-only and the figure tests draw without it
    import torch

    torch.set_num_threads(1)  # two threads on a shared two-core machine spent more CPU for the same steps
    start = time.monotonic()
    work = Path(args.work)
    text = train_text()
    tok = train_tokenizer(text)
    model, training = train_model(tok, text, args.steps)
    training["seconds"] = round(time.monotonic() - start, 1)
    save_folder(model, tok, work / "hf")
    names = import_all(work / "hf", work / "artifacts", FACTOR)
    result = evaluate(work / "artifacts", names, args.text_bytes)
    doc = {"meta": meta("make scaling-study", seconds=round(time.monotonic() - start, 1)),
           "tables": tables(result, FACTOR), "factor": FACTOR, "trained_context": CONTEXT,
           "scalings": scalings(FACTOR), "training": training, "study": result}
    out = Path(args.out)
    write(out.parent, out.stem, doc, indent=2)
    plot(doc, Path(args.plot))
    for row in doc["tables"]["perplexity_per_byte"]["rows"]:
        print("  ".join(str(c) for c in row))
    print(f"wrote {out} and {args.plot} in {doc['meta']['seconds']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
