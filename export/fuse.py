"""The fast graph (fast.onnx): the exact graph without its attention-map output, with onnxruntime's fused
normalisation operators, for the worker's calls where no row asks for maps.

Built from the artifact's own model.onnx, never from the PyTorch model, so it computes what the exact graph
computes and nothing else:
  1. onnxruntime's basic optimisations (constant folding, common subexpressions, dead code) saved to a file: the
     weight transposes the exporter writes become weights stored as MatMul wants them;
  2. the `attentions` output goes, with the probabilities each Attention node returned for it and what only it read;
  3. each RMS norm written out as Pow, ReduceMean, Add, Sqrt, Reciprocal, Mul, Mul becomes one
     SimplifiedLayerNormalization, and a residual Add feeding one becomes SkipSimplifiedLayerNormalization
     (which returns the sum as well), as onnxruntime's own LLaMA graphs have them;
  4. an input `logits_positions` (int64, (batch, count)) picks, per row, the positions (of this call's S tokens) whose
     hidden states reach the output head: every one, or a row's last real token alone, all a prompt whose completion
     is asked for needs (the head is a fifth of a 128-token prompt's arithmetic on a SmolLM-sized model);
  5. where the model allows it (export.gqa), the "compact" layout: each Attention node becomes onnxruntime's
     GroupQueryAttention, rows kept from slot 0 of their cache with their lengths as inputs instead of a mask;
     otherwise the "padded" layout: the exact graph's Attention nodes, rows left-padded under the mask.
Then every output (logits, each present tensor) is compared with the exact graph's on a two-row prefill (padded: the
exact graph's own feeds; compact: right-padded rows against the exact graph's left-padded ones) and cache steps, and
each row's last logits alone; a difference over PARITY refuses the fast graph (export.build raises).
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper, numpy_helper

from export import artifact, gqa
from export.errors import ExportError
from model.checkpoint import sha256_file
from model.cli import Parser
from model.errors import PosencError

log = logging.getLogger(__name__)

FAST_ONNX = "fast.onnx"
PARITY = 1e-4  # largest |fast - exact| allowed on logits and present tensors
MS_DOMAIN = gqa.MS_DOMAIN
# auto: a fast graph for models of this many parameters or more (fewer, larger operators pay on real-size models;
# the tiny default models keep one graph and their export time)
FAST_MIN_PARAMETERS = 10_000_000
FAST_CHOICES = ("auto", "on", "off")
LOGITS_POSITIONS = "logits_positions"  # the fast graph's input: (batch, count) positions whose logits are computed
# operators that may follow the head's MatMul on the way to `logits` (a bias, a soft-cap): each works position by
# position, so gathering positions before the head gives the same rows
PER_POSITION = {"Add", "Mul", "Div", "Tanh", "Cast"}
CASES = {"padded": "2 rows, left-padded, 3 cache steps",
         "compact": "2 rows, right-padded against the exact graph's left-padded, 3 cache steps"}


def basic_optimized(src: Path, tmp: Path) -> onnx.ModelProto:
    """onnxruntime's ORT_ENABLE_BASIC passes applied to src and read back (weights included)."""
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    out = tmp / "basic.onnx"
    opts.optimized_model_filepath = str(out)
    opts.add_session_config_entry("session.optimized_model_external_initializers_file_name", "basic.onnx.data")
    opts.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "1024")
    ort.InferenceSession(str(src), opts, providers=["CPUExecutionProvider"])
    return onnx.load(str(out), load_external_data=True)


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
    """Remove every node, initializer and value_info no graph output needs."""
    g = proto.graph
    needed = {o.name for o in g.output}
    live = []
    for n in reversed(list(g.node)):
        if any(o in needed for o in n.output):
            live.append(n)
            needed.update(i for i in n.input if i)
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


def build_fast(src: Path, dest: Path, meta: dict[str, Any] | None = None) -> dict[str, Any]:
    """dest (fast.onnx) from an exact graph src; returns what was fused and its layout (part of model.json's `fast`
    entry).  With the model's meta, the compact layout where export.gqa allows it; without, padded."""
    with tempfile.TemporaryDirectory(prefix="posenc-fuse-") as tmp:
        proto = basic_optimized(src, Path(tmp))
        drop_maps(proto)
        fused = fuse_norms(proto)
        why = gqa.ineligible(meta) if meta is not None else "no model.json given"
        replaced = gqa.rewrite(proto, int(meta["sizes"]["n_layers"])) if why is None else 0
        if replaced:
            fused["GroupQueryAttention"] = replaced
        else:  # a graph is compact or padded whole
            log.info("%s: padded fast graph (%s)", src.parent.name, why or "an Attention node GQA cannot replace")
        gathered = gather_logits(proto)
        prune(proto)  # the mask chain GroupQueryAttention does not read
        if not any(o.domain == MS_DOMAIN for o in proto.opset_import):
            proto.opset_import.append(helper.make_opsetid(MS_DOMAIN, 1))
        for stale in (dest, dest.with_name(dest.name + ".data")):
            stale.unlink(missing_ok=True)
        # weights in fast.onnx.data, a file onnxruntime maps: a lower peak while a session loads, and less held after
        onnx.save_model(proto, str(dest), save_as_external_data=True, location=dest.name + ".data")
        if (data := dest.with_name(dest.name + ".data")).exists():  # onnx writes it owner-only: model.onnx's mode
            shutil.copymode(src, data)
    return {"fused": dict(sorted(fused.items())), "nodes": len(proto.graph.node),
            "layout": "compact" if replaced else "padded", "logits_positions": LOGITS_POSITIONS if gathered else None}


def _empty_state(session: ort.InferenceSession, meta: dict[str, Any], batch: int) -> dict[str, np.ndarray]:
    """The carried inputs before any token: KV of length 0, zeros of their declared shape for fixed-size state."""
    shapes = {i.name: i.shape for i in session.get_inputs()}
    return {spec["input"]: np.zeros([batch] + [0 if i == spec.get("sequence_axis") else int(d)
                                               for i, d in enumerate(shapes[spec["input"]][1:], start=1)], np.float32)
            for spec in meta["state"]}


def check_parity(exact: Path, fast: Path, meta: dict[str, Any], steps: int = 3, seed: int = 0) -> float:
    """Largest |fast - exact| over logits and every carried output: a prefill of two rows (7 and 4 tokens), then
    `steps` cache steps, and each row's last logits alone through `logits_positions`.  Padded: both graphs take the
    same left-padded feeds; compact: export.gqa.check_parity.  Both run in onnxruntime with the same options."""
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    opts.intra_op_num_threads = 2
    a = ort.InferenceSession(str(exact), opts, providers=["CPUExecutionProvider"])
    b = ort.InferenceSession(str(fast), opts, providers=["CPUExecutionProvider"])
    inputs = {i.name for i in b.get_inputs()}
    if gqa.SEQLENS in inputs:
        return gqa.check_parity(a, b, meta, LOGITS_POSITIONS, steps, seed) if LOGITS_POSITIONS in inputs else 1e9
    names = ["logits"] + [spec["output"] for spec in meta["state"]]
    rng = np.random.default_rng(seed)
    vocab = int(meta["sizes"]["vocab_size"])
    mask = np.ones((2, 7), np.int64)
    mask[1, :3] = 0
    feeds = {"input_ids": rng.integers(0, vocab, (2, 7), dtype=np.int64), "attention_mask": mask,
             **_empty_state(a, meta, 2)}
    gathered = LOGITS_POSITIONS in inputs
    worst = 0.0
    for step in range(steps + 1):
        new = feeds["input_ids"].shape[1]
        every = {LOGITS_POSITIONS: np.tile(np.arange(new, dtype=np.int64), (2, 1))} if gathered else {}
        want, got = a.run(names, feeds), b.run(names, {**feeds, **every})
        worst = max(worst, *(float(np.abs(x - y).max()) if x.size else 0.0 for x, y in zip(want, got, strict=True)))
        if gathered and step == 0:
            last = b.run(["logits"], {**feeds, LOGITS_POSITIONS: np.full((2, 1), new - 1, np.int64)})[0]
            if last.shape != (2, 1, vocab):
                return float("inf")
            worst = max(worst, float(np.abs(want[0][:, -1:] - last).max()))
        mask = np.concatenate([mask, np.ones((2, 1), np.int64)], axis=1)
        feeds = {"input_ids": want[0][:, -1:].argmax(-1).astype(np.int64), "attention_mask": mask,
                 **{spec["input"]: t for spec, t in zip(meta["state"], want[1:], strict=True)}}
    return worst


def wanted(parameters: int, choice: str = "auto") -> bool:
    """Whether an export writes a fast graph: on, off, or auto (models of FAST_MIN_PARAMETERS or more)."""
    if choice not in FAST_CHOICES:
        raise ExportError(f"fast graph must be one of {', '.join(FAST_CHOICES)}, got {choice!r}")
    return choice == "on" or (choice == "auto" and parameters >= FAST_MIN_PARAMETERS)


def add_fast(folder: Path, meta: dict[str, Any]) -> dict[str, Any]:
    """fast.onnx beside the folder's model.onnx, checked against it (over PARITY: removed, ExportError); the entry."""
    exact, dest = folder / artifact.MODEL_ONNX, folder / FAST_ONNX
    made = build_fast(exact, dest, meta)
    data = dest.with_name(dest.name + ".data")
    worst = check_parity(exact, dest, meta)
    if not worst <= PARITY:
        dest.unlink(missing_ok=True)
        data.unlink(missing_ok=True)
        raise ExportError(f"the fast graph differs from the exact one by {worst:.2e} (over {PARITY:.0e}); not written")
    return {"file": FAST_ONNX, "external_data": data.name if data.exists() else None,
            "source_sha256": sha256_file(exact),
            "parity": {"max_abs_diff": worst, "tolerance": PARITY, "case": CASES[made["layout"]]},
            **made}


def add_to_artifact(folder: Path) -> dict[str, Any]:
    """`python -m export.fuse ARTIFACT`: an existing artifact gains a fast graph (or a new one), the folder
    replaced whole: a copy of hard links is assembled beside it, completed and renamed into place."""
    manifest = artifact.verify(folder)
    meta = artifact.read_json(folder / artifact.MODEL_JSON)
    if meta.get("quantization"):
        # MatMulNBits quantizes its activations per call: a rounding apart in a fused norm moves them a whole step
        # (the peer model's int8 copy: 0.13 on the logits), so a quantized copy cannot be held to PARITY
        raise ExportError(f"{folder} is a quantized copy: its fast graph cannot be checked to {PARITY:.0e} against "
                          "it (its activations are quantized per call)")
    with artifact.staging(folder, force=True) as tmp:
        for name in manifest["files"]:
            if name in (FAST_ONNX, FAST_ONNX + ".data"):
                continue
            try:
                os.link(folder / name, tmp / name)
            except OSError:  # another file system: a copy
                shutil.copyfile(folder / name, tmp / name)
        meta["fast"] = add_fast(tmp, meta)
        (tmp / artifact.MODEL_JSON).unlink()  # a hard link to the old model.json: write a new file
        artifact.write_json(tmp / artifact.MODEL_JSON, meta)
        artifact.write_manifest(tmp, manifest.get("validation"))
    return meta["fast"]


def main(argv: list[str] | None = None) -> int:
    p = Parser(prog="python -m export.fuse", description="Add a fast graph (no attention maps, fused operators) "
               "to an existing artifact, checked against its exact graph.")
    p.add_argument("artifact", help="artifact folder")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        entry = add_to_artifact(Path(args.artifact))
    except OSError as err:
        print(f"error: {err.filename}: {err.strerror or err}", file=sys.stderr)
        return 2
    except PosencError as err:
        print(f"error: {str(err).splitlines()[0]}", file=sys.stderr)
        return 2
    fused = ", ".join(f"{n} {k}" for k, n in entry["fused"].items()) or "nothing fused"
    print(f"{Path(args.artifact).name}: {FAST_ONNX} written ({entry['layout']} layout, {entry['nodes']} nodes; "
          f"{fused}; largest difference {entry['parity']['max_abs_diff']:.1e})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
