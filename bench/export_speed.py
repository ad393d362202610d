"""What an export costs under torch's own settings and under posenc's: the fake tensors' dispatch cache, the
type-promotion pass.

  python -m bench export-speed [--rounds 2] [--models rope,mamba2-hybrid] [--out bench/results]

torch.export traces a module under fake tensors and symbolic shapes, and the fake tensors keep a dispatch cache: an
operator's output metadata by its inputs'. posenc's exporter (export/dynamo.py onnx_export) traces with that cache
off, because under symbolic shapes a hit rebuilds its output's sizes and strides as symbolic expressions and costs
more than the operator's own meta function (export.dynamo.DISPATCH_CACHE). It then inserts the casts ATen's type
promotion implies with export.promotion's pass, which reads the values the trace recorded, where torch's pass
interprets the graph once more under fake tensors. This measures both choices, like for like in one process: each
model's graph (export.build.export_onnx: the graph a model's artifact holds) exported under three settings (torch's
own: the cache on and its pass; the cache off and torch's pass; posenc's: the cache off and the pass from the
recorded values) in an order rotating by round, --rounds times each, the CPU seconds of each export (the median per
setting), and whether every setting wrote the same bytes. The models: every registered variant at the tiny preset
(the test suite's), and two hybrids of the tiny preset's sizes: Mamba-2 layers about an attention layer (Granite
4.0-H, Nemotron-H) and gated DeltaNet layers about one (Qwen3-Next). Writes export_speed.json and its markdown to --out.
Reports; never asserts.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

from bench.lib.results import machine, meta, write
from model.cli import Parser
from model.files import sha256_file

RESULTS = Path(__file__).resolve().parent / "results"
HYBRIDS = {  # layers (mixer kinds) and the mixers' sizes, over the tiny preset
    "mamba2-hybrid": {"variant": "none", "layers": ["mamba2", "attention", "mamba2"], "ssm_heads": 8,
                      "ssm_head_dim": 8, "ssm_state": 16, "ssm_groups": 2, "conv_kernel": 4},
    "deltanet-hybrid": {"variant": "rope", "layers": ["gated_deltanet", "attention", "gated_deltanet"],
                        "ssm_heads": 8, "ssm_head_dim": 8, "ssm_state": 8, "ssm_groups": 4, "conv_kernel": 4},
}


def models() -> list[str]:
    from model.variants import REGISTRY

    return [*REGISTRY, *HYBRIDS]


def build(name: str):
    import torch

    from model.config import LayerSpec, preset
    from model.transformer import Transformer

    torch.manual_seed(0)
    if name in HYBRIDS:
        spec = dict(HYBRIDS[name])
        layers = [LayerSpec(mixer=kind) for kind in spec.pop("layers")]
        cfg = preset("tiny", spec.pop("variant"), n_layers=len(layers), layers=layers, **spec)
    else:
        cfg = preset("tiny", name)
    return Transformer(cfg).eval()


# (the dispatch cache on, export.promotion's pass): torch's own, the cache alone off, posenc's
SETTINGS = {"torch": (True, False), "cache_off": (False, False), "posenc": (False, True)}


def exported(model, path: Path, setting: str) -> tuple[float, str]:
    """(CPU seconds, sha256 of the file) of one export of the model's graph under one of SETTINGS."""
    import contextlib

    from export import dynamo, promotion
    from export.build import export_onnx

    cached, recorded = SETTINGS[setting]
    kept = dynamo.CACHE_DIR, dynamo.DISPATCH_CACHE, promotion.from_recorded
    dynamo.CACHE_DIR, dynamo.DISPATCH_CACHE = None, cached  # no graph cache: traced every time
    promotion.from_recorded = kept[2] if recorded else contextlib.nullcontext
    try:
        start = time.process_time()
        export_onnx(model, path, opset=23)
        cpu = time.process_time() - start
    finally:
        dynamo.CACHE_DIR, dynamo.DISPATCH_CACHE, promotion.from_recorded = kept
    return cpu, sha256_file(path)


def measure(name: str, folder: Path, rounds: int) -> dict:
    model = build(name)
    cpu: dict[str, list[float]] = {s: [] for s in SETTINGS}
    digests: set[str] = set()
    order = list(SETTINGS)
    for r in range(rounds):
        for setting in order[r % len(order):] + order[:r % len(order)]:
            seconds, digest = exported(model, folder / f"{name}-{r}-{setting}.onnx", setting)
            cpu[setting].append(seconds)
            digests.add(digest)
    medians = {f"{s}_cpu_s": statistics.median(cpu[s]) for s in SETTINGS}
    return {"model": name, **medians, "posenc_over_torch": medians["posenc_cpu_s"] / medians["torch_cpu_s"],
            "same_graph": len(digests) == 1, "rounds": rounds}


def table(rows: list[dict]) -> dict:
    sums = {s: sum(r[f"{s}_cpu_s"] for r in rows) for s in SETTINGS}
    body = [[r["model"], *(round(r[f"{s}_cpu_s"], 2) for s in SETTINGS), round(r["posenc_over_torch"], 2),
             r["same_graph"]] for r in rows]
    body.append(["all", *(round(sums[s], 1) for s in SETTINGS), round(sums["posenc"] / sums["torch"], 2),
                 all(r["same_graph"] for r in rows)])
    return {"columns": ["model", "torch's settings (CPU s)", "dispatch cache off (CPU s)",
                        "cache off, promotion from the recorded values: posenc's (CPU s)", "posenc's / torch's",
                        "same bytes"], "rows": body,
            "note": "each model's graph (model.onnx) exported in one process, the order of the settings rotating "
                    "by round; the median CPU seconds per setting, after one untimed export"}


def main(argv: list[str] | None = None) -> int:
    parser = Parser(prog="python -m bench export-speed", description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--models", default=",".join(models()),
                        help="comma-separated: registered variants and " + ", ".join(HYBRIDS))
    parser.add_argument("--out", type=Path, default=RESULTS, help="where export_speed.json and .md are written")
    args = parser.parse_args(argv)
    names = [m for m in args.models.split(",") if m]
    unknown = sorted(set(names) - set(models()))
    if unknown or not names:
        parser.error(f"unknown models {unknown}; known: {', '.join(models())}" if unknown else "no models")
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    with tempfile.TemporaryDirectory() as tmp:
        exported(build(names[0]), Path(tmp) / "warm-up.onnx", "posenc")  # torch's own first-export costs, untimed
        rows = [measure(name, Path(tmp), args.rounds) for name in names]
    result = {"meta": meta("python -m bench export-speed", machine=machine()), "tables": {"cost": table(rows)},
              "rows": rows}
    write(args.out, "export_speed", result, indent=2)
    for row in result["tables"]["cost"]["rows"]:
        print(" | ".join(str(c) for c in row))
    return 0
