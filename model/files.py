"""Files written atomically and checked by digest: the helpers checkpoints and artifacts share.  Standard library
only, so what writes or checks an artifact without a model (quantize, validate) need not import torch."""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
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
    one, never half of either, and writers at once (processes, threads) each rename a whole file of their own (the
    last one wins).  The folder is made when missing; the file gets the mode a plain write would give it.  Every
    results file, generated page, report and cached graph the project writes alone goes through here."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
        os.chmod(name, umask_mode(0o666))
        os.replace(name, path)
    except BaseException:
        Path(name).unlink(missing_ok=True)
        raise
