"""python -m export: checkpoint(s) -> ONNX artifact(s); `validate` and `triton` subcommands.

  python -m export --checkpoint checkpoints/rope --out artifacts/rope
  python -m export --checkpoints checkpoints --out artifacts
  python -m export --init random --variant alibi --preset tiny --out /tmp/a
  python -m export --from-hf hf/gpt2 --out artifacts/gpt2
  python -m export --checkpoint checkpoints/rope --attention explicit --opset 18 --out /tmp/rope-opset18
  python -m export validate artifacts/rope [--json]
  python -m export triton artifacts --out model_repository
  python -m export rope-scale artifacts/rope --method yarn --factor 8 --out artifacts/rope-yarn8
  python -m export quantize artifacts/rope --out artifacts/rope-int8 [--method dynamic|int8|int4]
  python -m export models --checkpoints checkpoints --out artifacts   # make models: train where absent, export all
"""

from __future__ import annotations

import importlib.util
import logging
import sys
from pathlib import Path

try:  # every command needs onnx (and all but quantize torch): the build extra, which the worker and client installs
    import onnx  # leave out
except ModuleNotFoundError as err:
    print(f"posenc-export: error: {err.name} is missing: exporting needs the build extra "
          "(pip install 'posenc[build]')", file=sys.stderr)
    raise SystemExit(2) from None

from export import artifact
from model.cli import Parser
from model.errors import PosencError

# The commands' own modules are imported by each command: those that build or check graphs from a model import
# torch (about 1.4 s of start-up), which `quantize` never needs.


def export_main(argv: list[str]) -> int:
    from export.build import (  # lazy: torch
        ATTENTION_KINDS,
        DEFAULT_ATTENTION,
        DEFAULT_OPSET,
        build_artifact,
        load_source,
    )
    from export.hf import VALIDATION_MAX_LENGTH, import_artifact  # lazy: torch
    from model import checkpoint, rope_scaling  # lazy: torch
    from model.config import PRESETS  # lazy: with the command that reads it

    p = Parser(prog="python -m export", description="Export checkpoints to ONNX artifacts.")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", help="one checkpoint folder (from model.train)")
    src.add_argument("--checkpoints", help="a folder of checkpoints: export every complete one")
    src.add_argument("--init", choices=["random"], help="random weights (tests); needs --variant")
    src.add_argument("--from-hf", metavar="DIR", help="a local Hugging Face folder (config.json, model.safetensors "
                     "or its index and shards, tokenizer.json): gpt2, gpt_neox, llama or bloom; never downloads")
    p.add_argument("--variant")
    p.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True, help="artifact folder (or parent folder with --checkpoints)")
    p.add_argument("--name", help="artifact name (default: the folder name of --out)")
    p.add_argument("--opset", type=int, default=DEFAULT_OPSET,
                   help=f"default {DEFAULT_OPSET}; 18-22 only with --attention explicit")
    p.add_argument("--attention", choices=ATTENTION_KINDS, default=DEFAULT_ATTENTION,
                   help="onnx (default, the faster): one Attention-23 node per layer (probabilities via "
                        "qk_matmul_output_mode=3), RoPE as RotaryEmbedding-23; explicit: MatMul/Add/Softmax nodes")
    p.add_argument("--force", action="store_true", help="replace an existing artifact")
    p.add_argument("--skip-existing", action="store_true", help="keep artifacts that verify and are newer")
    p.add_argument("--no-validate", action="store_true", help="skip the parity validation (not recommended)")
    p.add_argument("--validate-max-length", type=int, default=VALIDATION_MAX_LENGTH,
                   help=f"--from-hf: longest sequence the validation runs (default {VALIDATION_MAX_LENGTH})")
    p.add_argument("--rope-scaling", metavar="JSON", help="--from-hf: replace the folder's RoPE scaling with this "
                   "rope_parameters object, e.g. '{\"rope_type\": \"yarn\", \"factor\": 4}', or none")
    p.add_argument("--no-verify", action="store_true", help="--from-hf: skip the proof against transformers' own "
                   "model of the folder (on whenever transformers is installed; the generic import needs it)")
    interventions_option(p)
    args = p.parse_args(argv)
    if args.rope_scaling is not None and not args.from_hf:
        raise PosencError("--rope-scaling applies to --from-hf; scale an own artifact with rope-scale")
    if args.from_hf:
        if args.no_validate:
            raise PosencError("--from-hf always validates the imported artifact")
        override = rope_scaling.parse_override(args.rope_scaling) if args.rope_scaling is not None else None
        report, info = import_artifact(args.from_hf, args.out, name=args.name, force=args.force, opset=args.opset,
                                       attention=args.attention, validation_max_length=args.validate_max_length,
                                       rope_scaling=override, verify=False if args.no_verify else None,
                                       interventions=args.interventions == "on")
        worst = ", ".join(f"{k} {v:.1e}" for k, v in report.worst().items())
        proven = "proven equal to transformers, " if info.get("proof") else ""
        print(f"{Path(args.out).name}: {info['family']} from {args.from_hf} exported to {args.out} ({proven}{worst})")
        return 0

    jobs: list[tuple[str | None, Path]] = []
    if args.checkpoints:
        root = Path(args.checkpoints)
        found = sorted(d for d in root.iterdir() if checkpoint.is_complete(d)) if root.is_dir() else []
        if not found:
            raise PosencError(f"no complete checkpoints under {root}")
        jobs = [(str(d), Path(args.out) / d.name) for d in found]
    else:
        jobs = [(args.checkpoint, Path(args.out))]
    for ck, out in jobs:
        if args.skip_existing and out.exists() and ck and _up_to_date(Path(ck), out, args.attention,
                                                                  args.interventions == "on"):
            print(f"{out.name}: up to date")
            continue
        model, source, training = load_source(ck, args.init, args.variant, args.preset, args.seed)
        report = build_artifact(model, out, name=args.name if args.name and len(jobs) == 1 else out.name,
                                opset=args.opset, source=source, training=training,
                                force=args.force or args.skip_existing, validate=not args.no_validate,
                                attention=args.attention, interventions=args.interventions == "on")
        worst = ", ".join(f"{k} {v:.1e}" for k, v in report.worst().items()) if report else "not validated"
        print(f"{out.name}: exported to {out} ({worst})")
    return 0


def _up_to_date(ck: Path, out: Path, attention: str, interventions: bool) -> bool:
    from model import checkpoint  # lazy: torch (safetensors.torch)

    try:
        artifact.verify(out)
        meta = artifact.read_json(out / artifact.MODEL_JSON)
    except PosencError:
        return False
    want = checkpoint.read_meta(ck)["files"][checkpoint.WEIGHTS]["sha256"]
    # Artifacts from before encoding graphs existed are stale too (model.json has no "encoding").
    # ... and so are artifacts whose attention is written another way than asked.
    # ... and so are artifacts with an intervention graph where none is asked for, or the other way round.
    return (meta.get("source", {}).get("sha256") == want and "encoding" in meta
            and meta.get("attention", "explicit") == attention and ("intervene" in meta) == interventions)


def validate_main(argv: list[str]) -> int:
    from export.validate import report_json, validate_folder  # lazy: torch

    p = Parser(prog="python -m export validate", description="ONNX Runtime vs PyTorch parity.")
    p.add_argument("artifact")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    args = p.parse_args(argv)
    report = validate_folder(args.artifact)
    print(report_json(report) if args.json else report.format_table())
    return 0 if report.passed else 1


def triton_main(argv: list[str]) -> int:
    from export.triton import write_repository  # lazy: the command's own module

    p = Parser(prog="python -m export triton", description="Write a Triton model repository.")
    p.add_argument("artifacts")
    p.add_argument("--out", required=True)
    p.add_argument("--force", action="store_true")
    args = p.parse_args(argv)
    names = write_repository(args.artifacts, args.out, force=args.force)
    print(f"wrote {len(names)} models to {args.out}: {', '.join(names)}")
    return 0


def interventions_option(p: Parser) -> None:
    p.add_argument("--interventions", choices=("on", "off"), default="on",
                   help="the intervention graph beside the model (intervene.onnx: per-request positions, a layer's "
                        "encoding off, heads ablated, another RoPE scaling); default on")


def rope_scale_main(argv: list[str]) -> int:
    from export.build import DEFAULT_OPSET, build_artifact  # lazy: torch
    from export.validate import reference_from_graph  # lazy: torch
    from model import rope_scaling  # lazy: torch
    from model.config import ModelConfig  # lazy: with the command that reads it
    from model.variants import REGISTRY  # lazy: torch

    p = Parser(prog="python -m export rope-scale",
               description="A copy of a rope artifact extended to longer contexts at inference.")
    p.add_argument("artifact", help="a rope artifact folder")
    how = p.add_mutually_exclusive_group(required=True)
    by_factor = [t.name for t in rope_scaling.TYPES.values() if t.by_factor]
    how.add_argument("--method", choices=by_factor,
                     help="linear: position interpolation; ntk: NTK-aware base; dynamic: NTK from the length; "
                          "yarn: YaRN; llama3: Llama 3.1's (with --factor; defaults for the rest)")
    how.add_argument("--rope-scaling", metavar="JSON", help="a rope_parameters object as transformers writes it, "
                     "e.g. '{\"rope_type\": \"yarn\", \"factor\": 4, \"beta_fast\": 16}' (every type)")
    p.add_argument("--factor", type=float, help="with --method: how many times the trained context to reach")
    p.add_argument("--out", required=True)
    p.add_argument("--opset", type=int, default=None, help="default: the source artifact's")
    p.add_argument("--force", action="store_true")
    p.add_argument("--skip-existing", action="store_true", help="keep an output that verifies and matches")
    interventions_option(p)
    args = p.parse_args(argv)
    if args.method and args.factor is None:
        p.error("--method needs --factor")
    if args.rope_scaling is not None and args.factor is not None:
        p.error("--factor goes with --method; put the factor in --rope-scaling's JSON")
    params = ({"rope_type": rope_scaling.get(args.method).rope_type, "factor": args.factor} if args.method
              else rope_scaling.parse_override(args.rope_scaling))
    src, out = Path(args.artifact), Path(args.out)
    manifest = artifact.verify(src)
    meta = artifact.read_json(src / artifact.MODEL_JSON)
    if not getattr(REGISTRY.get(meta.get("variant")), "rope_scaled", False):
        raise PosencError(f"{src} is a {meta.get('variant')} artifact; rope-scale needs a rope one")
    if meta["config"].get("rope_scaling", rope_scaling.NONE) != rope_scaling.NONE:
        raise PosencError(f"{src} is already scaled ({meta['config']['rope_scaling']}); scale the original")
    context = meta["config"]["context"]
    fields = rope_scaling.from_hf(params, max_positions=context, own=True)
    fields["rope_original_context"] = fields["rope_original_context"] or context
    cfg = ModelConfig.from_dict(meta["config"]).replace(**fields)
    source = {"kind": "rope-scaled", "artifact": str(src), "sha256": manifest["files"][artifact.MODEL_ONNX]["sha256"],
              "method": cfg.rope_scaling, "factor": cfg.rope_factor}
    if args.rope_scaling is not None:
        source["rope_scaling"] = params
    if args.skip_existing and out.exists():
        try:
            artifact.verify(out)
            kept = artifact.read_json(out / artifact.MODEL_JSON)
            if kept.get("source") == source and ("intervene" in kept) == (args.interventions == "on"):
                print(f"{out.name}: up to date")
                return 0
        except PosencError:
            pass
    model = reference_from_graph(onnx.load(str(src / artifact.MODEL_ONNX)), cfg)
    training = {"base": meta.get("training") or {}}  # no held-out loss of its own: it was never trained
    report = build_artifact(model, out, name=out.name, opset=args.opset or meta.get("opset", DEFAULT_OPSET),
                            source=source, training=training, force=args.force or args.skip_existing,
                            attention=meta.get("attention", "explicit"), interventions=args.interventions == "on")
    worst = ", ".join(f"{k} {v:.1e}" for k, v in report.worst().items())
    print(f"{out.name}: {cfg.rope_scaling} x{cfg.rope_factor:g} of {src.name} exported to {out} ({worst})")
    return 0


def quantize_main(argv: list[str]) -> int:
    # lazy: onnxruntime.quantization adds 13 MB of RSS to the exporter (measured), for this command alone
    from export.quantize import DEFAULT_BUDGET, MAX_NATS_RATIO, METHODS, MIN_TOP1, quantize_artifact

    p = Parser(prog="python -m export quantize",
               description="An int8 or int4 copy of an artifact (onnxruntime quantization), held to a budget "
                           "against fp32.")
    p.add_argument("artifact", help="an fp32 artifact folder")
    p.add_argument("--out", required=True)
    p.add_argument("--method", choices=METHODS, default="dynamic",
                   help="dynamic: int8 weights per channel, activations quantized per call; int8 / int4: "
                        "weight-only blocks of 32 (MatMulNBits), the fastest on CPU")
    p.add_argument("--corpus", help="UTF-8 file whose last 10%% is the held-out text (default: the built-in one)")
    p.add_argument("--min-top1", type=float, default=None,
                   help=f"budget: least share of held-out positions whose top-1 token equals fp32's (default "
                        f"{MIN_TOP1}; int4: {DEFAULT_BUDGET['int4'][0]})")
    p.add_argument("--max-nats-ratio", type=float, default=None,
                   help=f"budget: most held-out nats/byte may grow over fp32's (default {MAX_NATS_RATIO} = 2%%; "
                        f"int4: {DEFAULT_BUDGET['int4'][1]})")
    p.add_argument("--fast", choices=("auto", "on", "off"), default="auto",
                   help="a quantized fast graph (fused norms, last-position head), held to the same budget: auto "
                        "when the source has a fast graph")
    p.add_argument("--smoothing", choices=("on", "off"), default="on",
                   help="dynamic: move the outlier channels of gated MLPs' down-projection inputs into their weights "
                        "before quantizing (SmoothQuant, calibrated on the corpus's training part)")
    p.add_argument("--force", action="store_true")
    p.add_argument("--skip-existing", action="store_true", help="keep an output that verifies and has this source")
    args = p.parse_args(argv)
    out = Path(args.out)
    if args.skip_existing and out.exists():
        try:
            artifact.verify(out)
            q = artifact.read_json(out / artifact.MODEL_JSON).get("quantization") or {}
            src = artifact.verify(args.artifact)["files"][artifact.MODEL_ONNX]["sha256"]
            if q.get("source_sha256") == src and q.get("method") == args.method:
                print(f"{out.name}: up to date")
                return 0
        except PosencError:
            pass
    report = quantize_artifact(args.artifact, out, args.method, args.force or args.skip_existing, args.corpus,
                               args.min_top1, args.max_nats_ratio, args.fast, args.smoothing == "on")
    figures = "; ".join(f"{r['length']} tokens: top-1 {r['top1_agreement']:.3f}, nats/byte x{r['nats_ratio']:.3f}"
                        for r in report["rows"])
    print(f"{out.name}: {args.method} copy of {Path(args.artifact).name} within budget ({figures})")
    return 0


def models_main(argv: list[str]) -> int:
    from export import pipeline  # lazy: torch (training)

    return pipeline.main(argv, main)  # the pipeline runs export steps through this CLI, handed to it


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("torch.onnx").setLevel(logging.ERROR)  # "torchvision is not installed" noise
    commands = {"validate": validate_main, "triton": triton_main, "rope-scale": rope_scale_main,
                "quantize": quantize_main, "models": models_main}
    if not (argv and argv[0] == "quantize") and importlib.util.find_spec("torch") is None:
        print("posenc-export: error: torch is missing: exporting needs the build extra (pip install "
              "'posenc[build]')", file=sys.stderr)
        return 2
    try:
        if argv and argv[0] in commands:
            return commands[argv[0]](argv[1:])
        return export_main(argv)
    except OSError as err:  # an --out under a file, a folder that cannot be written: nothing was written
        print(f"error: {err.filename}: {err.strerror or err}", file=sys.stderr)
        return 2
    except PosencError as err:
        print(f"error: {str(err).splitlines()[0]}", file=sys.stderr)
        if "\n" in str(err):
            print(str(err).split("\n", 1)[1], file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
