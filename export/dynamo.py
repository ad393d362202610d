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

The garbage collector is paused while an export runs.  torch.export and its decompositions make FX graphs, fake
tensors and symbolic shapes by the hundred thousand, which live until the export returns: collections during it
free little, and what they keep moves to the oldest generation, which then filled often enough for about one full
collection per export, each walking every object of a process that imported torch (half a second once it holds a
few models).  With the collector paused, the export's garbage is freed by the first young collection after it."""

from __future__ import annotations

import copy
import functools
import gc
from typing import Any

import torch


def onnx_export(module: torch.nn.Module, args: tuple[Any, ...], **options: Any) -> Any:
    """torch.onnx.export(module, args, dynamo=True, **options): an ONNXProgram."""
    _torchlib_once()
    _tables_once()
    enabled = gc.isenabled()
    gc.disable()
    try:
        return torch.onnx.export(module, args, dynamo=True, **options)
    finally:
        if enabled:
            gc.enable()


@functools.cache
def _torchlib_once() -> None:
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
