"""model.json as typed objects, read once at load (ARCHITECTURE.md section 4).

protos/model.schema.json is the one description of the file: the exporter validates what it writes against it, and
`parse` validates what the worker loads against it, then builds the frozen dataclasses below, whose fields are the
schema's properties under the same names (tests/service/test_model_json.py holds the two together, defaults
included).  An artifact that does not match is refused in one line naming the field."""

from __future__ import annotations

import dataclasses
import functools
import json
import types
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Protocol, TypeVar, Union, get_args, get_origin, get_type_hints

import fastjsonschema

import protos
from service.errors import ArtifactRejected

SCHEMA = Path(protos.__file__).parent / "model.schema.json"
# Artifacts without `whole_prompts`: the RoPE scalings whose frequencies follow the length (model/rope_scaling/)
LEGACY_WHOLE_PROMPTS = ("dynamic", "longrope")

Dim = int | str  # a fixed size, or a symbolic dimension's name
_hints = functools.cache(get_type_hints)  # a class's annotations resolved once: every artifact load reads them


class _Dataclass(Protocol):
    __dataclass_fields__: ClassVar[dict[str, Any]]


T = TypeVar("T", bound=_Dataclass)


@dataclass(frozen=True)
class Sizes:
    vocab_size: int
    d_model: int
    n_heads: int
    n_layers: int
    head_dim: int
    n_kv_heads: int = 0  # 0: n_heads
    d_mlp: int | None = None
    parameters: int = 0

    @property
    def kv_heads(self) -> int:
        """Key/value heads of the KV cache: fewer than n_heads under grouped-query attention."""
        return self.n_kv_heads or self.n_heads


@dataclass(frozen=True)
class Tensor:
    name: str
    shape: tuple[Dim, ...]
    dtype: str | None = None


@dataclass(frozen=True)
class Carried:
    """One tensor of decoding state: fed to `input`, read back from `output` after the call."""

    input: str
    output: str
    sequence_axis: int | None = None  # None: a fixed-size state of its own shape
    shape: tuple[Dim, ...] | None = None


@dataclass(frozen=True)
class LayerRope:
    base: float
    scaling: str
    factor: float


@dataclass(frozen=True)
class LayerTemperature:
    floor: float
    scale: float


@dataclass(frozen=True)
class Layer:
    attention: str
    encoding: str
    window: int | None = None
    chunk: int | None = None
    temperature: LayerTemperature | None = None
    softcap: float | None = None
    sinks: bool = False
    rope: LayerRope | None = None
    mixer: str = "attention"  # short_conv, mamba2, gated_deltanet, none: rows are its matrix (docs/mixers.md)
    kernel: int | None = None
    beside: str = "none"  # mamba2: a Mamba-2 layer beside the attention (Falcon-H1); the maps are the attention's


@dataclass(frozen=True)
class ChatTemplateEntry:
    template: str
    file: str | None = None
    sha256: str | None = None
    tokens: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class TokenizerEntry:
    type: str = "bytes-utf8"
    vocab_size: int | None = None
    file: str | None = None
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] | None = None
    chat_template: ChatTemplateEntry | None = None

    @property
    def eos(self) -> frozenset[int]:
        """The ids generation stops at: eos_token_ids, else eos_token_id; none for byte models."""
        if self.eos_token_ids is not None:
            return frozenset(self.eos_token_ids)
        return frozenset() if self.eos_token_id is None else frozenset([self.eos_token_id])


@dataclass(frozen=True)
class Proof:
    """An imported model's proof at import: it against transformers' own model of its folder (export/proof.py)."""

    reference: str  # transformers' version, attention implementation and dtype
    importer: str  # "module" (a family module) or "generic" (the generic import)
    passed: bool
    logits: float  # the largest logit difference
    lengths: tuple[int, ...] | None = None
    decode_steps: int | None = None
    cases: int | None = None
    attentions: float | None = None  # the largest attention difference; None: the reference returned no maps
    tolerance: Mapping[str, float] | None = None


@dataclass(frozen=True)
class Source:
    kind: str
    path: str | None = None
    sha256: str | None = None
    preset: str | None = None
    seed: int | None = None
    family: str | None = None
    architectures: tuple[str, ...] = ()
    config_sha256: str | None = None
    rope_scaling: Mapping[str, Any] | None = None
    artifact: str | None = None
    method: str | None = None
    factor: float | None = None
    proof: Proof | None = None


@dataclass(frozen=True)
class EncodingOutput:
    name: str
    shape: tuple[Dim, ...]
    dtype: str | None = None
    constant_input: bool = False
    probe_query: bool = False


@dataclass(frozen=True)
class Encoding:
    file: str | None
    input: Tensor
    outputs: tuple[EncodingOutput, ...]
    note: str = ""


@dataclass(frozen=True)
class Parity:
    max_abs_diff: float
    tolerance: float
    case: str | None = None


@dataclass(frozen=True)
class Smoothing:
    """A dynamic int8 copy's smoothing before quantization (export/smooth.py)."""

    method: str | None = None
    alpha: float | None = None
    activations: int | None = None
    calibration_tokens: int | None = None
    input_max_over_median: float | None = None


@dataclass(frozen=True)
class Half:
    """The fast graph's float16 copy (export/half.py): served under --provider cuda, its KV cache float16."""

    file: str
    budget: Budget
    external_data: str | None = None
    kept_float32: int | None = None
    round_trips_dropped: int | None = None


@dataclass(frozen=True)
class Fast:
    file: str
    source_sha256: str
    layout: str = "padded"
    logits_positions: str | None = None
    external_data: str | None = None
    tied_table_once: bool = False
    fused: Mapping[str, int] = field(default_factory=dict)
    nodes: int | None = None
    parity: Parity | None = None
    budget: Budget | None = None  # a quantized copy's fast graph: held to the copy's accuracy budget
    smoothing: Smoothing | None = None
    half: Half | None = None


@dataclass(frozen=True)
class Profile:
    """The profile graph (export/profile.py): per query row, layer and head, the columns named in `columns`."""

    file: str
    output: str
    buckets: int
    columns: tuple[str, ...]
    source_sha256: str
    shape: tuple[Dim, ...] = ()


@dataclass(frozen=True)
class Intervene:
    """The intervention graph (export/intervene.py) and what a request may change with it."""

    file: str
    profile_file: str
    inputs: tuple[Tensor, ...]
    positions: bool  # a request may give positions (the encoding is a function of the index)
    in_layers: bool  # a request may switch a layer's encoding off (it acts inside the layers)
    rope: bool  # a request may give another RoPE scaling
    rope_pairs: int
    source_sha256: str
    shared_weights: int = 0
    parity: Mapping[str, float] = field(default_factory=dict)
    trained_context: int = 0
    maps_file: str = ""  # intervene_maps.onnx: one output more, mixer_maps (docs/mixers.md); "" without mixers
    maps_profile_file: str = ""  # intervene_maps_profile.onnx: mixer_maps reduced to profiles
    maps_layers: tuple[int, ...] = ()  # mixer_maps' layers, in its order
    maps_heads: tuple[int, ...] = ()  # how many of each one's rows are its own (the rest zeros)


@dataclass(frozen=True)
class BudgetRow:
    length: int | None = None
    positions: int | None = None
    top1_agreement: float | None = None
    nats_per_byte_fp32: float | None = None
    nats_per_byte_int8: float | None = None
    nats_ratio: float | None = None


@dataclass(frozen=True)
class Budget:
    min_top1_agreement: float | None = None
    max_nats_ratio: float | None = None
    passed: bool | None = None
    rows: tuple[BudgetRow, ...] = ()


@dataclass(frozen=True)
class Quantization:
    method: str
    weights: str | None = None
    ops: tuple[str, ...] = ()
    source: str | None = None
    source_sha256: str | None = None
    smoothing: Smoothing | None = None
    budget: Budget | None = None


@dataclass(frozen=True)
class ModelJson:
    """An artifact's model.json.  `config` and `training` are open objects (model/config.py's ModelConfig, the
    training summary), kept as read."""

    variant: str
    sizes: Sizes
    inputs: tuple[Tensor, ...]
    outputs: tuple[Tensor, ...]
    state: tuple[Carried, ...]
    whole_prompts: bool  # absent in older artifacts: parse applies LEGACY_WHOLE_PROMPTS
    format: str | None = None
    name: str | None = None
    config: Mapping[str, Any] = field(default_factory=dict)
    layers: tuple[Layer, ...] = ()
    tokenizer: TokenizerEntry = field(default_factory=TokenizerEntry)
    max_positions: int | None = None
    trained_context: int = 0
    opset: int | None = None
    attention: str = "explicit"
    source: Source | None = None
    training: Mapping[str, Any] = field(default_factory=dict)
    heldout_loss: float | None = None
    onnx_external_data: str | None = None
    encoding: Encoding | None = None  # absent: exported before encoding graphs (the Encoding RPC says so)
    fast: Fast | None = None
    profile: Profile | None = None  # absent: no profile graph (the Profile RPC says so: FAILED_PRECONDITION)
    intervene: Intervene | None = None  # absent: exported without interventions (or a quantized copy)
    quantization: Quantization | None = None
    validation_max_length: int | None = None
    family: str | None = None
    max_model_len: int | None = None

    @property
    def whole_maps(self) -> bool:
        """Whether a prompt's maps need it in one call: a Mamba-2 or Gated DeltaNet layer's rows span only their call's
        keys (what came before reaches them through the carried state, which has no keys)."""
        return any(layer.mixer in ("mamba2", "gated_deltanet") for layer in self.layers)

    @property
    def sink_layers(self) -> frozenset[int]:
        """The layers with learned attention sinks (their maps sum to 1 - the sink's mass)."""
        return frozenset(i for i, layer in enumerate(self.layers) if layer.sinks)


@functools.cache
def schema() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(SCHEMA.read_text())
    return loaded


@functools.cache
def _validator() -> Any:
    return fastjsonschema.compile(schema())


def check(data: object) -> None:
    """ArtifactRejected in one line naming the field, when `data` is not a model.json the schema allows."""
    try:
        _validator()(data)
    except fastjsonschema.JsonSchemaValueException as err:
        where = (err.name or "data").removeprefix("data").lstrip(".")
        what = err.message.removeprefix(err.name or "").strip()
        raise ArtifactRejected(f"model.json: {where} {what}" if where else f"model.json {what}") from None


def parse(data: object) -> ModelJson:
    """A model.json's content checked against the schema and read into a ModelJson."""
    check(data)
    if not isinstance(data, dict):  # the schema refuses it first
        raise ArtifactRejected("model.json is not a JSON object")
    if "whole_prompts" not in data:  # older artifacts: the rule the exporter now writes down
        data = {**data, "whole_prompts": (data.get("config") or {}).get("rope_scaling") in LEGACY_WHOLE_PROMPTS}
    return typed(ModelJson, data)


def read_object(path: Path) -> dict[str, Any]:
    """An artifact's JSON file as an object (missing, not JSON, not an object: ArtifactRejected naming it)."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ArtifactRejected(f"missing {path.name}") from None
    except (ValueError, UnicodeDecodeError) as err:
        raise ArtifactRejected(f"{path.name} is not valid JSON: {err}") from None
    if not isinstance(data, dict):
        raise ArtifactRejected(f"{path.name} is not a JSON object")
    return data


def read(path: Path) -> ModelJson:
    """A model.json file, parsed (missing, not JSON: ArtifactRejected)."""
    return parse(read_object(path))


def typed(cls: type[T], data: Mapping[str, Any]) -> T:
    """One of this module's dataclasses from validated JSON: each field from the key of its name (absent: the
    field's default), nested dataclasses and tuples built by the field's annotation."""
    values = {f.name: _value(_hints(cls)[f.name], data[f.name]) for f in dataclasses.fields(cls) if f.name in data}
    return cls(**values)


def _value(hint: Any, raw: Any) -> Any:
    if raw is None:
        return None
    origin, args = get_origin(hint), get_args(hint)
    if origin in (Union, types.UnionType):  # X | None: X; int | str (a Dim): as read
        inner = [a for a in args if a is not type(None)]
        return _value(inner[0], raw) if len(inner) == 1 else raw
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return typed(hint, raw)
    if origin is tuple:
        return tuple(_value(args[0], v) for v in raw)
    if origin is Mapping:
        return dict(raw)
    if hint is float:
        return float(raw)  # JSON writes 1.0 as 1 where a writer gave an int
    return raw
