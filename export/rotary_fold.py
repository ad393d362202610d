"""The compact fast graph's rotations moved into GroupQueryAttention: one node per layer where there were six.

After export.gqa's rewrite, each layer of a RoPE model reads its attention like this: one MatMul (q, k and v
projected together), three Slices of its output, a RotaryEmbedding-23 on q and one on k (each token's cos and sin
given per token, computed in the graph from its position), and GroupQueryAttention.  onnxruntime's
GroupQueryAttention can take the projection whole (q, k and v packed along the last axis, in that order) and rotate
q and k itself (do_rotary=1): it looks up each token's cos and sin in tables of (positions, rotary width / 2) at the
token's slot, which in the compact layout is its position.  onnxruntime-genai's own graphs have this form.  A step
then runs 150 fewer operators on a 30-layer model, each of which cost a thread-pool dispatch on top of its work.

The tables stay computed in the graph, from the graph's own angle computation: the chain of nodes that turns each
token's position into its cos and sin (a Cast, an Unsqueeze, a Mul by the inverse frequencies, a RoPE scaling's
factors...) is copied, fed the positions 0 .. total_sequence_length - 1 instead of the tokens' own, so every
scaling that does not depend on the row's length (those export.gqa lets into the compact layout) gives each
position the angle the per-token chain gives it.

A layer is folded only where the pattern is exactly this: the three Slices cut one tensor along its last axis at
q_heads x head_dim and (q_heads + kv_heads) x head_dim, to its end; both rotations rotate the whole head
(rotary_embedding_dim 0), read no position_ids and the same cos and sin; the angle chain reaches the positions
through single-input elementwise and shape operators.  Other layers (q and k normalised before the rotation, a
partial rotation, ...) keep their nodes: a graph may mix both.  onnxruntime rotates inside GroupQueryAttention
only heads whose size is a multiple of 16: other models keep every layer's nodes.  export.fuse's parity check
against the exact graph holds either way.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper

from export.rewrite import Graph

CHAIN_OPS = {"Cast", "Unsqueeze", "Mul", "Div", "Add", "Sub", "Cos", "Sin", "Reshape"}
TABLE = "rotary_table"  # prefix of the names this module adds


def _const(gr: Graph, name: str) -> bool:
    return name == "" or gr.value(name) is not None


def _slice_span(gr: Graph, node: onnx.NodeProto) -> tuple[int, int] | None:
    """(start, end) of a Slice along the last axis with constant bounds and step 1, else None."""
    if node.op_type != "Slice" or len(node.input) < 4:
        return None
    starts, ends, axes = (gr.value(n) for n in node.input[1:4])
    steps = gr.value(node.input[4]) if len(node.input) > 4 and node.input[4] else np.ones(1)
    if starts is None or ends is None or axes is None or steps is None or starts.size != 1:
        return None
    if int(axes.reshape(-1)[0]) not in (-1, 2) or int(steps.reshape(-1)[0]) != 1:
        return None
    return int(starts.reshape(-1)[0]), int(ends.reshape(-1)[0])


def _positions(gr: Graph, out: str) -> tuple[str, list[onnx.NodeProto]] | None:
    """(the positions tensor, the chain's nodes from it to `out`, first to last) for a cos or sin input."""
    chain: list[onnx.NodeProto] = []
    name = out
    while True:
        node = gr.producer.get(name)
        if node is None or node.op_type not in CHAIN_OPS:
            break
        live = [i for i in node.input if not _const(gr, i)]
        if len(live) != 1:
            break
        chain.append(node)
        name = live[0]
    if not chain or chain[0].op_type not in ("Cos", "Sin"):
        return None
    return name, chain[::-1]


def _rotation(gr: Graph, name: str) -> onnx.NodeProto | None:
    node = gr.producer.get(name)
    if node is None or node.op_type != "RotaryEmbedding" or node.domain not in ("", "ai.onnx") or len(node.input) != 3:
        return None
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    return node if not attrs.get("rotary_embedding_dim", 0) else None


def fold(proto: onnx.ModelProto, head_dim: int) -> int:
    """Fold the rotations of every layer that allows it into its GroupQueryAttention (in place); returns how many
    layers were folded.  The Slices and RotaryEmbeddings left without readers stay for the caller to prune."""
    if head_dim % 16:  # onnxruntime's rotation inside GroupQueryAttention takes heads of 16 lanes at a time
        return 0
    gr = Graph(proto)
    g = proto.graph
    tables: dict[tuple[str, str], tuple[str, str]] = {}  # (cos, sin) -> the tables made for them
    added: list[onnx.NodeProto] = []
    total = ""  # the table positions' name, once the first pair of tables made them
    folded = 0
    for node in g.node:
        if node.op_type != "GroupQueryAttention" or len(node.input) != 7:
            continue
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        heads, kv_heads = int(attrs["num_heads"]), int(attrs["kv_num_heads"])
        rq, rk = _rotation(gr, node.input[0]), _rotation(gr, node.input[1])
        sv = gr.producer.get(node.input[2])
        if rq is None or rk is None or sv is None or rq.input[1:] != rk.input[1:]:
            continue
        sq, sk = gr.producer.get(rq.input[0]), gr.producer.get(rk.input[0])
        if sq is None or sk is None or not (sq.input[0] == sk.input[0] == sv.input[0]):
            continue
        q_end, k_end = heads * head_dim, (heads + kv_heads) * head_dim
        spans = [_slice_span(gr, s) for s in (sq, sk, sv)]
        # v runs to the end: GroupQueryAttention took it as kv_heads x head_dim, so the tensor is exactly that wide
        # where the Slice's end is past it, and is checked where the end is the width itself
        width = k_end + kv_heads * head_dim
        if spans[0] != (0, q_end) or spans[1] != (q_end, k_end) or spans[2] is None or spans[2][0] != k_end \
                or spans[2][1] < width or (spans[2][1] == width and _width(gr, sq.input[0]) != width):
            continue
        interleaved = int({a.name: helper.get_attribute_value(a) for a in rq.attribute}.get("interleaved", 0))
        key = (rq.input[1], rq.input[2])
        if key not in tables:
            made = _tables(gr, *key, total, len(tables))
            if made is None:
                continue
            nodes, cos, sin, total = made
            added += nodes
            tables[key] = (cos, sin)
        cos, sin = tables[key]
        inputs = [sq.input[0], "", "", *node.input[3:7], cos, sin]
        attrs.update(do_rotary=1, rotary_interleaved=interleaved)
        node.CopyFrom(helper.make_node("GroupQueryAttention", inputs, list(node.output), name=node.name,
                                       domain=node.domain, **attrs))
        folded += 1
    if added:  # the tables ahead of every node (they read graph inputs and constants only)
        rest = list(g.node)
        del g.node[:]
        g.node.extend(added + rest)
    return folded


def _tables(gr: Graph, cos_in: str, sin_in: str, total: str, index: int
            ) -> tuple[list[onnx.NodeProto], str, str, str] | None:
    """Nodes computing (positions, width) cos and sin tables from the chains that give cos_in and sin_in per
    token (`index`: how many pairs of tables came before, for fresh names); (nodes, cos table, sin table, the
    positions' name), or None when a chain is not one `_positions` reads.  total: the positions' name where an
    earlier pair made them, else ""."""
    found = [_positions(gr, cos_in), _positions(gr, sin_in)]
    if found[0] is None or found[1] is None or found[0][0] != found[1][0]:
        return None
    source = found[0][0]
    source_type = _elem_type(gr, source)
    if source_type is None and found[0][1][0].op_type != "Cast":  # the positions' type unknown: not int64 for sure
        return None
    nodes: list[onnx.NodeProto] = []
    tag = f"{TABLE}{index}"
    if not total:  # positions 0 .. total_sequence_length - 1, shaped (1, total) as the tokens' (batch, new)
        total = f"{TABLE}_positions"
        nodes += [
            helper.make_node("Cast", ["total_sequence_length"], [f"{TABLE}_total"], to=TensorProto.INT64),
            helper.make_node("Range", [f"{TABLE}_zero", f"{TABLE}_total", f"{TABLE}_one"], [f"{TABLE}_range"]),
            helper.make_node("Unsqueeze", [f"{TABLE}_range", f"{TABLE}_axis0"], [total]),
        ]
        gr.g.initializer.extend([helper.make_tensor(f"{TABLE}_zero", TensorProto.INT64, [], [0]),
                                 helper.make_tensor(f"{TABLE}_one", TensorProto.INT64, [], [1]),
                                 helper.make_tensor(f"{TABLE}_axis0", TensorProto.INT64, [1], [0])])
    start = total
    if source_type not in (None, TensorProto.INT64):
        start = f"{tag}_positions"
        nodes.append(helper.make_node("Cast", [total], [start], to=source_type))
    outs = []
    copied: dict[str, str] = {source: start}
    for which, (_, chain) in zip(("cos", "sin"), found, strict=True):
        for node in chain:
            if node.output[0] in copied:
                continue
            name = f"{tag}_{len(copied)}"
            clone = onnx.NodeProto()
            clone.CopyFrom(node)
            clone.name = name
            del clone.input[:]
            clone.input.extend(copied.get(i, i) for i in node.input)
            del clone.output[:]
            clone.output.append(name)
            nodes.append(clone)
            copied[node.output[0]] = name
        table = f"{tag}_{which}"
        nodes.append(helper.make_node("Squeeze", [copied[chain[-1].output[0]], f"{TABLE}_axis0"], [table]))
        outs.append(table)
    return nodes, outs[0], outs[1], total


def _width(gr: Graph, name: str) -> int | None:
    """The last dimension of a projection's output: a MatMul by a weight, or that plus a bias."""
    node = gr.producer.get(name)
    if node is not None and node.op_type == "Add":
        consts = [gr.value(i) for i in node.input if gr.value(i) is not None]
        live = [i for i in node.input if gr.value(i) is None]
        if len(consts) != 1 or len(live) != 1:
            return None
        node = gr.producer.get(live[0])
    if node is None or node.op_type != "MatMul":
        return None
    weight = gr.inits.get(node.input[1])
    return int(weight.dims[-1]) if weight is not None and len(weight.dims) == 2 else None


def _elem_type(gr: Graph, name: str) -> int | None:
    """The element type of a tensor where the graph says it (an input, a value_info, a Cast's target)."""
    for vi in [*gr.g.input, *gr.g.value_info]:
        if vi.name == name:
            return int(vi.type.tensor_type.elem_type)
    node = gr.producer.get(name)
    if node is not None and node.op_type == "Cast":
        return int(helper.get_attribute_value(node.attribute[0]))
    return None
