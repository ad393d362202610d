"""Structural checks on an exported graph: checker, symbolic dimensions, no length-specific constants.

A positional table or mask baked at one length is the classic export bug (docs/design.md, "Export
pitfalls"): the graph still runs, but only up to that length or with wrong numbers beyond it.  Every
constant in the graph that is not one of the model's own weights must therefore be free of any length-specific
size: the trained context and its multiples, and the lengths of the example used to capture the graph.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

from export.rewrite import all_nodes

# Example sizes used when capturing the graph (export.wrapper.example_inputs); none may survive as a constant.
CAPTURE_SIZES = {"new": 7, "past": 6, "total": 13}


@dataclass
class GraphFinding:
    check: str
    passed: bool
    detail: str


def is_external(init: onnx.TensorProto) -> bool:
    return init.data_location == onnx.TensorProto.EXTERNAL


def initializer_array(init: onnx.TensorProto, base_dir: Path | None = None) -> np.ndarray:
    """An initializer's values; one kept in external data (a proto loaded with load_external_data=False) is
    memory-mapped copy-on-write from its file beside the graph, not read into memory: a real-size model's weights
    are then file pages the kernel may drop, not a second anonymous copy."""
    if not is_external(init):
        return numpy_helper.to_array(init)
    info = {e.key: e.value for e in init.external_data}
    location = info.get("location", "")
    if base_dir is None or Path(location).name != location:
        raise ValueError(f"initializer {init.name}: external data {location!r} is not a file beside the graph")
    dtype = onnx.helper.tensor_dtype_to_np_dtype(init.data_type)
    shape = tuple(int(d) for d in init.dims)
    count = int(np.prod(shape, dtype=np.int64))
    if count == 0:
        return np.zeros(shape, dtype)
    return np.memmap(base_dir / location, dtype=dtype, mode="c", offset=int(info.get("offset", 0)), shape=shape)


def _constants(model: onnx.ModelProto, base_dir: Path | None = None):
    for init in model.graph.initializer:
        yield init.name, initializer_array(init, base_dir)
    for node in all_nodes(model.graph):
        if node.op_type == "Constant":
            for attr in node.attribute:
                if attr.name == "value":
                    yield node.output[0], numpy_helper.to_array(attr.t)


def _fingerprint(a: np.ndarray) -> tuple:
    """Shape and a digest of the values (a digest, not the bytes: a real-size model's weights held twice more
    would double the validation's memory)."""
    a = np.ascontiguousarray(a, dtype=np.float32)
    return (a.shape, hashlib.blake2b(a.data, digest_size=16).digest())


def weight_fingerprints(weights: dict[str, np.ndarray], shape: tuple | None = None) -> set[tuple]:
    """Every model weight and its transpose (the exporter may store a weight pre-transposed for MatMul); with
    `shape`, only those of that shape (digesting a real-size model's every weight twice costs a minute)."""
    out = set()
    for w in weights.values():
        if shape is None or w.shape == shape:
            out.add(_fingerprint(w))
        if w.ndim == 2 and (shape is None or w.shape[::-1] == shape):
            out.add(_fingerprint(w.T))
    return out


def length_specific_sizes(context: int) -> set[int]:
    return {context, 2 * context, 4 * context, context + 1, context - 1, *CAPTURE_SIZES.values()}


def check_graph(model: onnx.ModelProto, context: int, weights: dict[str, np.ndarray],
                symbolic_inputs: dict[str, list[int]], table: tuple[str, int | None] | None = None,
                path: Path | None = None) -> list[GraphFinding]:
    """`table`: (parameter name, max_positions from model.json) for a variant bounded by a learned table.  `path`:
    the graph's file, checked from disk when the graph keeps its weights in external data (`model` may then be
    loaded without them: its external initializers are memory-mapped from the file beside `path`) or when the
    loaded proto passes protobuf's 2 GB."""
    findings = []
    base_dir = path.parent if path is not None else None
    try:
        if path is not None and any(is_external(i) for i in model.graph.initializer):
            onnx.checker.check_model(str(path), full_check=True)  # the data file's tensors are checked there
        else:
            try:
                onnx.checker.check_model(model, full_check=True)
            except ValueError:  # "Message onnx.ModelProto exceeds maximum protobuf size of 2GB": check the file
                if path is None:
                    raise
                onnx.checker.check_model(str(path), full_check=True)
        findings.append(GraphFinding("onnx.checker", True, "passes (full_check)"))
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError, ValueError) as err:
        findings.append(GraphFinding("onnx.checker", False, str(err).splitlines()[0]))

    frozen = []
    inputs = {i.name: i for i in model.graph.input}
    for name, axes in symbolic_inputs.items():
        if name not in inputs:
            frozen.append(f"{name} missing")
            continue
        dims = inputs[name].type.tensor_type.shape.dim
        frozen += [f"{name}[{a}]={dims[a].dim_value}" for a in axes if not dims[a].dim_param]
    findings.append(GraphFinding("symbolic batch/new/past dims", not frozen,
                                 "all symbolic" if not frozen else "frozen: " + ", ".join(frozen)))

    sizes = length_specific_sizes(context)
    known: dict[tuple, set[tuple]] = {}  # shape -> fingerprints of the weights (or transposes) of that shape
    baked = []
    for name, value in _constants(model, base_dir):
        if value.ndim == 0 or value.dtype.kind not in "fiu" or not set(value.shape) & sizes:
            continue  # only a constant with a length-sized axis can be a baked table
        if value.dtype.kind == "f":
            if value.shape not in known:
                known[value.shape] = weight_fingerprints(weights, value.shape)
            if _fingerprint(value) in known[value.shape]:
                continue  # one of the model's weights (the learned table included, checked separately)
        baked.append(f"{name} {list(value.shape)}")
    findings.append(GraphFinding(
        "no length-specific constants", not baked,
        "none: positions, angles and biases are computed at run time" if not baked
        else "constants sized like a sequence length: " + "; ".join(baked[:5])))
    if table:
        findings.append(table_rows(model, *table))
    return findings


def table_rows(model: onnx.ModelProto, param: str, max_positions: int | None) -> GraphFinding:
    """The graph's own table (its initializer, not the config) has exactly the rows model.json promises: the worker
    refuses longer prompts by max_positions, so a table with fewer rows would fail inside onnxruntime instead."""
    inits = {i.name: i for i in model.graph.initializer}
    init = inits.get(param) or inits.get(f"model.{param}")
    if init is None:
        return GraphFinding("bounded table recorded", False, f"the graph has no initializer {param}")
    rows = int(init.dims[0]) if init.dims else 0
    same = rows == max_positions
    return GraphFinding("bounded table recorded", same, f"table {param} has {rows} rows, model.json's max_positions "
                        f"is {max_positions}" + ("" if same else ": they differ"))
