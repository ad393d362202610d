"""Artifacts -> Triton model repository for the onnxruntime backend (reference/serving-protocol.md section 10).

<repo>/<name>/config.pbtxt and <repo>/<name>/1/model.onnx.  max_batch_size is 0: the batch dimension is part of
every declared shape (the KV-cache inputs carry it too), with -1 for every variable dimension.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from export import artifact
from export.errors import ExportError

DTYPES = {"int64": "TYPE_INT64", "float32": "TYPE_FP32"}


def _tensor(entry: dict[str, Any]) -> str:
    dims = ", ".join(str(d) if isinstance(d, int) else "-1" for d in entry["shape"])
    return f'  {{ name: "{entry["name"]}"  data_type: {DTYPES[entry["dtype"]]}  dims: [ {dims} ] }}'


def config_pbtxt(meta: dict[str, Any], instances: int = 1) -> str:
    lines = [
        f'name: "{meta["name"]}"',
        'backend: "onnxruntime"',
        'platform: "onnxruntime_onnx"',
        "max_batch_size: 0",
        "input [",
        ",\n".join(_tensor(e) for e in meta["inputs"]),
        "]",
        "output [",
        ",\n".join(_tensor(e) for e in meta["outputs"]),
        "]",
        f"instance_group [ {{ count: {instances}  kind: KIND_CPU }} ]",
        "version_policy: { latest: { num_versions: 1 } }",
        f'parameters {{ key: "posenc_variant"  value: {{ string_value: "{meta["variant"]}" }} }}',
        "",
    ]
    return "\n".join(lines)


def write_repository(artifacts: str | Path, out: str | Path, force: bool = False) -> list[str]:
    """One Triton model per valid artifact under `artifacts`; returns the model names written."""
    artifacts, out = Path(artifacts), Path(out)
    folders = sorted(p for p in artifacts.iterdir() if (p / artifact.MANIFEST).is_file()) if artifacts.is_dir() else []
    if not folders:
        raise ExportError(f"no artifacts (folders with {artifact.MANIFEST}) under {artifacts}")
    with artifact.staging(out, force) as tmp:
        for folder in folders:
            artifact.verify(folder)
            meta = artifact.read_json(folder / artifact.MODEL_JSON)
            (tmp / folder.name / "1").mkdir(parents=True)
            shutil.copyfile(folder / artifact.MODEL_ONNX, tmp / folder.name / "1" / "model.onnx")
            (tmp / folder.name / "config.pbtxt").write_text(config_pbtxt({**meta, "name": folder.name}))
    return [f.name for f in folders]
