"""Rewrites of an exported ONNX graph that keep what it computes, for the fast graph (export/fuse.py): pattern
matching over producers and consumers (Graph), RMS norms written out fused into onnxruntime's
SimplifiedLayerNormalization / SkipSimplifiedLayerNormalization, the attention-map output dropped with what only it
needed, dead nodes pruned, and the `logits_positions` input that gathers each row's positions before the output
head."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

import numpy as np
import onnx
from onnx import helper, numpy_helper

from export.gqa import MS_DOMAIN

LOGITS_POSITIONS = "logits_positions"  # the fast graph's input: (batch, count) positions whose logits are computed
# operators that may follow the head's MatMul on the way to `logits` (a bias, a soft-cap): each works position by
# position, so gathering positions before the head gives the same rows
PER_POSITION = {"Add", "Mul", "Div", "Tanh", "Cast"}


class Graph:
    """Producers, consumers and constants of a graph, for pattern matching."""

    def __init__(self, proto: onnx.ModelProto):
        self.g = proto.graph
        self.inits = {i.name: i for i in self.g.initializer}
        self.const = {n.output[0]: n for n in self.g.node if n.op_type == "Constant"}
        self.producer = {o: n for n in self.g.node for o in n.output if o}
        self.consumers: dict[str, list[onnx.NodeProto]] = {}
        for n in self.g.node:
            for i in n.input:
                self.consumers.setdefault(i, []).append(n)
        self.outputs = {o.name for o in self.g.output}

    def value(self, name: str) -> np.ndarray | None:
        if name in self.inits:
            return numpy_helper.to_array(self.inits[name])
        node = self.const.get(name)
        if node is not None and node.attribute and node.attribute[0].name == "value":
            return numpy_helper.to_array(node.attribute[0].t)
        return None

    def only_consumer(self, name: str, op: str) -> onnx.NodeProto | None:
        users = self.consumers.get(name, [])
        if len(users) == 1 and users[0].op_type == op and name not in self.outputs:
            return users[0]
        return None

    def scalar(self, name: str) -> float | None:
        v = self.value(name)
        return float(v.reshape(-1)[0]) if v is not None and v.size == 1 else None


def _other(node: onnx.NodeProto, name: str) -> str:
    return node.input[1] if node.input[0] == name else node.input[0]


def _rms_norm(gr: Graph, pow_node: onnx.NodeProto):
    """(nodes replaced, x, weight, epsilon, output) when pow_node starts an RMS norm written out, else None."""
    x = pow_node.input[0]
    if gr.scalar(pow_node.input[1]) != 2.0:
        return None
    mean = gr.only_consumer(pow_node.output[0], "ReduceMean")
    if mean is None:
        return None
    axes = gr.value(mean.input[1]) if len(mean.input) > 1 else None
    keep = next((a.i for a in mean.attribute if a.name == "keepdims"), 1)
    if axes is None or axes.reshape(-1).tolist() != [-1] or keep != 1:
        return None
    add = gr.only_consumer(mean.output[0], "Add")
    eps = gr.scalar(_other(add, mean.output[0])) if add is not None else None
    sqrt = gr.only_consumer(add.output[0], "Sqrt") if eps is not None else None
    recip = gr.only_consumer(sqrt.output[0], "Reciprocal") if sqrt is not None else None
    scale = gr.only_consumer(recip.output[0], "Mul") if recip is not None else None
    if scale is None or _other(scale, recip.output[0]) != x:
        return None
    gain = gr.only_consumer(scale.output[0], "Mul")
    if gain is None:
        return None
    weight = _other(gain, scale.output[0])
    w = gr.value(weight)
    if w is None or w.ndim != 1:
        return None
    return [pow_node, mean, add, sqrt, recip, scale, gain], x, weight, eps, gain.output[0]


def fuse_norms(proto: onnx.ModelProto) -> Counter:
    """Rewrite every RMS norm (and the residual Add before it) in place; returns how many of each."""
    gr = Graph(proto)
    done: Counter = Counter()
    drop: set[int] = set()
    new: dict[int, onnx.NodeProto] = {}  # index of the node it replaces -> fused node
    for pow_node in [n for n in gr.g.node if n.op_type == "Pow"]:
        found = _rms_norm(gr, pow_node)
        if found is None:
            continue
        nodes, x, weight, eps, out = found
        residual = gr.producer.get(x)
        a, b = residual.input if residual is not None and residual.op_type == "Add" else ("", "")
        skip = residual is not None and residual.op_type == "Add" and gr.value(a) is None and gr.value(b) is None \
            and id(residual) not in drop
        if skip:
            fused = helper.make_node("SkipSimplifiedLayerNormalization", [a, b, weight], [out, "", "", x],
                                     name=f"{residual.name or x}_skipnorm", domain=MS_DOMAIN, epsilon=eps)
            drop.add(id(residual))
            done["SkipSimplifiedLayerNormalization"] += 1
        else:
            fused = helper.make_node("SimplifiedLayerNormalization", [x, weight], [out],
                                     name=f"{pow_node.name or out}_norm", axis=-1, epsilon=eps, stash_type=1)
            done["SimplifiedLayerNormalization"] += 1
        drop.update(id(n) for n in nodes)
        new[id(pow_node)] = fused
    kept = []
    for n in gr.g.node:
        if id(n) in new:
            kept.append(new[id(n)])
        elif id(n) not in drop:
            kept.append(n)
    # a fused node sits where its Pow was: after x's producer; a SkipSimplified also needs both Add inputs,
    # which were ready before the Add, itself before the Pow
    gr.g.ClearField("node")
    gr.g.node.extend(_topological(kept, {i.name for i in gr.g.input} | set(gr.inits)))
    return done


def _topological(nodes: list[onnx.NodeProto], ready: set[str]) -> list[onnx.NodeProto]:
    ready = set(ready) | {""}
    out, waiting = [], list(nodes)
    while waiting:
        rest = []
        for n in waiting:
            if all(i in ready for i in n.input):
                out.append(n)
                ready.update(n.output)
            else:
                rest.append(n)
        if len(rest) == len(waiting):
            raise ValueError(f"graph has a cycle or a missing input at {rest[0].op_type} {rest[0].name}")
        waiting = rest
    return out


def drop_maps(proto: onnx.ModelProto, output: str = "attentions") -> None:
    """Remove the maps output, the probabilities each Attention node returns for it, and every dead node."""
    g = proto.graph
    for o in [o for o in g.output if o.name == output]:
        g.output.remove(o)
    for n in g.node:
        if n.op_type == "Attention" and n.domain in ("", "ai.onnx") and len(n.output) > 3:
            del n.output[3:]
            kept = [a for a in n.attribute if a.name != "qk_matmul_output_mode"]
            n.ClearField("attribute")
            n.attribute.extend(kept)
    prune(proto)


def prune(proto: onnx.ModelProto) -> None:
    """Remove every node, initializer and value_info no graph output needs (a name a node's subgraph reads from the
    graph around it counts as its input)."""
    g = proto.graph
    needed = {o.name for o in g.output}
    live = []
    for n in reversed(list(g.node)):
        if any(o in needed for o in n.output):
            live.append(n)
            needed.update(i for i in n.input if i)
            needed.update(_subgraph_reads(n))
    g.ClearField("node")
    g.node.extend(reversed(live))
    for field in ("initializer", "value_info"):
        kept = [i for i in getattr(g, field) if i.name in needed]
        g.ClearField(field)
        getattr(g, field).extend(kept)


def gather_logits(proto: onnx.ModelProto) -> bool:
    """Give the graph the `logits_positions` input: the hidden states before the output head gathered at those
    positions of each row; False (graph untouched) when the head cannot be found as a MatMul followed only by
    per-position operators."""
    gr = Graph(proto)
    node = gr.producer.get("logits")
    while node is not None and node.op_type in PER_POSITION:  # back over a bias or soft-cap to the head
        data = [i for i in node.input if gr.value(i) is None]
        node = gr.producer.get(data[0]) if len(data) == 1 else None
    weight = gr.value(node.input[1]) if node is not None and node.op_type == "MatMul" else None
    if weight is None or weight.ndim != 2:
        return False
    hidden = node.input[0]
    axes, shape, index, picked = (f"{LOGITS_POSITIONS}_{k}" for k in ("axes", "shape", "index", "hidden"))
    proto.graph.initializer.extend([numpy_helper.from_array(np.array([2], np.int64), axes),
                                    numpy_helper.from_array(np.array([1, 1, weight.shape[0]], np.int64), shape)])
    proto.graph.input.append(helper.make_tensor_value_info(LOGITS_POSITIONS, onnx.TensorProto.INT64,
                                                           ["batch_size", "logits_count"]))
    node.input[0] = picked
    out = next(o for o in proto.graph.output if o.name == "logits")
    out.type.tensor_type.shape.dim[1].ClearField("dim_value")
    out.type.tensor_type.shape.dim[1].dim_param = "logits_count"
    at = list(proto.graph.node).index(node)
    # (B, K) -> (B, K, 1) -> (B, K, hidden): GatherElements takes, for each row and k, position[b, k]'s vector
    for i, (op, ins, out_name) in enumerate([("Unsqueeze", [LOGITS_POSITIONS, axes], f"{index}_1"),
                                             ("Expand", [f"{index}_1", shape], index),
                                             ("GatherElements", [hidden, index], picked)]):
        extra = {"axis": 1} if op == "GatherElements" else {}
        proto.graph.node.insert(at + i, helper.make_node(op, ins, [out_name], name=f"{out_name}_{op}", **extra))
    return True


def share_tied_table(proto: onnx.ModelProto) -> bool:
    """Store a tied embedding table once.  onnxruntime's basic pass folds the head's Transpose of the (vocabulary,
    hidden) table into a second, (hidden, vocabulary) initializer, so a tied model's fast graph carried a vocabulary's
    worth of weights twice.  The embedding's Gather reads the head's copy along axis 1 instead (a (hidden, batch,
    tokens) result, transposed back: a few rows, not the table) and the first copy goes.  False when the graph has
    no such pair (an untied head, an embedding read elsewhere)."""
    gr = Graph(proto)
    ranks = {i.name: len(i.type.tensor_type.shape.dim) for i in gr.g.input}
    for node in gr.g.node:
        table = gr.inits.get(node.input[0]) if node.op_type == "Gather" else None
        axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
        if (table is None or len(table.dims) != 2 or axis != 0 or ranks.get(node.input[1]) != 2
                or len(gr.consumers[table.name]) != 1 or table.name in gr.outputs):
            continue
        rows = numpy_helper.to_array(table)
        head = next((i for i in gr.inits.values() if list(i.dims) == list(table.dims)[::-1]
                     and i.data_type == table.data_type and np.array_equal(numpy_helper.to_array(i), rows.T)), None)
        if head is None:
            continue
        columns = f"{node.output[0]}_columns"
        node.input[0] = head.name
        node.ClearField("attribute")
        node.attribute.append(helper.make_attribute("axis", 1))
        at = list(gr.g.node).index(node)
        gr.g.node.insert(at + 1, helper.make_node("Transpose", [columns], [node.output[0]], perm=[1, 2, 0],
                                                  name=f"{columns}_Transpose"))
        node.output[0] = columns
        gr.g.initializer.remove(table)
        return True
    return False


def all_nodes(graph: onnx.GraphProto) -> Iterator[onnx.NodeProto]:
    """Every node of the graph and of its nodes' subgraphs (If, Loop, Scan bodies, nested), depth first."""
    for node in graph.node:
        yield node
        for sub in _subgraphs(node):
            yield from all_nodes(sub)


def _subgraphs(node: onnx.NodeProto) -> list[onnx.GraphProto]:
    return [g for a in node.attribute for g in ([a.g] if a.type == onnx.AttributeProto.GRAPH else a.graphs)]


def _subgraph_reads(node: onnx.NodeProto) -> set[str]:
    """Every name the node's subgraphs (nested ones too) name as an input of their nodes (a subgraph's output is one
    of its own nodes' outputs: onnx's checker refuses one named from the graph around it)."""
    return {i for sub in _subgraphs(node) for inner in all_nodes(sub) for i in inner.input if i}
