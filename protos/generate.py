"""Regenerate the Python stubs from the .proto sources: `python -m protos.generate [--out DIR]`.

The stubs are committed; tests/test_protos.py regenerates into a temporary folder and fails if anything differs.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent  # imports in the stubs are rooted at the repository: protos.*


def sources() -> list[Path]:
    return sorted((ROOT / "protos").rglob("*.proto"))


def generate(out: Path) -> list[Path]:
    # lazy: build-time only: grpcio-tools is not a worker requirement (the worker imports the generated code), and
    # it costs 11 MB of RSS to import (measured)
    from grpc_tools import protoc

    include = Path(protoc.__file__).parent / "_proto"
    args = ["protoc", f"-I{ROOT}", f"-I{include}", f"--python_out={out}", f"--grpc_python_out={out}"]
    args += [str(p.relative_to(ROOT)) for p in sources()]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    return sorted((out / "protos").rglob("*_pb2*.py"))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m protos.generate", description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(ROOT), help="output root (default: the repository)")
    args = p.parse_args(argv)
    for path in generate(Path(args.out)):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
