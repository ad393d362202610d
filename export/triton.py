"""Artifacts -> Triton model repository for the onnxruntime backend (docs/design.md, "Triton's model repository").

<repo>/<name>/config.pbtxt and <repo>/<name>/1/model.onnx.  config.pbtxt is the ModelConfig of
protos.inference.config (the builder the worker's KServe ModelConfig answer uses too), in protobuf text format.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from export import artifact
from export.errors import ExportError
from protos.inference.config import Tensor, model_config, to_pbtxt


def config_pbtxt(meta: dict[str, Any], instances: int = 1) -> str:
    """The artifact's whole graph signature (KV state included), every input but input_ids optional."""
    tensors = [[Tensor(e["name"], e["dtype"], e["shape"]) for e in meta[k]] for k in ("inputs", "outputs")]
    return to_pbtxt(model_config(meta["name"], meta["variant"], *tensors, instances=instances))


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
            data = meta.get("onnx_external_data")
            if data:  # the weights beside the graph, where onnxruntime looks for them
                shutil.copyfile(folder / data, tmp / folder.name / "1" / data)
            (tmp / folder.name / "config.pbtxt").write_text(config_pbtxt({**meta, "name": folder.name}))
    return [f.name for f in folders]
