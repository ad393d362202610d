"""Checkpoints: safetensors weights + JSON (config, training summary, sha256 of the weights).

Nothing is pickled.  A checkpoint is written into a temporary sibling folder and renamed into place, so a
reader sees either the old checkpoint or the new one, never half of one.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from model.config import ModelConfig
from model.errors import CheckpointError, ConfigError
from model.files import replace_dir, sha256_file
from model.transformer import Transformer

WEIGHTS = "model.safetensors"
META = "checkpoint.json"
FORMAT = "posenc-checkpoint/1"


def save(model: Transformer, out: str | Path, training: dict[str, Any] | None = None) -> Path:
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
        save_file(state, tmp / WEIGHTS, metadata={"format": FORMAT})
        meta = {
            "format": FORMAT,
            "config": model.cfg.to_dict(),
            "training": training or {},
            "files": {WEIGHTS: {"sha256": sha256_file(tmp / WEIGHTS), "size": (tmp / WEIGHTS).stat().st_size}},
        }
        (tmp / META).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
        replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def read_meta(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} does not exist or is not a folder")
    for name in (META, WEIGHTS):
        if not (path / name).is_file():
            raise CheckpointError(f"checkpoint {path} is missing {name}")
    try:
        meta = json.loads((path / META).read_text())
    except (ValueError, UnicodeDecodeError) as err:
        raise CheckpointError(f"checkpoint {path}: {META} is not valid JSON ({err})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint {path}: {META} is not a {FORMAT} file")
    return meta


def load(path: str | Path) -> tuple[Transformer, dict[str, Any]]:
    """Model (eval mode) and the checkpoint's metadata; verifies the weights' checksum first."""
    path = Path(path)
    meta = read_meta(path)
    expected = meta.get("files", {}).get(WEIGHTS, {}).get("sha256")
    if expected != sha256_file(path / WEIGHTS):
        raise CheckpointError(f"checkpoint {path}: {WEIGHTS} does not match its sha256 (corrupted or replaced)")
    try:
        cfg = ModelConfig.from_dict(meta["config"])
    except (ConfigError, KeyError, TypeError) as err:
        raise CheckpointError(f"checkpoint {path}: bad config: {err}") from None
    model = Transformer(cfg)
    try:
        state = load_file(path / WEIGHTS)
        model.load_state_dict(state, strict=True)
    except (SafetensorError, RuntimeError, OSError) as err:
        raise CheckpointError(f"checkpoint {path}: weights do not fit the config: {err}") from None
    return model.eval(), meta


def summary(path: str | Path) -> dict[str, Any]:
    return read_meta(path).get("training", {})


def is_complete(path: str | Path) -> bool:
    try:
        read_meta(path)
    except CheckpointError:
        return False
    return True


__all__ = ["save", "load", "read_meta", "summary", "is_complete", "sha256_file", "replace_dir"]
