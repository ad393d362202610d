"""`python -m export models`: train (where the checkpoint is absent), export and validate every default model,
one model at a time, so each artifact lands in the output folder as soon as it is ready.

The default model (rope) comes first and its three rope-scaled copies straight after it; then the others, shortest
training first (model.train.build_order).  Each step is the same command `make models` always ran, called in this
one process (python -m model.train --variant V --skip-existing, python -m export --checkpoint ... --skip-existing,
python -m export rope-scale ... --skip-existing): the models, their training and their artifacts are exactly what
those commands write.  Every artifact is assembled in a hidden folder and renamed into place, so a worker watching
the folder (python -m service --watch-seconds N, which `make serve` runs beside this) never sees half of one.
A model that fails is reported and the others are still built; the exit status is then 1.
"""

from __future__ import annotations

import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

from model import train
from model.cli import Parser
from model.variants import VARIANT_NAMES

# The scaled copies of the default rope model that `make models` has always written: (name, method, factor).
ROPE_COPIES = (("rope-pi8", "linear", 8), ("rope-ntk8", "ntk", 8), ("rope-yarn8", "yarn", 8))


def steps(checkpoints: Path, out: Path, quiet: bool) -> list[tuple[str, str, list[str]]]:
    """(model, what, argv) for every command of the build, in order; argv[0] names the CLI."""
    plan = []
    for variant in train.build_order(list(VARIANT_NAMES)):
        ck, art = checkpoints / variant, out / variant
        plan.append((variant, "train", ["train", "--variant", variant, "--out", str(checkpoints), "--skip-existing",
                                        *(["--quiet"] if quiet else [])]))
        plan.append((variant, "export", ["export", "--checkpoint", str(ck), "--out", str(art), "--skip-existing"]))
        if variant == train.FIRST:
            for name, method, factor in ROPE_COPIES:
                plan.append((name, "rope-scale", ["rope-scale", str(art), "--method", method, "--factor",
                                                  str(factor), "--out", str(out / name), "--skip-existing"]))
    return plan


def run_step(argv: list[str], export_cli: Callable[[list[str]], int]) -> int:
    """One step: training here, an export step through the exporter's CLI (its `main`, handed in by it)."""
    if argv[0] == "train":
        return train.main(argv[1:])
    return export_cli(argv[1:] if argv[0] == "export" else argv)


def main(argv: list[str], export_cli: Callable[[list[str]], int]) -> int:
    """`python -m export models`; export_cli is the exporter's own entry point (export.__main__.main), which
    dispatches here: passed in, so this module imports nothing of it and the two form no cycle."""
    p = Parser(prog="python -m export models", description="Train (where absent), export and validate every default "
               "model one at a time, the default rope model and its scaled copies first.")
    p.add_argument("--checkpoints", default="checkpoints", help="checkpoint folder (trained into where absent)")
    p.add_argument("--out", default="artifacts", help="artifact folder")
    p.add_argument("--quiet", action="store_true", help="no training progress bars (make serve: the worker's log "
                                                        "shares the terminal)")
    args = p.parse_args(argv)
    # SIGTERM (make serve's worker has stopped) ends the build like Ctrl-C: staging folders are removed.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    start, failed = time.perf_counter(), []
    for model, what, step in steps(Path(args.checkpoints), Path(args.out), args.quiet):
        if model in failed or (what == "rope-scale" and train.FIRST in failed):
            continue
        try:
            status = run_step(step, export_cli)
        except Exception as err:  # an exporter or onnxruntime error the CLIs do not turn into a status
            print(f"models: {what} {model}: {type(err).__name__}: {err}", file=sys.stderr, flush=True)
            status = 1
        if status != 0:
            print(f"models: {what} {model} failed (the others are still built)", file=sys.stderr, flush=True)
            failed.append(model)
    took = time.perf_counter() - start
    if failed:
        print(f"models: failed: {', '.join(failed)} ({took:.0f} s)", file=sys.stderr)
        return 1
    print(f"models: every model is in {args.out} ({took:.0f} s)", flush=True)
    return 0
