"""torch.onnx's dynamo exporter, called one way by the model graph (export.build) and the encoding graph
(export.encoding).

Each `torch.onnx.export` call builds its operator registry from onnxscript's torchlib, and onnxscript parses the
source of every torchlib function (about 500) to read its signature: about 0.25 s a call on this project's
machine, a tenth of a tiny model's export.  The list it returns depends only on the installed onnxscript, which
registers its operators once at import, so it is computed once per process and handed to every later export.

Two more tables are rebuilt by every call from the same inputs, 0.1-0.15 s of each export (a fifth of an encoding
graph's): the registry itself (torchlib's functions and their signatures at the asked opset) and the decomposition
table (every torch decomposition except those the registry implements).  Each is built once per process and
copied for every call: a registry keyed by its opset, a new object with new lists per call, so nothing one export
registers reaches the next; a decomposition table keyed by the registry's operators and by the size of torch's
decomposition and CompositeImplicitAutograd registrations it is read from, so an operator registered later (a
library imported between two exports) makes a new one.

torch.export traces the module into ATen's training IR, then the exporter's `run_decompositions` traces that graph
again, op by op under fake tensors and symbolic shapes, to decompose what ONNX has no function for: two traces, each
most of an export's time.  `one_trace` makes them one: torch.export's post-dispatch trace given the exporter's own
decomposition table (the same table, split the same way into CompositeImplicitAutograd overrides and Python
decompositions as run_decompositions splits it), whose program the exporter then takes as decomposed.  The graph has
the same operators (tests/export/test_one_trace.py holds it to the exporter's two traces) and is validated like any
other.  Where torch's private names are not as the pinned torch has them, the exporter runs as it is (and that test
fails).  The exporter's type-promotion pass, which would interpret the graph a third time, reads the types the trace
recorded instead (export/promotion.py).

torch.export's fake tensors keep a dispatch cache (an operator's output metadata by its inputs'), and it is not used
here: under symbolic shapes a hit rebuilds its output's sizes and strides as symbolic expressions, which cost more
than the operator's own meta function does, most of all in the Mamba-2 layers' einsums (`python -m bench
export-speed` measures both settings; bench/results/export_speed.md).  The graph is the same either way.

No stack trace is recorded for the graph's nodes: by default the tracer captures and symbolizes the Python stack
at every operation it records (about a sixth of a tiny model's export) and the exporter writes each into the node's
metadata, so the graph named the files of the machine it was exported on (this checkout's absolute paths, in
every node).  Without them an artifact's bytes do not depend on where the code that exported it lives.  Of the rest
of a node's metadata only its namespace (the module path it was traced in, which tools such as Netron show) is
kept, without the memory addresses it names Python functions by: the exporter also wrote each node's FX text, class
hierarchy and name scopes, two fifths of a tiny model's file, and the addresses made the bytes of an artifact
depend on what the exporting process had done before.

The garbage collector is paused while an export runs.  torch.export and its decompositions make FX graphs, fake
tensors and symbolic shapes by the hundred thousand, which live until the export returns: collections during it
free little, and what they keep moves to the oldest generation, which then filled often enough for about one full
collection per export, each walking every object of a process that imported torch (half a second once it holds a
few models).  With the collector paused, the export's garbage is freed by the first young collection after it.

A graph is a function of the module it is exported from (its classes, their attributes: configs, tensors, flags),
the export's arguments and the exporter's versions, and the same graph is often asked for again (the encoding graph
of every tiny LLaMA-shaped family that rotates alike, a model imported again under another name): `graph_key`
digests those inputs, and `cached` and `keep` hold the exported bytes by that digest, in this process (graphs up to
16 MiB) and, where CACHE_DIR is set (the test suite's run folder, shared by its workers), in that folder, so a
caller writes the kept bytes instead of exporting again. A module holding anything the digest cannot read (an object
other than a tensor, a config, a plain value or a list of them) or a hook has no key: exported every time. A model's
graph and its intervention graph (export.build, export.intervene, through `export_kept`) are kept by `weights_key`,
which digests the parameters and buffers by their place alone: the exporter writes each as an initializer named by
its path and folds nothing (optimize=False), so the graph of a model with other weights (another seed, a trained
copy) is the kept one with that model's tensors written into those initializers (`with_weights`), byte for byte what
a fresh export writes. These are kept in CACHE_DIR only, never in the process: they hold weights."""

from __future__ import annotations

import contextlib
import copy
import functools
import gc
import hashlib
import importlib.metadata
import inspect
import json
import logging
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import onnx
import torch
from onnx import numpy_helper

from export import promotion
from export.errors import ExportError
from model.config import ModelConfig
from model.files import atomic_write

CACHE_DIR: Path | None = None  # a folder exported graphs are kept in by digest (set by the test suite)
_CACHE: dict[str, bytes] = {}  # this process's graphs by digest
_CACHE_MAX_BYTES = 16 * 2**20
DISPATCH_CACHE = False  # torch.export's fake-tensor dispatch cache while exporting (module docstring)
_KEEP_MAX_BYTES = 64 * 2**20  # a model's graph kept in CACHE_DIR (its weights inside)
_MODULE_INTERNALS = set(vars(torch.nn.Module()))  # every module's own: parameters, buffers, submodules, hooks


def onnx_export(module: torch.nn.Module, args: tuple[Any, ...], **options: Any) -> Any:
    """torch.onnx.export(module, args, dynamo=True, **options): an ONNXProgram."""
    _torchlib_once()
    _tables_once()
    enabled, traces = gc.isenabled(), torch.fx.config.do_not_emit_stack_traces
    gc.disable()
    torch.fx.config.do_not_emit_stack_traces = True  # no stack trace per node (module docstring)
    try:
        with one_trace(), promotion.from_recorded(), \
                torch._dynamo.config.patch(fake_tensor_cache_enabled=DISPATCH_CACHE):
            program = torch.onnx.export(module, args, dynamo=True, **options)
    finally:
        torch.fx.config.do_not_emit_stack_traces = traces
        if enabled:
            gc.enable()
    plain_metadata(program.model.graph)
    return program


_ADDRESS = re.compile(r" at 0x[0-9a-f]+>")


def plain_metadata(graph: Any) -> None:
    """Each node's metadata (its subgraphs' too) reduced to its "namespace", the module path it was traced in,
    with the addresses of Python objects taken out of it (module docstring)."""
    for node in graph.all_nodes():
        namespace = node.metadata_props.get("namespace")
        node.metadata_props.clear()
        if namespace is not None:
            node.metadata_props["namespace"] = _ADDRESS.sub(">", namespace)


@contextlib.contextmanager
def one_trace() -> Iterator[None]:
    """While it lasts, the exporter's torch.export call traces straight to the decomposed graph and its
    decomposition pass passes that program on (module docstring); nothing changes where torch's private names
    differ from the pinned torch's."""
    try:
        # lazy: private modules of torch's exporter and export (the pinned torch's), guarded
        from torch.export import _trace
        from torch.export import exported_program as program
        from torch.onnx._internal.exporter import _decomp, _fx_passes, _registration

        split = program._split_decomp_table_to_cia_and_python_decomp
        override, private_export = program._override_composite_implicit_decomp, _trace._export
        to_aten, decompose = _trace._export_to_aten_ir, _fx_passes.decompose_with_registry
    except (ImportError, AttributeError):
        yield
        return
    public_export = torch.export.export
    done: set[int] = set()  # the programs traced here, by id (kept alive by the exporter until it is through)

    def export(mod: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None, *,
               dynamic_shapes: Any = None, strict: bool = False, preserve_module_call_signature: tuple[str, ...] = (),
               prefer_deferred_runtime_asserts_over_guards: bool = False) -> Any:
        registry = _registration.ONNXRegistry.from_torchlib()  # the exporter's own (its default opset)
        table = _decomp.create_onnx_friendly_decomposition_table(set(_decomp.get_onnx_implemented_overloads(registry)))
        composite, python = split(table)

        def decomposing(*a: Any, **k: Any) -> Any:
            return to_aten(*a, **{**k, "decomp_table": python})

        _trace._export_to_aten_ir = decomposing
        try:
            with override(composite):
                ep = private_export(mod, args, kwargs, dynamic_shapes, strict=strict, pre_dispatch=False,
                                    preserve_module_call_signature=preserve_module_call_signature,
                                    prefer_deferred_runtime_asserts_over_guards=(
                                        prefer_deferred_runtime_asserts_over_guards))
        finally:
            _trace._export_to_aten_ir = to_aten
        done.add(id(ep))
        return ep

    def decomposed(ep: Any, registry: Any) -> Any:
        return ep if id(ep) in done else decompose(ep, registry)

    torch.export.export, _fx_passes.decompose_with_registry = export, decomposed
    try:
        yield
    finally:
        torch.export.export, _fx_passes.decompose_with_registry = public_export, decompose


@functools.cache
def _torchlib_once() -> None:
    # the exporter's notice, a line per operator, that torchvision's are not registered: posenc exports none of them
    logging.getLogger("torch.onnx._internal.exporter._registration").addFilter(
        lambda record: "torchvision is not installed" not in record.getMessage())
    try:
        # lazy: a private module of onnxscript (the one torch.onnx reads the list from in the pinned 0.7), guarded
        from onnxscript._framework_apis import torch_2_5 as apis
    except ImportError:  # another onnxscript layout: torch builds the list itself, as without this module
        return
    if not hasattr(apis.get_torchlib_ops, "cache_info"):
        apis.get_torchlib_ops = functools.cache(apis.get_torchlib_ops)


@functools.cache
def _tables_once() -> None:
    try:
        # lazy: private modules of torch's exporter (the pinned torch's), guarded
        from torch.onnx._internal.exporter import _decomp, _registration

        build = _registration.ONNXRegistry.from_torchlib.__func__
        decompositions = _decomp.create_onnx_friendly_decomposition_table
    except (ImportError, AttributeError):  # another layout: every call builds its own tables, as without this
        return
    registries: dict[Any, Any] = {}
    tables: dict[Any, dict[Any, Any]] = {}

    def from_torchlib(cls: type, *args: Any, **kwargs: Any) -> Any:
        key = (cls, args, tuple(sorted(kwargs.items())))
        if key not in registries:
            registries[key] = build(cls, *args, **kwargs)
        registry = copy.copy(registries[key])
        registry.functions = {target: list(entries) for target, entries in registry.functions.items()}
        return registry

    def decomposition_table(ops: set[Any]) -> dict[Any, Any]:
        key = (frozenset(ops), len(torch._decomp.decomposition_table),
               len(torch._C._dispatch_get_registrations_for_dispatch_key("CompositeImplicitAutograd")))
        if key not in tables:
            tables[key] = decompositions(ops)
        return dict(tables[key])

    _registration.ONNXRegistry.from_torchlib = classmethod(from_torchlib)
    _decomp.create_onnx_friendly_decomposition_table = decomposition_table


def graph_key(module: torch.nn.Module, *args: Any, read: dict[int, set[str]] | None = None,
              weights: bool = True) -> str | None:
    """The digest of what a graph is exported from: every class of module's tree (by name and file) and every
    attribute of its modules (tensors by dtype, shape and bytes; configs by their fields, and which are the same
    object), args (plain values: the opset, export options, the exporting module's file), the model and export
    packages' sources, and the versions of torch, onnxscript and onnx; None when an attribute is of a kind it
    cannot read.  read: for each config (by id), the fields the graph's forward read (fields_read), the only ones
    digested; every field otherwise.
    weights False: parameters and buffers by dtype, shape and which tensor they are (a tied weight is one tensor),
    not by their values (`weights_key`)."""
    digest = hashlib.sha256(json.dumps([*args, torch.__version__, importlib.metadata.version("onnxscript"),
                                        importlib.metadata.version("onnx"), _sources()]).encode())
    seen: dict[int, int] = {}
    hooks = torch.nn.modules.module
    if getattr(hooks, "_global_forward_hooks", None) or getattr(hooks, "_global_forward_pre_hooks", None):
        return None  # a hook every module calls
    for name, sub in module.named_modules():
        cls = type(sub)
        where = f"{cls.__module__}.{cls.__qualname__} {inspect.getfile(cls)}"
        digest.update(f"module {name} {where} training={sub.training}".encode())
        internals = {k: v for k, v in vars(sub).items() if k in _MODULE_INTERNALS}
        if any(v for k, v in internals.items() if k.endswith("hooks")) or internals.get("_compiled_call_impl"):
            return None  # hooks (and a compiled forward) change what forward computes
        tensors = {**dict(sub.named_parameters(recurse=False)), **dict(sub.named_buffers(recurse=False))}
        values = {k: v for k, v in vars(sub).items() if k not in _MODULE_INTERNALS}
        for k, v in sorted({**values, **tensors}.items()):
            if k in values and _class_default(cls, k, v):
                continue  # set to what the class holds (a flag switched on for an export and off again): as unset
            digest.update(f"attr {k}".encode())
            if not weights and k in tensors:  # a weight: its place, not its values
                t = tensors[k]
                digest.update(f"weight {t.dtype} {list(t.shape)} {seen.setdefault(id(t), len(seen))}".encode())
            elif not _digest_value(digest, v, seen, read):
                return None
    return digest.hexdigest()


@functools.cache
def _sources() -> str:
    """The digest of the code a graph is traced from, the model and export packages' sources: a folder kept across
    an edit of either keeps nothing the edited code would trace otherwise.  (A value patched into a module's globals
    at run time is not in it: what patches one exports with CACHE_DIR None.)"""
    digest = hashlib.sha256()
    root = Path(__file__).resolve().parents[1]
    for package in ("model", "export"):
        for path in sorted((root / package).rglob("*.py")):
            digest.update(f"{path.relative_to(root)}\n".encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


def _class_default(cls: type, name: str, value: Any) -> bool:
    """Whether value is a plain value the class itself holds under name."""
    default = getattr(cls, name, _MODULE_INTERNALS)  # (a sentinel no attribute holds)
    return isinstance(value, (bool, int, float, str)) and type(default) is type(value) and default == value


def weights_key(module: torch.nn.Module, *args: Any) -> str | None:
    """The digest a graph exported without folding (optimize=False) is kept under, its weights set apart: the
    exporter holds every parameter and buffer as an initializer named by its path in module, and nothing in the
    graph is computed from their values (a trace reads shapes, never data), so two modules that differ only in
    their weights export the same graph but for those initializers, which `with_weights` writes anew.  A tensor
    kept as a plain attribute (a lifted constant in the graph) is digested by its bytes, as graph_key does."""
    return graph_key(module, "weights apart", *args, weights=False)


def with_weights(data: bytes, module: torch.nn.Module) -> onnx.ModelProto:
    """The graph kept under weights_key with module's own parameters and buffers as its initializers; ExportError
    when an initializer named as one of them differs from it in dtype or shape, or when one of them (under every
    name it has) names no initializer."""
    proto = onnx.load_model_from_string(data)
    tensors = {**dict(module.named_parameters(remove_duplicate=False)),
               **dict(module.named_buffers(remove_duplicate=False))}
    written: set[int] = set()
    for init in proto.graph.initializer:
        t = tensors.get(init.name)
        if t is None:
            continue  # a constant lifted from the code, the same for every module of this digest
        array = t.detach().cpu().contiguous().numpy()
        if init.data_type != onnx.helper.np_dtype_to_tensor_dtype(array.dtype) or list(init.dims) != list(array.shape):
            raise ExportError(f"the kept graph's initializer {init.name} is not {array.dtype} {list(array.shape)}")
        init.CopyFrom(numpy_helper.from_array(array, init.name))
        written.add(id(t))
    missed = sorted(name for name, t in tensors.items() if id(t) not in written)
    if missed:  # a tensor held under another name (or unused): the kept graph could keep another model's values
        raise ExportError(f"the kept graph has no initializer named as {missed[0]}")
    return proto


def _digest_value(digest: Any, value: Any, seen: dict[int, int], read: dict[int, set[str]] | None) -> bool:
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
        digest.update(f"tensor {t.dtype} {list(t.shape)}".encode())
        digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    elif isinstance(value, ModelConfig):  # by its fields, and by identity: a variant may ask `cfg is self.cfg`
        index = seen.setdefault(id(value), len(seen))
        fields = value.to_dict()
        if read is not None and set(vars(value)) <= set(fields):  # nothing kept beside the fields (a cached value)
            fields = {k: v for k, v in fields.items() if k in read.get(id(value), ())}
        digest.update(f"config {index} {json.dumps(fields, sort_keys=True)}".encode())
    elif value is None or isinstance(value, (bool, int, float, str)):
        digest.update(f"{type(value).__name__} {value!r}".encode())
    elif isinstance(value, (list, tuple)):
        digest.update(f"{type(value).__name__} {len(value)}".encode())
        return all(_digest_value(digest, v, seen, read) for v in value)
    else:
        return False
    return True


def fields_read(run: Callable[[], Any]) -> dict[int, set[str]]:
    """The fields of each config (by id) that run() reads, run once with every read recorded (a read from another
    thread meanwhile only adds a field)."""
    read: dict[int, set[str]] = {}
    original = ModelConfig.__getattribute__

    def recording(self: ModelConfig, name: str) -> Any:
        read.setdefault(id(self), set()).add(name)
        return original(self, name)

    ModelConfig.__getattribute__ = recording  # type: ignore[method-assign]
    try:
        run()
    finally:
        ModelConfig.__getattribute__ = original  # type: ignore[method-assign]
    return read


def cached(key: str | None) -> bytes | None:
    """The graph kept under key, or None."""
    if key is None:
        return None
    if key in _CACHE:
        return _CACHE[key]
    path = CACHE_DIR / f"{key}.onnx" if CACHE_DIR is not None else None
    return path.read_bytes() if path is not None and path.exists() else None


def keep(key: str | None, data: bytes) -> None:
    """Keep an exported graph's bytes under key (nothing for None)."""
    if key is None:
        return
    if len(data) <= _CACHE_MAX_BYTES:
        _CACHE[key] = data
    if CACHE_DIR is not None:  # test workers share it: each writes a whole file of its own, then renames it
        atomic_write(CACHE_DIR / f"{key}.onnx", data)


def kept_graph(key: str | None, module: torch.nn.Module) -> onnx.ModelProto | None:
    """The graph kept in CACHE_DIR under key (weights_key's) with module's weights, or None: no folder, no such
    graph, or one whose weights module cannot give (the caller exports)."""
    if key is None or CACHE_DIR is None or not (CACHE_DIR / f"{key}.onnx").exists():
        return None
    try:
        return with_weights((CACHE_DIR / f"{key}.onnx").read_bytes(), module)
    except (ExportError, TypeError, ValueError):  # a dtype numpy has no type for (bfloat16), a changed layout
        return None


def export_kept(module: torch.nn.Module, key_args: tuple[Any, ...],
                trace: Callable[[torch.nn.Module], onnx.ModelProto]) -> tuple[onnx.ModelProto, bool]:
    """(module's graph, whether it was traced): the graph kept in CACHE_DIR under weights_key(module, *key_args)
    with module's weights, else trace(module)'s, then kept there.  Without CACHE_DIR, always traced."""
    key = None if CACHE_DIR is None else weights_key(module, *key_args)
    proto = kept_graph(key, module)
    if proto is not None:
        return proto, False
    proto = trace(module)
    keep_graph(key, proto)
    return proto, True


def keep_graph(key: str | None, proto: onnx.ModelProto) -> None:
    """Keep an exported graph (its weights inside) in CACHE_DIR under key, up to 64 MiB: only there, never in this
    process (a model's graph holds its weights)."""
    if key is not None and CACHE_DIR is not None and proto.ByteSize() <= _KEEP_MAX_BYTES:
        atomic_write(CACHE_DIR / f"{key}.onnx", proto.SerializeToString())
