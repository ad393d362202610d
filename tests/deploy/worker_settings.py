"""The POSENC_* variables the worker reads, as its own `--help` lists them (and, for a parser that does not list
them there, as its source names them): manifests may set only these."""

from __future__ import annotations

import functools
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


@functools.cache
def known_variables() -> frozenset[str]:
    out = subprocess.run([sys.executable, "-m", "service", "--help"], capture_output=True, text=True, cwd=ROOT,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    names = set(re.findall(r"\bPOSENC_[A-Z0-9_]+", out.stdout))
    main = (ROOT / "service" / "__main__.py").read_text()
    names |= {f"POSENC_{n}" for n in re.findall(r'env\("([A-Z_]+)"', main) + re.findall(r'"POSENC_([A-Z_]+)"', main)}
    return frozenset(names)


@functools.cache
def healthcheck_variables() -> frozenset[str]:
    """The POSENC_* variables the image's healthcheck reads (its --help names them)."""
    out = subprocess.run([sys.executable, "-m", "service.healthcheck", "--help"], capture_output=True, text=True,
                         cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    return frozenset(re.findall(r"\bPOSENC_[A-Z0-9_]+", out.stdout))
