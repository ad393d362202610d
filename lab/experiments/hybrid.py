"""make hybrid-study: do NoPE layers beside RoPE layers, or recurrent ones, help a model read past its trained context?

Ten LLaMA-architecture models (RMSNorm, SwiGLU, grouped-query attention, tied head) of one size are trained here
on the built-in corpus at a context of CONTEXT bytes, with the same seed, data order and number of steps; they
differ only in where each layer's order comes from (DESIGNS): its positional encoding, or a recurrent layer's
recurrence and convolution in place of attention (Mamba-2 or Gated DeltaNet):

  rope          RoPE in every layer
  rope+nope4    NoPE on every 4th layer, RoPE elsewhere (SmolLM3's no_rope_layers, Llama 4's iRoPE layers)
  nope          no positional encoding in any layer (Kazemnejad et al. 2023)
  local+nope    sliding-window RoPE layers and a global NoPE layer every 4th (Cohere2's pattern)
  local+global  sliding-window RoPE layers at base 10k, a global RoPE layer at base 1M every 4th (Gemma 3's)
  mamba2+nope4  Mamba-2 layers (model/ssm.py), a full-attention NoPE layer every 4th (Granite 4.0-H's kinds)
  deltanet+nope4  Gated DeltaNet layers (model/deltanet.py), a full-attention NoPE layer every 4th (Qwen3-Next's
                pattern, its attention NoPE as Granite's is)
  p_rope        p-RoPE in every layer (model/variants/p_rope.py: a quarter of the pairs never turns; Gemma 4's global
                layers)
  fox           the Forgetting Transformer in every layer (model/variants/fox.py: forget gates, no other encoding)
  path          PaTH in every layer (model/variants/path.py: data-dependent Householder reflections)

Each is exported and served like any posenc model; the lab's extrapolation study (lab/studies.py: perplexity per
byte over non-overlapping held-out windows of 1x..16x the trained context) and each layer's attention profile at
the longest length (the Profile RPC: attention mass by distance in log-2 buckets, computed in the graph; a recurrent
layer's rows, its signed matrix (Mamba-2's SSD matrix, Gated DeltaNet's UT-form W) read as |m| / sum |m|, from the
whole prompt's maps) run against a worker serving them all.

Writes bench/results/hybrid.json (the results convention: meta + tables; docs/hybrid-study.md's tables are filled
from it by `make docs`) and docs/img/hybrid.png, drawn from that JSON alone (`--plot-only` draws it again).
  python -m lab.experiments.hybrid [--steps N] [--work DIR] [--text-bytes N] [--plot-only]
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.lib.results import meta, write
from model.cli import Parser
from model.layer_spec import RECURRENT
from protos.posenc.v1 import posenc_pb2 as pb

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results" / "hybrid.json"
PLOT = ROOT / "docs" / "img" / "hybrid.png"
CONTEXT, WINDOW, LAYERS = 64, 16, 4
FACTORS = (1, 2, 4, 8, 16)
# LLaMA's architecture at the size of posenc's default models, four layers so that "every 4th" is one layer
LLAMA = {"variant": "rope", "vocab_size": 256, "d_model": 128, "n_heads": 4, "n_kv_heads": 2, "n_layers": LAYERS,
         "d_mlp": 384, "context": CONTEXT, "norm": "rmsnorm", "mlp": "gated", "activation": "silu",
         "qkv_bias": False, "out_bias": False, "mlp_bias": False, "norm_bias": False, "tie_head": True,
         "rope_base": 10000.0}
EVERY_4TH = tuple(i for i in range(LAYERS) if (i + 1) % 4 == 0)  # SmolLM3 / Cohere2: layer i with (i + 1) % 4 == 0
OTHERS = tuple(i for i in range(LAYERS) if i not in EVERY_4TH)


# Granite 4.0-H's Mamba-2 layer at this size: 8 heads of 16 (inner width 128 = d_model, Mamba's expand 1 where
# Granite's is 2), a state of 16, one group of B and C, a biased 4-tap convolution; its parameter count beside an
# attention layer's is measured (parameters) and written with the results
MAMBA2 = {"ssm_heads": 8, "ssm_head_dim": 16, "ssm_state": 16, "ssm_groups": 1, "conv_kernel": 4, "conv_bias": True}
# Qwen3-Next's Gated DeltaNet layer at the same sizes, which mean the same there (its q and k are Mamba-2's C and B):
# 8 value heads of 16 (value width 128 = d_model, where Qwen3-Next's is 2x), a key head dim (the state) of 16, one
# key head (Qwen3-Next has a key head per 2 value heads, which here would add a quarter to each layer), a 4-tap
# convolution unbiased as Qwen3-Next's; 8 value heads are 2 per map head (n_heads 4)
DELTANET = {**MAMBA2, "conv_bias": False}


def _layers(attention: str, encoding: str, every_4th: str, mixer: str = "attention") -> list[dict[str, str]]:
    """Each layer's record (model.config.LayerSpec's fields): every 4th layer `every_4th`'s encoding at full
    attention, the others `attention` with `encoding`, or a `mixer` in place of attention."""
    return [{"attention": "full", "encoding": every_4th} if i in EVERY_4TH else
            {"attention": attention, "encoding": encoding} if mixer == "attention" else {"mixer": mixer}
            for i in range(LAYERS)]


DESIGNS: dict[str, dict[str, Any]] = {
    "rope": {},
    "rope+nope4": {"layers": _layers("full", "model", "none")},
    "nope": {"layers": _layers("full", "none", "none")},
    "local+nope": {"sliding_window": WINDOW, "layers": _layers("sliding", "model", "none")},
    "local+global": {"sliding_window": WINDOW, "local_rope_base": 10000.0, "rope_base": 1000000.0,
                     "layers": _layers("sliding", "local", "model")},
    "mamba2+nope4": {**MAMBA2, "layers": _layers("full", "model", "none", mixer="mamba2")},
    "deltanet+nope4": {**DELTANET, "layers": _layers("full", "model", "none", mixer="gated_deltanet")},
    # three of the research variants (model/variants/) in every layer: order from RoPE's turning pairs alone, from a
    # forget gate's decay, from data-dependent reflections
    "p_rope": {"variant": "p_rope"},
    "fox": {"variant": "fox"},
    "path": {"variant": "path"},
}
DESCRIPTIONS = {
    "rope": "RoPE (base 10k) in every layer",
    "rope+nope4": "NoPE on every 4th layer, RoPE elsewhere (SmolLM3, Llama 4)",
    "nope": "no positional encoding in any layer",
    "local+nope": f"RoPE layers see a {WINDOW}-token window; every 4th layer global, NoPE (Cohere2)",
    "local+global": f"RoPE base 10k in {WINDOW}-token windows; every 4th layer global, RoPE base 1M (Gemma 3)",
    "mamba2+nope4": f"Mamba-2 layers ({MAMBA2['ssm_heads']} heads of {MAMBA2['ssm_head_dim']}, state "
                    f"{MAMBA2['ssm_state']}, {MAMBA2['conv_kernel']}-tap convolution); every 4th layer full "
                    "attention, NoPE (Granite 4.0-H)",
    "deltanet+nope4": f"Gated DeltaNet layers ({DELTANET['ssm_heads']} value heads of {DELTANET['ssm_head_dim']}, "
                      f"{DELTANET['ssm_groups']} key head of {DELTANET['ssm_state']}, {DELTANET['conv_kernel']}-tap "
                      "convolution); every 4th layer full attention, NoPE (Qwen3-Next's pattern)",
    "p_rope": "p-RoPE in every layer: the lowest-frequency quarter of RoPE's pairs never turns (Barbero et al. 2024; "
              "Gemma 4's global layers)",
    "fox": "the Forgetting Transformer in every layer: each head's forget gates decay the logits, no other encoding "
           "(Lin et al. 2025)",
    "path": "PaTH in every layer: data-dependent Householder reflections between each key and query (Yang et al. "
            "2025)",
}


def config(design: str):
    # lazy: torch (213 MB) loads only when a study trains; --plot-only and the figure tests draw without it
    from model.config import ModelConfig

    return ModelConfig.from_dict({**LLAMA, **DESIGNS[design]})


def train_all(work: Path, steps: int, threads: int) -> dict[str, Any]:
    """Train every design with the same seed, batches and steps; save each as a posenc checkpoint."""
    # lazy: torch (213 MB) loads only when a study trains; --plot-only and the figure tests draw without it
    from model import checkpoint
    from model.config import ModelConfig
    from model.corpus import load_text
    from model.data import split
    from model.train import TrainSettings, train

    splits = split(load_text(None), CONTEXT)
    settings = TrainSettings(steps=steps, threads=threads, seed=0)
    summaries = {}
    for design in DESIGNS:
        folder = work / "checkpoints" / design
        if checkpoint.is_complete(folder):  # a finished earlier run of the same design and steps is kept
            meta = checkpoint.read_meta(folder)
            if ModelConfig.from_dict(meta["config"]) == config(design) and meta["training"].get("steps") == steps:
                print(f"{design}: trained checkpoint kept ({folder})", file=sys.stderr, flush=True)
                summaries[design] = {k: meta["training"][k] for k in ("steps", "seconds", "train_loss",
                                                                      "heldout_loss", "loss_unit")}
                continue
        print(f"training {design} ({steps} steps)", file=sys.stderr, flush=True)
        model, summary = train(config(design), splits, settings, progress=False)
        checkpoint.save(model, folder, summary)
        summaries[design] = {k: summary[k] for k in ("steps", "seconds", "train_loss", "heldout_loss", "loss_unit")}
    return summaries


def export_all(work: Path) -> None:
    # lazy: export pulls onnxscript (92 MB) and torch; only the training run exports
    from export.__main__ import export_main

    for design in DESIGNS:
        code = export_main(["--checkpoint", str(work / "checkpoints" / design), "--out",
                            str(work / "artifacts" / design), "--force"])
        if code:
            raise SystemExit(f"exporting {design} failed")


def parameters(design: str) -> dict[str, Any]:
    """The design's parameter count, each layer's mixer's (its attention or recurrent layer) and their differences
    from the rope design's, counted on the model itself."""
    # lazy: torch (213 MB) loads only when a study trains; --plot-only and the figure tests draw without it
    from model.transformer import Transformer

    def count(design: str) -> tuple[int, list[int]]:
        model = Transformer(config(design))
        return (sum(p.numel() for p in model.parameters()),
                [sum(p.numel() for p in block.attn.parameters()) for block in model.blocks])

    (total, mixers), (base, base_mixers) = count(design), count("rope")
    return {"total": total, "mixers": mixers, "total_minus_rope": total - base,
            "mixers_minus_rope": [m - b for m, b in zip(mixers, base_mixers, strict=True)]}


def evaluate(artifacts: Path, text_bytes: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the extrapolation study, each design's profile at the longest length) from a worker serving them all."""
    # lazy: the worker and its gRPC stack load only when a study serves its models; --plot-only never does
    import grpc

    from lab.studies import eval_text, extrapolate
    from protos.posenc.v1 import posenc_pb2_grpc
    from service.server import Server
    from service.settings import Limits, Settings

    # a whole prompt's maps (whole_prompt_columns) are 4 bytes x layers x heads x length^2 to compute: 64 MiB here
    server = Server(Settings(model_dir=artifacts, host="127.0.0.1", port=0, threads=2, metrics_port=-1,
                             http_port=-1, limits=Limits(max_message_bytes=128 << 20))).start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{server.port}",
                                   options=[("grpc.max_receive_message_length", 128 << 20)]) as channel:
            stub = posenc_pb2_grpc.PosencStub(channel)
            study = extrapolate(stub, list(DESIGNS), factors=FACTORS, text_bytes=text_bytes, concurrency=2)
            length = FACTORS[-1] * CONTEXT
            data, _ = eval_text(text_bytes, seed=0)
            prompts = [data[i:i + length] for i in range(0, 4 * length, length)]
            profiles = {design: layer_profiles(stub, design, prompts, tuple(
                i for i in range(LAYERS) if not config(design).attends(i))) for design in DESIGNS}
            return study, profiles
    finally:
        server.stop(grace=1)


def layer_profiles(stub, model: str, prompts: list[list[int]], whole: tuple[int, ...] = ()) -> dict[str, Any]:
    """Per layer (averaged over heads, every query row and the prompts): the attention mass by log-2 distance
    bucket, the mean distance (each bucket at its lower edge: a lower bound), the mass at distances past the
    trained context, the mass on the first position and the rows' entropy, from the worker's Profile RPC (reduced
    in the graph); the layers in `whole` (recurrent layers) from the whole prompt's maps (whole_prompt_columns), whose
    reading of every layer, the recurrent ones included, is held to the graph's: `whole_prompt_check`, the largest
    difference."""
    total, columns, buckets, check = None, [], 0, 0.0
    for ids in prompts:
        resp = stub.Profile(pb.ProfileRequest(model=model, prompt=pb.Prompt(tokens=pb.TokenIds(ids=ids))),
                            timeout=600)
        values = np.frombuffer(resp.values, dtype="<f4").reshape(tuple(resp.shape)).mean(axis=1)  # heads averaged
        columns, buckets = list(resp.columns), resp.buckets
        if whole:
            assert columns[buckets:] == ["first", "entropy"], columns  # the columns whole_prompt_columns computes
            values = values.astype(np.float64)
            mine = whole_prompt_columns(stub, model, ids, tuple(range(len(values))), buckets)
            check = max(check, float(np.abs(mine - values).max()))
            values[list(whole)] = mine[list(whole)]
        total = values if total is None else total + values
    mean = total / len(prompts)
    starts = [int(name.split("-")[0]) for name in columns[:buckets]]
    past = [i for i, start in enumerate(starts) if start >= CONTEXT]
    layers = []
    for row in mean:
        mass = row[:buckets]
        extra = dict(zip(columns[buckets:], (round(float(v), 5) for v in row[buckets:]), strict=True))
        distance = sum(v * s for v, s in zip(mass, starts, strict=True))
        # shares to five significant figures: a layer that keeps to its neighbours reads as how small its far ones are
        layers.append({"mass_by_bucket": [float(f"{v:.5g}") for v in mass],
                       "mean_distance_lower_bound": round(float(distance), 2),
                       "mass_past_context": float(f"{sum(mass[i] for i in past):.5g}"), **extra})
    return {"bucket_starts": starts, "length": len(prompts[0]), "prompts": len(prompts), "layers": layers,
            "whole_prompt_layers": list(whole), "whole_prompt_check": float(f"{check:.2g}") if whole else None}


def whole_prompt_columns(stub, model: str, ids: list[int], layers: tuple[int, ...], buckets: int) -> np.ndarray:
    """(layers, buckets + 2): the Profile graph's columns for `layers` (the share by log-2 distance bucket, on the
    first position, the rows' entropy in nats; heads and rows averaged), computed here as export/profile.py does from
    the maps of the whole prompt, which Predict with ATTENTION_FULL computes in one call.  A mixer's signed rows are
    read as p = |m| / sum |m|.  A recurrent layer's row spans only the keys of its own call (docs/mixers.md): the
    Profile RPC runs such a model's prompt in one call up to service.jobs.WHOLE_MAP_CELLS, and this reading, in
    float64 from the maps Predict returns, holds the graph's to it."""
    resp = stub.Predict(pb.PredictRequest(model=model, prompt=pb.Prompt(tokens=pb.TokenIds(ids=ids)), top_k=1,
                                          attention=pb.ATTENTION_FULL, layers=list(layers)), timeout=600)
    distance = np.arange(len(ids))[:, None] - np.arange(len(ids))[None, :]
    causal = distance >= 0
    bucket = np.minimum(np.frexp(np.maximum(distance, 0))[1], buckets - 1)[causal]  # d = 0: 0; else its bit length
    out = np.zeros((len(layers), buckets + 2))
    for amap in resp.attention:
        m = np.abs(np.frombuffer(amap.data, dtype="<f4").reshape(tuple(amap.shape)).astype(np.float64))
        assert m.shape == distance.shape, (m.shape, len(ids))  # every row of the prompt, over all its keys
        p = m / np.maximum(m.sum(axis=-1, keepdims=True), np.finfo(np.float32).tiny)
        mass = np.bincount(bucket, weights=p[causal], minlength=buckets) / len(p)
        entropy = -(p * np.log(np.where(p > 0, p, 1.0))).sum(axis=-1).mean()
        out[layers.index(amap.layer)] += np.concatenate([mass, [p[:, 0].mean(), entropy]])
    return out / (len(resp.attention) // len(layers))  # heads averaged


def encodings(design: str) -> list[str]:
    """Each layer's positions in words ("rope 10k / window 16", "none / global", a variant's "fox / global",
    "mamba2 / recurrence" or "gated_deltanet / recurrence": no attention, order from the recurrence and convolution)."""
    out = []
    for entry in config(design).layer_plan():
        if entry["mixer"] != "attention":
            out.append(f"{entry['mixer']} / {entry['encoding']}")
            continue
        rope = entry.get("rope")
        pos = f"rope {rope['base'] / 1000:g}k" if rope else entry["encoding"]  # none, or a variant's own
        out.append(f"{pos} / {'window ' + str(entry['window']) if entry['window'] else 'global'}")
    return out


def tables(doc: dict[str, Any]) -> dict[str, Any]:
    cols = ["design", *(f"{f}x ({f * CONTEXT})" for f in FACTORS), f"{FACTORS[-1]}x / 1x", "held-out nats/byte"]
    rows = []
    for design in DESIGNS:
        cells = doc["study"]["rows"][design]["cells"]
        values = [cells[str(f)].get("perplexity_per_byte") for f in FACTORS]
        rows.append([design, *values, round(values[-1] / values[0], 3) if values[0] and values[-1] else None,
                     doc["training"][design]["heldout_loss"]])
    pcols = ["design", *(f"layer {i}" for i in range(LAYERS))]
    prow = []
    for design in DESIGNS:
        kinds = encodings(design)
        layers = doc["profiles"][design]["layers"]
        cells = (f"{k}: {share(layer['mass_past_context'])}" for k, layer in zip(kinds, layers, strict=True))
        prow.append([design, *cells])
    return {"perplexity_per_byte": {"columns": cols, "rows": rows},
            "mass_past_context": {"columns": pcols, "rows": prow,
                                  "note": "attention mass (a Mamba-2 or Gated DeltaNet layer: its matrix rows' |m| / "
                                          f"sum |m|) at distances >= {CONTEXT} (the trained context) in "
                                          f"{FACTORS[-1] * CONTEXT}-byte held-out prompts, mean over heads and "
                                          "queries"},
            "designs": {"columns": ["design", "layers", "parameters"],
                        "rows": [[d, DESCRIPTIONS[d], doc["designs"][d]["parameters"]["total"]] for d in DESIGNS]}}


def share(value: float) -> str:
    """A share to three places, or to two significant figures where it is under 0.001 but not 0."""
    return f"{value:.1e}" if 0 < value < 0.0005 else f"{value:.3f}"


def plot(doc: dict[str, Any], path: Path) -> None:
    """Draw the picture from the results document alone: perplexity per byte by length (left) and each layer's
    attention mass by distance at the longest length (right).  The same JSON gives the same pixels."""
    # lazy: matplotlib (55 MB) only to draw; the study's other paths never load it
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    lengths = [f * doc["trained_context"] for f in doc["factors"]]
    with plt.style.context("default"):
        fig, (left, right) = plt.subplots(1, 2, figsize=(10.5, 4.6), dpi=110)
        for design in doc["designs"]:
            cells = doc["study"]["rows"][design]["cells"]
            left.plot(lengths, [cells[str(f)].get("perplexity_per_byte") or math.nan for f in doc["factors"]],
                      marker="o", label=design)
        left.set_xscale("log", base=2)
        left.set_xticks(lengths, [str(n) for n in lengths])
        left.axvline(doc["trained_context"], color="#999", lw=0.8, ls="--")
        left.set_xlabel("window length (bytes); dashed: trained context")
        left.set_ylabel("perplexity per byte (held-out)")
        left.set_title("Length extrapolation")
        for design in doc["designs"]:
            layers = doc["profiles"][design]["layers"]
            kinds = doc["designs"][design]["layers"]
            xs = list(range(len(layers)))
            line, = right.plot(xs, [layer["mass_past_context"] for layer in layers], lw=1, label=design)
            for x, layer, kind in zip(xs, layers, kinds, strict=True):  # hollow: a NoPE layer; square: recurrent
                recurrent = kind.split(" / ")[0] in RECURRENT
                right.plot([x], [layer["mass_past_context"]], marker="s" if recurrent else "o",
                           ls="none", color=line.get_color(),
                           markerfacecolor="white" if kind.startswith("none") else line.get_color())
        right.set_xticks(range(LAYERS), [f"layer {i}" for i in range(LAYERS)])
        right.set_ylabel(f"mass at distance >= {doc['trained_context']}")
        right.set_title(f"How far each layer looks at {lengths[-1]} bytes\n"
                        "(hollow: NoPE, square: Mamba-2 or Gated DeltaNet)", fontsize=10)
        # one legend for both panels, below them: on either panel it would cover lines
        fig.legend(*left.get_legend_handles_labels(), loc="lower center", ncol=5, fontsize=8, frameon=False)
        fig.tight_layout(rect=(0, 0.12, 1, 1))
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp.png")
        fig.savefig(tmp, metadata={"Software": None})
        plt.close(fig)
    tmp.replace(path)


def main(argv: list[str] | None = None) -> int:
    p = Parser(prog="python -m lab.experiments.hybrid", description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=1000, help=f"training steps per design (batch 16 x {CONTEXT} bytes)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads while training (two on a shared two-core machine spin against other work)")
    p.add_argument("--work", default="/tmp/posenc-hybrid", help="where the checkpoints and artifacts go")
    p.add_argument("--text-bytes", type=int, default=32768, help="held-out bytes the study scores")
    p.add_argument("--out", default=str(RESULTS))
    p.add_argument("--plot", default=str(PLOT))
    p.add_argument("--plot-only", action="store_true",
                   help="draw --plot from the results in --out alone (no training, no worker)")
    args = p.parse_args(argv)
    if args.steps < 1 or args.text_bytes < FACTORS[-1] * CONTEXT * 4:
        print(f"hybrid-study: error: --steps must be >= 1 and --text-bytes >= {FACTORS[-1] * CONTEXT * 4}",
              file=sys.stderr)
        return 2
    if args.plot_only:
        plot(json.loads(Path(args.out).read_text()), Path(args.plot))
        print(f"drew {args.plot} from {args.out}")
        return 0
    start = time.monotonic()
    work = Path(args.work)
    training = train_all(work, args.steps, args.threads)
    train_seconds = round(sum(t["seconds"] for t in training.values()), 1)
    export_all(work)
    study, profiles = evaluate(work / "artifacts", args.text_bytes)
    doc = {"meta": meta("make hybrid-study", seconds=round(time.monotonic() - start, 1),
                        train_seconds=train_seconds),
           "trained_context": CONTEXT, "window": WINDOW, "factors": list(FACTORS), "architecture": LLAMA,
           "designs": {d: {"description": DESCRIPTIONS[d], "fields": {k: list(v) if isinstance(v, tuple) else v
                                                                       for k, v in DESIGNS[d].items()},
                           "layers": encodings(d), "parameters": parameters(d)} for d in DESIGNS},
           "training": training, "study": study, "profiles": profiles}
    doc["tables"] = tables(doc)
    out = Path(args.out)
    write(out.parent, out.stem, doc, indent=2)
    plot(doc, Path(args.plot))
    for row in doc["tables"]["perplexity_per_byte"]["rows"]:
        print("  ".join(str(c) for c in row))
    print(f"wrote {args.out} and {args.plot} in {doc['meta']['seconds']} s (training {train_seconds} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
