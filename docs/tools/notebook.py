"""make notebook: docs/notebooks/positional-encodings.ipynb run against a real worker and saved with its outputs.

The worker serves ./artifacts when `make models` has built every default model there.  Otherwise it serves models
made here under --work (kept, so a second run only verifies them):
  - every variant at the tiny preset, briefly trained (python -m model.train --preset tiny --steps N), exported and
    validated (python -m export --checkpoint ...);
  - a small LLaMA trained at 64 tokens with transformers, saved as a Hugging Face folder and imported with
    python -m export --from-hf (the tokenizer and the training of lab/experiments/scaling.py).
The worker runs with --long-context 1, so that the imported model takes positions past its own length (the notebook's
shift sweep and its scaling comparison ask for them).  The notebook runs in a fresh kernel of this interpreter
(nbclient, ipykernel's python3 kernel) with POSENC_TARGET set to the worker, and is written back atomically only when
every cell ran without an error.
  python -m docs.tools.notebook [--artifacts DIR] [--work DIR] [--steps N] [--llama-steps N] [--notebook PATH]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

import nbformat
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

from model.corpus import train_text

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOK = ROOT / "docs" / "notebooks" / "positional-encodings.ipynb"
IMPORTED = "llama"  # the imported model's name when the notebook's models are made here


def execute(path: Path, target: str, timeout: float = 600.0, env: dict[str, str] | None = None):
    """The notebook at `path`, run top to bottom in a new kernel whose POSENC_TARGET is `target` (the kernel's working
    folder: the notebook's own); raises nbclient's CellExecutionError at the first cell that fails."""
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, timeout=timeout, kernel_name="python3", record_timing=False,
                            resources={"metadata": {"path": str(path.parent)}})
    client.execute(env={**os.environ, **(env or {}), "POSENC_TARGET": target})
    return nb


def write_atomic(path: Path, nb) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    nbformat.write(nb, tmp)
    tmp.replace(path)


def complete(folder: Path) -> bool:
    return (folder / "manifest.json").is_file()


def default_models(artifacts: Path) -> list[Path] | None:
    """`make models`' artifacts, when every default variant is there."""
    # lazy: torch (213 MB) and onnxscript (92 MB) load only when models are made here, not when ./artifacts serves
    from model.variants import VARIANT_NAMES

    folders = [artifacts / v for v in VARIANT_NAMES]
    if not all(complete(f) for f in folders):
        return None
    return sorted(p for p in artifacts.iterdir() if p.is_dir() and not p.name.startswith(".") and complete(p))


def tiny_models(work: Path, steps: int) -> list[Path]:
    # lazy: torch (213 MB) and onnxscript (92 MB) load only when models are made here, not when ./artifacts serves
    from export.__main__ import main as export
    from model import train
    from model.variants import VARIANT_NAMES

    checkpoints, out = work / "checkpoints", work / "artifacts"
    if train.main(["--variant", "all", "--preset", "tiny", "--steps", str(steps), "--out", str(checkpoints),
                   "--skip-existing", "--quiet"]):
        raise SystemExit("training the tiny models failed")
    for variant in VARIANT_NAMES:
        if export(["--checkpoint", str(checkpoints / variant), "--out", str(out / variant), "--skip-existing"]):
            raise SystemExit(f"exporting the tiny {variant} model failed")
    return [out / v for v in VARIANT_NAMES]


def imported_model(work: Path, steps: int) -> Path:
    # lazy: torch (213 MB) and onnxscript (92 MB) load only when models are made here, not when ./artifacts serves
    from export.__main__ import main as export
    from lab.experiments.scaling import save_folder, train_model, train_tokenizer

    folder, out = work / "hf-llama", work / "imported" / IMPORTED
    if complete(out):
        return out
    text = train_text()
    tok = train_tokenizer(text)
    model, _ = train_model(tok, text, steps)
    save_folder(model, tok, folder)
    if export(["--from-hf", str(folder), "--out", str(out), "--force"]):
        raise SystemExit("importing the LLaMA folder failed")
    return out


def model_dir(work: Path, folders: list[Path]) -> Path:
    """A folder of links to the artifacts to serve (the worker serves every folder in its --model-dir)."""
    serve = work / "serve"
    shutil.rmtree(serve, ignore_errors=True)
    serve.mkdir(parents=True)
    for f in folders:
        (serve / f.name).symlink_to(f.resolve(), target_is_directory=True)
    return serve


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m docs.tools.notebook", description=__doc__.splitlines()[0])
    p.add_argument("--artifacts", default="artifacts", help="make models' folder, served when it is complete")
    p.add_argument("--work", default="build/notebook", help="where the models made here go (kept between runs)")
    p.add_argument("--steps", type=int, default=200, help="training steps of each tiny model")
    p.add_argument("--llama-steps", type=int, default=300, help="training steps of the imported LLaMA")
    p.add_argument("--notebook", default=str(NOTEBOOK))
    args = p.parse_args(argv)
    notebook, work = Path(args.notebook), Path(args.work)
    if not notebook.is_file():
        p.error(f"no notebook at {notebook}")
    if args.steps <= 0 or args.llama_steps <= 0:
        p.error("--steps and --llama-steps must be positive")

    # lazy: the worker loads only once the models are ready
    from service.server import Server
    from service.settings import Limits, Settings

    folders = default_models(Path(args.artifacts))
    if folders is None:
        print(f"{args.artifacts} does not hold every default model (make models): making tiny ones in {work}",
              file=sys.stderr)
        folders = tiny_models(work, args.steps)
    folders.append(imported_model(work, args.llama_steps))
    server = Server(Settings(model_dir=model_dir(work, folders), host="127.0.0.1", port=0, threads=2,
                             metrics_port=-1, http_port=-1, limits=Limits(long_context=True))).start()
    try:
        nb = execute(notebook, f"127.0.0.1:{server.port}")
    except CellExecutionError as err:
        print(f"the notebook failed; {notebook} is unchanged:\n{err}", file=sys.stderr)
        return 1
    finally:
        server.stop(grace=1)
    write_atomic(notebook, nb)
    print(f"wrote {notebook} with its outputs ({len(folders)} models)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
