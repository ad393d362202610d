"""Loading artifacts (ARCHITECTURE.md section 4) without torch: manifest hashes, model.json, an onnxruntime session.
The export package writes these folders; the worker shares the files, not the code."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import onnxruntime as ort

from model.files import sha256_file
from service import model_json, ortenv, tokenizer
from service.errors import ArtifactRejected
from service.kvcache import Codec, KVSpec, Layout
from service.layouts import LAYOUTS, PADDED
from service.model_json import ModelJson, Tensor
from service.tokenizer import Tokenizer

log = logging.getLogger(__name__)

FORMAT = "posenc-artifact/1"


class Lazy:
    """A session of an artifact's graph loaded on its first use, once (a graph a model may never need: the exact
    graph beside a fast one, the profile graph)."""

    def __init__(self, load: Callable[[], ort.InferenceSession] | ort.InferenceSession, what: str):
        self._value = load if isinstance(load, ort.InferenceSession) else None
        self._load, self.what = load, what
        self._lock = threading.Lock()

    @property
    def loaded(self) -> bool:
        return self._value is not None

    def get(self) -> ort.InferenceSession:
        if self._value is None:
            with self._lock:
                if self._value is None:
                    log.info("loading %s", self.what)
                    assert callable(self._load)
                    self._value = self._load()
        return self._value


class Graph(NamedTuple):
    """What a call runs on: the session, the codec of its rows' layout, and the input naming each row's positions
    whose logits are computed (None: the graph computes every position's)."""

    session: ort.InferenceSession
    codec: type[Codec]
    logits_positions: str | None = None


@dataclass(frozen=True)
class LoadedModel:
    """An artifact ready to serve: its description and its graphs, nothing about who serves it (the registry's
    Served record holds its engine).  `exact` is the exact graph (every output, attention maps included); `fast`
    the artifact's fast graph (fast.onnx: the same inputs, logits and present outputs, no maps, fused operators)
    or None.  With a fast graph the exact one is loaded when first used (its weights are not held twice while no
    request wants maps); `graph(maps)` is the one a call runs."""

    name: str
    meta: ModelJson  # model.json, read once (service/model_json.py)
    exact: Lazy
    sha256: str
    tokenizer: Tokenizer  # service.tokenizer: the artifact's own (bytes, or its tokenizer.json)
    kv: KVSpec  # the cache geometry (the carried tensors; float16 buffers where the fast graph served is)
    encoding: ort.InferenceSession | None = None  # encoding.onnx: the positional function alone (the lab)
    fingerprint: str = ""  # sha256 of manifest.json: a reload replaces the model only when it changed
    fast: ort.InferenceSession | None = None
    # the fast graph's input naming, per row, the positions whose logits are computed (None: every position)
    logits_positions: str | None = None
    # how the fast graph lays rows out: padded (left-padded rows under a mask, like the exact graph) or compact
    # (GroupQueryAttention: each row's cache from slot 0, its length in seqlens_k; service/compact.py); resolved
    # once at load from model.json's fast.layout (padded where there is no fast graph)
    layout: Layout = PADDED
    # profile.onnx (export/profile.py: attention profiles reduced in the graph), loaded on first use; None where the
    # artifact has none
    profile: Lazy | None = None
    # intervene.onnx and intervene_profile.onnx (export/intervene.py: positions, switches, ablations, RoPE
    # frequencies as inputs), loaded on a request's first intervention; None where the artifact has none
    intervene: Lazy | None = None
    intervene_profile: Lazy | None = None
    intervene_maps: Lazy | None = None  # intervene_maps.onnx (the mixers' exact matrices); None without mixers
    intervene_maps_profile: Lazy | None = None  # intervene_maps_profile.onnx (their profiles); None without mixers

    @property
    def session(self) -> ort.InferenceSession:
        """The exact graph's session, loaded on first use when the artifact has a fast graph."""
        return self.exact.get()

    @property
    def exact_loaded(self) -> bool:
        return self.exact.loaded

    def graph(self, maps: bool, profile: bool = False) -> Graph:
        """The graph for a call: the profile graph for a profile (its rows padded), the exact graph (padded) when a
        row wants attention maps or the artifact has no fast graph, else the fast graph in its own layout."""
        if profile:
            if self.profile is None:
                raise RuntimeError(f"model {self.name!r} has no profile graph")
            return Graph(self.profile.get(), PADDED.codec)
        if self.fast is not None and not maps:
            return Graph(self.fast, self.layout.codec, self.logits_positions)
        return Graph(self.session, PADDED.codec)

    def session_for(self, maps: bool) -> ort.InferenceSession:
        """The session for a call: the fast graph when no row wants attention maps and the artifact has one."""
        return self.graph(maps).session

    @property
    def whole_prompts(self) -> bool:
        """Whether a prompt must run in one call: under a length-dependent RoPE scaling (model.json's config) a
        piece's keys would be rotated with the frequencies of the length reached at that piece's end, where the
        model (and transformers) rotates every key of a prompt with those of the whole prompt's length.  The
        exporter asks the scaling type and writes the answer in model.json."""
        return self.meta.whole_prompts

    @property
    def n_layers(self) -> int:
        return self.meta.sizes.n_layers

    @property
    def n_heads(self) -> int:
        return self.meta.sizes.n_heads

    @property
    def head_dim(self) -> int:
        return self.meta.sizes.head_dim

    @property
    def kv_heads(self) -> int:
        """Key/value heads of the KV cache: fewer than n_heads under grouped-query attention."""
        return self.meta.sizes.kv_heads

    @property
    def vocab_size(self) -> int:
        return self.meta.sizes.vocab_size

    @property
    def max_positions(self) -> int | None:
        return self.meta.max_positions


PROVIDERS = {"cpu": ["CPUExecutionProvider"], "cuda": ["CUDAExecutionProvider", "CPUExecutionProvider"],
             "openvino": ["OpenVINOExecutionProvider", "CPUExecutionProvider"]}
PACKAGES = {"cuda": "onnxruntime-gpu", "openvino": "onnxruntime-openvino"}  # each in place of onnxruntime


def providers_for(kind: str) -> list[str]:
    """onnxruntime execution providers for --provider: cpu, cuda or openvino (an error where this onnxruntime lacks
    it: onnxruntime-gpu and onnxruntime-openvino are other packages), or auto (cuda when available, else cpu)."""
    available = ort.get_available_providers()
    if kind == "auto":
        kind = "cuda" if "CUDAExecutionProvider" in available else "cpu"
    if kind not in PROVIDERS:
        raise ValueError(f"--provider must be {', '.join(PROVIDERS)} or auto, got {kind!r}")
    if (wanted := PROVIDERS[kind][0]) not in available:
        wanted = wanted.removesuffix("ExecutionProvider")
        raise ValueError(f"--provider {kind}: this onnxruntime has no {wanted} execution provider (available: "
                         f"{', '.join(available)}); install {PACKAGES[kind]} in place of onnxruntime, or use cpu")
    return PROVIDERS[kind]


def openvino_checked(providers: list[str], fast: model_json.Fast | None = None) -> list[str]:
    """Under OpenVINO, the CPU for all but the exact graph and a fast graph whose every GroupQueryAttention rotates
    inside (docs/serving.md#openvino: it reads other fast graphs' position clamp as zeros, or cannot read them)."""
    rotates_inside = fast is not None and 0 < fast.fused.get("GroupQueryAttention do_rotary", 0) == fast.fused.get(
        "GroupQueryAttention", 0)
    return PROVIDERS["cpu"] if providers[0] == "OpenVINOExecutionProvider" and not rotates_inside else providers


def load_artifact(folder: Path, threads: int, arena: bool = True, providers: list[str] | None = None,
                  shared: bool = True, gate: threading.Semaphore | None = None, spin: bool = False,
                  half: bool = False) -> LoadedModel:
    """An artifact checked against its manifest and model.json, with its sessions (service.ortenv: with `shared`,
    onnxruntime's process-wide thread pool and arena; `gate` limits the runs at once across sessions).  With
    `half`, the fast graph served is its float16 copy where model.json has one (fast.half)."""
    manifest = model_json.read_object(folder / "manifest.json")
    if manifest.get("format") != FORMAT:
        raise ArtifactRejected(f"manifest.json is not a {FORMAT} manifest")
    files = manifest.get("files") or {}
    for required in ("model.onnx", "model.json"):
        if required not in files:
            raise ArtifactRejected(f"manifest.json does not list {required}")
    for name, entry in files.items():
        path = folder / name
        if Path(name).name != name or not path.is_file():
            raise ArtifactRejected(f"missing {name}")
        if path.stat().st_size != entry.get("size") or sha256_file(path) != entry.get("sha256"):
            raise ArtifactRejected(f"{name} does not match its manifest sha256")
    validation = manifest.get("validation")
    if validation is not None and not validation.get("passed", False):
        raise ArtifactRejected("its validation report says it failed parity checks")
    meta = model_json.read(folder / "model.json")
    opts = ortenv.session_options(threads, arena, shared, spin)
    providers = providers or PROVIDERS["cpu"]

    def load_exact() -> ort.InferenceSession:
        session = _session(folder, "model.onnx", opts, providers, gate)
        _check_inputs(meta, session, "model.onnx")
        _check_shapes(meta.inputs, meta.outputs, session)
        ortenv.release_heap()  # what parsing the graph freed
        return session

    fast = _fast_session(folder, meta, files, opts, providers, gate, half)
    exact = load_exact if fast is not None else load_exact()
    if fast is not None:
        ortenv.release_heap()
    encoding = None
    enc_file = meta.encoding.file if meta.encoding is not None else None
    if enc_file:
        if enc_file not in files or Path(enc_file).name != enc_file:  # only a file the manifest vouches for
            raise ArtifactRejected(f"model.json names encoding file {enc_file!r}, which the manifest does not list")
        try:
            encoding = ort.InferenceSession(str(folder / enc_file), opts, providers=["CPUExecutionProvider"])
        except Exception as err:
            raise ArtifactRejected(f"onnxruntime cannot load {enc_file}: {err}") from None
    tok_file = meta.tokenizer.file
    if tok_file and tok_file not in files:  # only a tokenizer the manifest vouches for
        raise ArtifactRejected(f"model.json names tokenizer file {tok_file!r}, which the manifest does not list")
    tok = tokenizer.for_artifact(folder, meta.tokenizer, meta.sizes.vocab_size)
    entry = meta.fast if fast is not None else None
    side = openvino_checked(providers)
    profile = _profile_loader(folder, meta, files, lambda name: _session(folder, name, opts, side, gate))
    intervene = _intervene_loaders(folder, meta, files, lambda name: _session(folder, name, opts, side, gate))
    return LoadedModel(folder.name, meta, Lazy(exact, f"{folder.name}'s exact graph (a call wants attention maps)"),
                       files["model.onnx"]["sha256"], tok,
                       KVSpec.of(meta, np.float16 if fast is not None and _is_half(fast) else np.float32),
                       encoding=encoding, fingerprint=fingerprint(folder), fast=fast,
                       logits_positions=entry.logits_positions if entry is not None else None,
                       layout=LAYOUTS[entry.layout] if entry is not None else PADDED,
                       profile=Lazy(profile, f"{folder.name}'s profile graph") if profile is not None else None,
                       intervene=intervene[0], intervene_profile=intervene[1], intervene_maps=intervene[2],
                       intervene_maps_profile=intervene[3])


def _session(folder: Path, name: str, opts: ort.SessionOptions, providers: list[str],
             gate: threading.Semaphore | None) -> ortenv.Session:
    options = [{"device_type": "CPU", "precision": "FP32", "num_of_threads": str(opts.intra_op_num_threads)}
               if p == "OpenVINOExecutionProvider" else {} for p in providers]  # not the bfloat16 it may pick
    try:
        session = ortenv.Session(str(folder / name), opts, providers=providers, provider_options=options)
    except Exception as err:  # onnxruntime raises its own exception types
        raise ArtifactRejected(f"onnxruntime cannot load {name}: {err}") from None
    missing = [p for p in providers if p not in session.get_providers()]
    if missing:  # onnxruntime falls back to the CPU when a provider's libraries fail to load; serving is not silent
        raise ArtifactRejected(f"onnxruntime could not start {', '.join(missing)} for {name} (it fell back to "
                               f"{', '.join(session.get_providers())}); its log above says which library is missing")
    session.gate = gate
    return session


def _profile_loader(folder: Path, meta: ModelJson, files: dict[str, Any],
                    load: Callable[[str], ort.InferenceSession]) -> Callable[[], ort.InferenceSession] | None:
    """How to load the profile graph model.json names, when the manifest vouches for it and it was built from this
    model.onnx; else None (a copy whose model.onnx changed has no profiles)."""
    if meta.profile is None:
        return None
    name = meta.profile.file
    if name not in files or Path(name).name != name:
        raise ArtifactRejected(f"model.json names profile graph {name!r}, which the manifest does not list")
    if meta.profile.source_sha256 != files["model.onnx"]["sha256"]:
        log.warning("%s: %s was built from another model.onnx; no profiles", folder.name, name)
        return None
    return lambda: load(name)


def _intervene_loaders(folder: Path, meta: ModelJson, files: dict[str, Any],
                       load: Callable[[str], ort.InferenceSession]) -> tuple[Lazy | None, ...]:
    """The intervention graphs model.json names, loaded on first use and checked then (their inputs: the exact
    graph's and those model.json's intervene entry adds): the graph, its profile graph, its maps graph and that
    one's profile graph (None without mixers); all None where there are none or they were built from another
    model.onnx."""
    spec = meta.intervene
    if spec is None:
        return None, None, None, None
    for name in filter(None, (spec.file, spec.profile_file, spec.maps_file, spec.maps_profile_file)):
        if name not in files or Path(name).name != name:
            raise ArtifactRejected(f"model.json names intervention graph {name!r}, which the manifest does not list")
    if spec.source_sha256 != files["model.onnx"]["sha256"]:
        log.warning("%s: %s was built from another model.onnx; no interventions", folder.name, spec.file)
        return None, None, None, None
    extra = frozenset(i.name for i in spec.inputs)

    def loader(name: str) -> Callable[[], ort.InferenceSession]:
        def load_checked() -> ort.InferenceSession:
            session = load(name)
            _check_inputs(meta, session, name, extra)
            return session
        return load_checked

    return (Lazy(loader(spec.file), f"{folder.name}'s intervention graph"),
            Lazy(loader(spec.profile_file), f"{folder.name}'s intervention profile graph"),
            Lazy(loader(spec.maps_file), f"{folder.name}'s mixer maps graph") if spec.maps_file else None,
            Lazy(loader(spec.maps_profile_file), f"{folder.name}'s mixer profile graph") if spec.maps_profile_file
            else None)


def _check_inputs(meta: ModelJson, session: ort.InferenceSession, name: str, extra: frozenset[str] = frozenset()
                  ) -> None:
    graph_inputs = {i.name for i in session.get_inputs()}
    wanted = {i.name for i in meta.inputs} | extra
    if graph_inputs != wanted:
        raise ArtifactRejected(f"{name}: graph inputs {sorted(graph_inputs)} differ from model.json {sorted(wanted)}")


def _is_half(session: ort.InferenceSession) -> bool:
    return any(i.type == "tensor(float16)" for i in session.get_inputs())


def _fast_session(folder: Path, meta: ModelJson, files: dict[str, Any], opts: ort.SessionOptions,
                  providers: list[str], gate: threading.Semaphore | None, half: bool = False
                  ) -> ortenv.Session | None:
    """The fast graph model.json names (with `half`, its float16 copy where there is one), when the manifest
    vouches for it and it was built from this model.onnx (a copy whose model.onnx changed, e.g. a quantized one,
    keeps only its exact graph); else None, logged."""
    entry = meta.fast
    if entry is None:
        return None
    name = entry.half.file if half and entry.half is not None else entry.file
    if name not in files or Path(name).name != name:
        raise ArtifactRejected(f"model.json names fast graph {name!r}, which the manifest does not list")
    if entry.source_sha256 != files["model.onnx"]["sha256"]:
        log.warning("%s: %s was built from another model.onnx; serving the exact graph alone", folder.name, name)
        return None
    session = _session(folder, name, opts, openvino_checked(providers, entry), gate)
    positions = entry.logits_positions  # the input naming the positions whose logits are computed
    layout = entry.layout
    if layout not in LAYOUTS:
        raise ArtifactRejected(f"model.json's fast entry has layout {layout!r}; this worker knows {', '.join(LAYOUTS)}")
    extra = set(LAYOUTS[layout].codec.inputs) | ({positions} if positions else set())
    _check_inputs(meta, session, name, frozenset(extra))
    if _is_half(session) and layout != "compact":  # the padded rows' tensors are float32 (service/padded.py)
        raise ArtifactRejected(f"{name} is float16, which only a compact fast graph may be; its layout is {layout}")
    if LAYOUTS[layout].codec.kv_only and any(spec.sequence_axis is None for spec in meta.state):
        raise ArtifactRejected(f"a {layout} fast graph carries KV caches only; model.json declares another state")
    _check_shapes(meta.inputs, tuple(o for o in meta.outputs if o.name != "attentions"), session, exact=True)
    return session


def _check_shapes(inputs: tuple[Tensor, ...], outputs: tuple[Tensor, ...], session: ort.InferenceSession,
                  exact: bool = False) -> None:
    """model.json's declared shapes must be the graph's: same rank, same fixed sizes, symbolic where it is;
    with `exact`, the graph also has no output model.json does not declare."""
    graph = {v.name: v.shape for v in [*session.get_inputs(), *session.get_outputs()]}
    if exact:
        extra = {o.name for o in session.get_outputs()} - {o.name for o in outputs}
        if extra:
            raise ArtifactRejected(f"the fast graph has outputs model.json does not declare: {sorted(extra)}")
    for decl in [*inputs, *outputs]:
        shape = graph.get(decl.name)
        if shape is None:
            raise ArtifactRejected(f"model.json declares {decl.name!r}, which the graph does not have")
        said = decl.shape
        fixed_ok = len(said) == len(shape) and all(
            (isinstance(d, int) and d == g) or (not isinstance(d, int) and not isinstance(g, int))
            for d, g in zip(said, shape, strict=True))
        if not fixed_ok:
            raise ArtifactRejected(f"model.json says {decl.name} has shape {list(said)}, the graph has {shape}")


def fingerprint(folder: Path) -> str:
    """sha256 of an artifact's manifest.json: it changes whenever any file the manifest vouches for changes."""
    return sha256_file(folder / "manifest.json")


def model_folders(model_dir: Path) -> dict[str, Path]:
    """Every artifact folder under model_dir by name (hidden folders, e.g. an exporter's staging, are skipped)."""
    return {p.name: p for p in sorted(model_dir.iterdir()) if p.is_dir() and not p.name.startswith(".")}


def load_all(model_dir: Path, threads: int, arena: bool = True, providers: list[str] | None = None,
             shared: bool = True, gate: threading.Semaphore | None = None, spin: bool = False, half: bool = False
             ) -> tuple[dict[str, LoadedModel], dict[str, str]]:
    """Every artifact under model_dir; a bad one is logged with its reason and skipped."""
    models: dict[str, LoadedModel] = {}
    rejected: dict[str, str] = {}
    if not model_dir.is_dir():
        log.error("model dir %s does not exist", model_dir)
        return models, rejected
    for folder in model_folders(model_dir).values():
        try:
            models[folder.name] = load_artifact(folder, threads, arena, providers, shared, gate, spin, half)
            log.info("loaded model %s (%s)", folder.name, models[folder.name].meta.variant)
        except OSError as err:  # unreadable (permissions), vanished mid-load: refuse this one, keep the rest
            rejected[folder.name] = f"cannot read it: {err.strerror or err}: {err.filename or folder}"
            log.error("refused artifact %s: %s", folder, rejected[folder.name])
        except ArtifactRejected as err:
            rejected[folder.name] = str(err)
            log.error("refused artifact %s: %s", folder, err)
    return models, rejected
