"""The ONNX exporter's type-promotion pass, run from the values torch.export already recorded.

ONNX operators take inputs of one type where ATen promotes (a float tensor divided by the Python int 8, a float16
tensor added to a float32 one), so before translating a program the exporter inserts the casts ATen's promotion
implies (`_fx_passes.insert_type_promotion_nodes`, torch's `InsertTypePromotion`).  That pass interprets the whole
graph once more under fake tensors and symbolic shapes, node by node, to know each value's type: a third trace of
the model beside torch.export's two, about 15% of a tiny model's export.  Every one of those values is already in
the graph (each node's `meta["val"]`, which torch.export recorded), and the pass changes no value's type: a
promoted input gets a cast in front of its node, and a node computed in a wider type ("op math") gets a cast back
to the type its users had.  So a node the pass leaves alone has the value it recorded, and only the nodes it
inserts or changes need running.

`insert_type_promotion_nodes` is that pass with this one difference: the interpreter's `run_node` hands on a
node's recorded value instead of computing it again, except where the node has none or was just changed (its value
was computed anew as the pass changed it).  The rules, the casts and the nodes inserted are torch's own code, so the
graph is the one torch's pass writes (tests/export/test_promotion.py holds the two to the same ONNX bytes on a
module whose graph needs a cast of every kind).  `from_recorded`, entered by export.dynamo's `onnx_export`, puts it
in the exporter's place for the length of an export; where torch's private names are not as the pinned torch has
them, `available()` is False and the exporter's own pass runs."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

try:  # private modules of torch's exporter (the pinned torch's), guarded
    from torch.onnx._internal.exporter import _fx_passes
    from torch.onnx._internal.fx.passes import type_promotion as _tp

    _BASE: Any = _tp._TypePromotionInterpreter
    _TRANSFORM: Any = _tp.InsertTypePromotion
except (ImportError, AttributeError):  # another layout: the exporter's own pass runs
    _tp, _BASE, _TRANSFORM = None, object, object


def available() -> bool:
    return _tp is not None and hasattr(_fx_passes, "insert_type_promotion_nodes") and all(
        hasattr(_BASE, n) for n in ("_maybe_promote_node", "_set_current_node"))


class _FromRecorded(_BASE):  # type: ignore[misc, valid-type]
    """torch's type-promotion interpreter whose unchanged nodes take the values torch.export recorded."""

    def run_node(self, n: torch.fx.Node) -> Any:
        with self._set_current_node(n):
            if rule := _tp.get_type_promotion_rule(n, self.type_promotion_table):
                self._maybe_promote_node(n, rule)  # a node it changes is run anew there, its meta["val"] set
        if n.op == "call_function" and n.meta.get("val") is not None:
            return n.meta["val"]
        return torch.fx.Interpreter.run_node(self, n)  # placeholders, attributes, the output, a node without one


class _Pass(_TRANSFORM):  # type: ignore[misc, valid-type]
    def __init__(self, module: torch.fx.GraphModule) -> None:
        super().__init__(module)
        self.interpreter = _FromRecorded(module, _tp.TypePromotionTable())


def insert_type_promotion_nodes(graph_module: torch.fx.GraphModule) -> None:
    """In place, as the exporter's pass of that name: explicit casts where ATen's type promotion implies them, in
    the module and in every module nested in it."""
    for module in graph_module.modules():
        if not isinstance(module, torch.fx.GraphModule):
            raise AssertionError(f"Expected GraphModule, got {type(module)}")
        _Pass(module).run()


@contextlib.contextmanager
def from_recorded() -> Iterator[None]:
    """While it lasts, the exporter's type-promotion pass is `insert_type_promotion_nodes` (where available())."""
    if not available():
        yield
        return
    own = _fx_passes.insert_type_promotion_nodes
    _fx_passes.insert_type_promotion_nodes = insert_type_promotion_nodes
    try:
        yield
    finally:
        _fx_passes.insert_type_promotion_nodes = own
