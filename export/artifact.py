"""The artifact folder (ARCHITECTURE.md section 4): model.onnx, model.json, manifest.json.

manifest.json holds the sha256 and size of every other file, the tool versions and the validation report.
model.json is checked against protos/model.schema.json, the schema the worker reads it by, whenever it is written.
Artifacts are assembled in a temporary sibling folder and renamed into place, so a reader never sees half of one.
"""

from __future__ import annotations

import functools
import json
import platform
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any

import fastjsonschema

import protos
from export.errors import ArtifactError, ExportError
from model.files import replace_dir, sha256_file

MODEL_ONNX, MODEL_JSON, MANIFEST = "model.onnx", "model.json", "manifest.json"
MODEL_DATA = "model.onnx.data"  # the graph's weights, when they pass protobuf's 2 GB (model.json onnx_external_data)
TOKENIZER_JSON = "tokenizer.json"  # an imported model's own tokenizer (model.json tokenizer.type HF_TOKENIZER)
HF_TOKENIZER = "huggingface-tokenizers"
FORMAT = "posenc-artifact/1"
MODEL_SCHEMA = Path(protos.__file__).parent / "model.schema.json"  # model.json's one description


def tool_versions() -> dict[str, str]:
    """The versions of the tools an artifact was written with.  torch's and onnxscript's are read from their
    installed distributions (the same strings as their __version__), so writing a manifest does not import them:
    torch is about 1.4 s of a `quantize` process's start, onnxscript 92 MB of RSS."""
    # lazy: onnxruntime adds 36 MB of RSS to a process (measured) and onnx 28; this module is also imported only to
    # read and verify artifacts, which needs neither
    import onnx
    import onnxruntime

    return {"python": platform.python_version(), "torch": metadata.version("torch"), "onnx": onnx.__version__,
            "onnxscript": metadata.version("onnxscript"), "onnxruntime": onnxruntime.__version__}


def write_json(path: Path, data: Any) -> None:
    """JSON as every artifact file is written; a model.json is first checked against its schema."""
    if path.name == MODEL_JSON:
        check_model_json(data, path)
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


@functools.cache
def _model_schema() -> Callable[[Any], Any]:
    return fastjsonschema.compile(json.loads(MODEL_SCHEMA.read_text()))


def check_model_json(meta: Any, path: Path | str = MODEL_JSON) -> None:
    """ArtifactError naming the field, when `meta` is not a model.json that protos/model.schema.json allows (a
    field it does not declare included: a new field is declared there first, ARCHITECTURE.md section 4)."""
    try:
        _model_schema()(meta)
    except fastjsonschema.JsonSchemaValueException as err:
        where = (err.name or "data").removeprefix("data").lstrip(".")
        what = f"{err.message.removeprefix(err.name or '').strip()} (protos/model.schema.json)"
        raise ArtifactError(f"{path}: {where} {what}" if where else f"{path} {what}") from None


def write_manifest(folder: Path, validation: dict[str, Any] | None) -> dict[str, Any]:
    files = {p.name: {"sha256": sha256_file(p), "size": p.stat().st_size}
             for p in sorted(folder.iterdir()) if p.is_file() and p.name != MANIFEST}
    manifest = {"format": FORMAT, "created": datetime.now(UTC).isoformat(timespec="seconds"),
                "files": files, "tools": tool_versions(), "validation": validation}
    write_json(folder / MANIFEST, manifest)
    return manifest


def read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ArtifactError(f"{path.parent} is missing {path.name}") from None
    except (ValueError, UnicodeDecodeError) as err:
        raise ArtifactError(f"{path} is not valid JSON ({err})") from None
    if not isinstance(data, dict):
        raise ArtifactError(f"{path} is not a JSON object")
    return data


def verify(folder: str | Path) -> dict[str, Any]:
    """Check every file against the manifest; returns the manifest.  A flipped byte is an ArtifactError."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ArtifactError(f"artifact {folder} does not exist or is not a folder")
    manifest = read_json(folder / MANIFEST)
    if manifest.get("format") != FORMAT:
        raise ArtifactError(f"{folder / MANIFEST} is not a {FORMAT} manifest")
    files = manifest.get("files") or {}
    for required in (MODEL_ONNX, MODEL_JSON):
        if required not in files:
            raise ArtifactError(f"{folder / MANIFEST} does not list {required}")
    for name, entry in files.items():
        path = folder / name
        if Path(name).name != name or not path.is_file():
            raise ArtifactError(f"artifact {folder} is missing {name}")
        if path.stat().st_size != entry.get("size") or sha256_file(path) != entry.get("sha256"):
            raise ArtifactError(f"artifact {folder}: {name} does not match its manifest sha256 (corrupted)")
    meta = read_json(folder / MODEL_JSON)
    check_model_json(meta, folder / MODEL_JSON)
    fast = meta.get("fast") or {}
    for needed in (meta.get("onnx_external_data"), (meta.get("tokenizer") or {}).get("file"), fast.get("file"),
                   fast.get("external_data")):
        if needed and needed not in files:  # model.json names it: the manifest must cover it
            raise ArtifactError(f"{folder / MANIFEST} does not list {needed}, which {MODEL_JSON} uses")
    return manifest


@contextmanager
def staging(out: Path, force: bool) -> Iterator[Path]:
    """A temporary folder beside `out`, renamed onto it when the block succeeds and removed when it fails."""
    if out.exists() and not force:
        raise ExportError(f"{out} already exists; pass --force to replace it")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        yield tmp
        replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
