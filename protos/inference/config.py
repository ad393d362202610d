"""One builder for a model's KServe / Triton `ModelConfig` (hand-written; the rest of protos/ is generated).

The exporter writes it as a Triton repository's `config.pbtxt` (export.triton) and the worker answers it to the
KServe ModelConfig RPC (service.kserve), so both say the same thing about the same artifact.  It takes plain
values, not an artifact, so neither side imports the other.

Triton's default version policy (the latest version) applies.  max_batch_size is 0: the batch
dimension is part of every declared shape (the KV-cache inputs carry it too), -1 for every variable dimension.
Every input but `input_ids` is declared optional (a request may leave out the mask and the past state).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from google.protobuf import text_format

from protos.inference import model_config_pb2 as mc

# numpy / model.json names and KServe wire names -> the config's DataType
DTYPES = {"int64": mc.TYPE_INT64, "float32": mc.TYPE_FP32, "INT64": mc.TYPE_INT64, "FP32": mc.TYPE_FP32}
REQUIRED = ("input_ids",)


@dataclass(frozen=True)
class Tensor:
    name: str
    dtype: str  # "int64" / "float32" (model.json) or "INT64" / "FP32" (KServe)
    dims: Sequence[int | str]  # full shape; a name or None (a symbolic dimension) becomes -1

    def resolved(self) -> list[int]:
        return [d if isinstance(d, int) and d >= 0 else -1 for d in self.dims]


def model_config(name: str, variant: str, inputs: Iterable[Tensor], outputs: Iterable[Tensor],
                 instances: int = 1) -> mc.ModelConfig:
    cfg = mc.ModelConfig(name=name, platform="onnxruntime_onnx", backend="onnxruntime", max_batch_size=0)
    for t in inputs:
        cfg.input.append(mc.ModelInput(name=t.name, data_type=DTYPES[t.dtype], dims=t.resolved(),
                                       optional=t.name not in REQUIRED))
    for t in outputs:
        cfg.output.append(mc.ModelOutput(name=t.name, data_type=DTYPES[t.dtype], dims=t.resolved()))
    cfg.instance_group.append(mc.ModelInstanceGroup(count=instances, kind=mc.ModelInstanceGroup.KIND_CPU))
    cfg.parameters["posenc_variant"].string_value = variant
    return cfg


def to_pbtxt(cfg: mc.ModelConfig) -> str:
    """Protobuf text format, as Triton reads config.pbtxt (defaults such as max_batch_size 0 are left out)."""
    return text_format.MessageToString(cfg)


def from_pbtxt(text: str) -> mc.ModelConfig:
    return text_format.Parse(text, mc.ModelConfig())
