"""torch.onnx's dynamo exporter, called one way by the model graph (export.build) and the encoding graph
(export.encoding).

Each `torch.onnx.export` call builds its operator registry from onnxscript's torchlib, and onnxscript parses the
source of every torchlib function (about 500) to read its signature: about 0.25 s a call on this project's
machine, a tenth of a tiny model's export.  The list it returns depends only on the installed onnxscript, which
registers its operators once at import, so it is computed once per process and handed to every later export.  The
registry torch builds from it is still a new object per call, so nothing one export registers reaches the next.

The garbage collector is paused while an export runs.  torch.export and its decompositions make FX graphs, fake
tensors and symbolic shapes by the hundred thousand, which live until the export returns: collections during it
free little, and what they keep moves to the oldest generation, which then filled often enough for about one full
collection per export, each walking every object of a process that imported torch (half a second once it holds a
few models).  With the collector paused, the export's garbage is freed by the first young collection after it."""

from __future__ import annotations

import functools
import gc
from typing import Any

import torch


def onnx_export(module: torch.nn.Module, args: tuple[Any, ...], **options: Any) -> Any:
    """torch.onnx.export(module, args, dynamo=True, **options): an ONNXProgram."""
    _torchlib_once()
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
