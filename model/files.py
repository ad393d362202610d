"""Files written atomically and checked by digest: the helpers checkpoints and artifacts share.  Standard library
only, so what writes or checks an artifact without a model (quantize, validate) need not import torch."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def umask_mode(mode: int) -> int:
    """`mode` less the process umask: what open()/mkdir() would have given, unlike mkstemp's 0600 / mkdtemp's 0700."""
    current = os.umask(0)
    os.umask(current)
    return mode & ~current


def replace_dir(tmp: Path, final: Path) -> None:
    """Move a finished temporary folder onto `final`, replacing any previous one as late as possible.

    The folder gets ordinary permissions first, so a worker running as another user (the container's) can read it."""
    os.chmod(tmp, umask_mode(0o777))
    old = None
    if final.exists():
        old = final.with_name(f".{final.name}.old-{os.getpid()}")
        os.rename(final, old)
    os.rename(tmp, final)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def atomic_write(path: Path, data: bytes | str) -> None:
    """`data` into `path` through a temporary file beside it and one rename: a reader sees the old file or the new
    one, never half of either.  The folder is made when missing.  Every results file, generated page and report the
    project writes goes through here."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    if isinstance(data, str):
        tmp.write_text(data)
    else:
        tmp.write_bytes(data)
    os.replace(tmp, path)
