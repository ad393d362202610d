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
     otherwise the "padded" layout: the exact graph's Attention nodes, rows left-padded under the mask; in the
     compact layout, each layer's q/k/v Slices and rotations go into its GroupQueryAttention (export.rotary_fold).
Steps 2-4 are export/rewrite.py's graph rewrites.  Then every output (logits, each present tensor) is compared with
the exact graph's on a two-row prefill (padded: the exact graph's own feeds; compact: right-padded rows against the
exact graph's left-padded ones) and cache steps, and each row's last logits alone; a difference over PARITY refuses
the fast graph (export.build raises).
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper

from export import artifact, gqa, rotary_fold
from export.errors import ExportError
from export.half import HALF_ONNX, add_half
from export.rewrite import LOGITS_POSITIONS, drop_maps, fuse_norms, gather_logits, prune, share_tied_table
from model.cli import Parser
from model.errors import PosencError
from model.files import sha256_file

log = logging.getLogger(__name__)

FAST_ONNX = "fast.onnx"
PARITY = 1e-4  # largest |fast - exact| allowed on logits and present tensors
MS_DOMAIN = gqa.MS_DOMAIN
# auto: a fast graph for models of this many parameters or more (fewer, larger operators pay on real-size models;
# the tiny default models keep one graph and their export time)
FAST_MIN_PARAMETERS = 10_000_000
FAST_CHOICES = ("auto", "on", "off")
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


def build_fast(src: Path, dest: Path, meta: dict[str, Any] | None = None, layout: str | None = None
               ) -> dict[str, Any]:
    """dest (fast.onnx) from an exact graph src; returns what was fused and its layout (part of model.json's `fast`
    entry).  With the model's meta, the compact layout where export.gqa allows it; without, padded.  `layout`: the
    one a fast graph of this model already has (a quantized copy rebuilds its source's), not asked again (asking
    imports the variants' classes, and torch with them)."""
    with tempfile.TemporaryDirectory(prefix="posenc-fuse-") as tmp:
        proto = basic_optimized(src, Path(tmp))
        drop_maps(proto)
        fused = fuse_norms(proto)
        if layout is not None:
            why = None if layout == "compact" else f"the source's fast graph is {layout}"
        else:
            why = gqa.ineligible(meta) if meta is not None else "no model.json given"
        replaced = gqa.rewrite(proto, int(meta["sizes"]["n_layers"])) if why is None else 0
        if replaced:
            fused["GroupQueryAttention"] = replaced
            if folded := rotary_fold.fold(proto, int(meta["sizes"]["head_dim"])):
                fused["GroupQueryAttention do_rotary"] = folded
        else:  # a graph is compact or padded whole
            log.info("%s: padded fast graph (%s)", src.parent.name, why or "an Attention node GQA cannot replace")
        gathered = gather_logits(proto)
        prune(proto)  # the mask chain GroupQueryAttention does not read
        tied = share_tied_table(proto)
        if not any(o.domain == MS_DOMAIN for o in proto.opset_import):
            proto.opset_import.append(helper.make_opsetid(MS_DOMAIN, 1))
        for stale in (dest, dest.with_name(dest.name + ".data")):
            stale.unlink(missing_ok=True)
        # weights in fast.onnx.data, a file onnxruntime maps: a lower peak while a session loads, and less held after
        onnx.save_model(proto, str(dest), save_as_external_data=True, location=dest.name + ".data")
        if (data := dest.with_name(dest.name + ".data")).exists():  # onnx writes it owner-only: model.onnx's mode
            shutil.copymode(src, data)
    return {"fused": dict(sorted(fused.items())), "nodes": len(proto.graph.node),
            "layout": "compact" if replaced else "padded", "logits_positions": LOGITS_POSITIONS if gathered else None,
            "tied_table_once": tied}


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


def add_to_artifact(folder: Path, half: bool = False) -> dict[str, Any]:
    """`python -m export.fuse ARTIFACT [--half]`: an existing artifact gains a fast graph (or a new one), and with
    `half` its float16 copy (export/half.py), the folder replaced whole: a copy of hard links is assembled beside
    it, completed and renamed into place."""
    manifest = artifact.verify(folder)
    meta = artifact.read_json(folder / artifact.MODEL_JSON)
    if meta.get("quantization"):
        # MatMulNBits quantizes its activations per call: a rounding apart in a fused norm moves them a whole step
        # (the peer model's int8 copy: 0.13 on the logits), so a quantized copy cannot be held to PARITY
        raise ExportError(f"{folder} is a quantized copy: its fast graph cannot be checked to {PARITY:.0e} against "
                          "it (its activations are quantized per call); `export quantize` of the fp32 artifact "
                          "writes one held to the budget")
    with artifact.staging(folder, force=True) as tmp:
        for name in manifest["files"]:
            if name in (FAST_ONNX, FAST_ONNX + ".data", HALF_ONNX, HALF_ONNX + ".data"):
                continue
            try:
                os.link(folder / name, tmp / name)
            except OSError:  # another file system: a copy
                shutil.copyfile(folder / name, tmp / name)
        meta["fast"] = add_fast(tmp, meta)
        if half:
            meta["fast"]["half"] = add_half(tmp, meta, meta["fast"])
        (tmp / artifact.MODEL_JSON).unlink()  # a hard link to the old model.json: write a new file
        artifact.write_json(tmp / artifact.MODEL_JSON, meta)
        artifact.write_manifest(tmp, manifest.get("validation"))
    return meta["fast"]


def main(argv: list[str] | None = None) -> int:
    p = Parser(prog="python -m export.fuse", description="Add a fast graph (no attention maps, fused operators) "
               "to an existing artifact, checked against its exact graph.")
    p.add_argument("artifact", help="artifact folder")
    p.add_argument("--half", action="store_true", help="also a float16 copy (fast16.onnx) for --provider cuda, held "
                                                       "to a budget against the exact graph on held-out text")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        entry = add_to_artifact(Path(args.artifact), args.half)
    except OSError as err:
        print(f"error: {err.filename}: {err.strerror or err}", file=sys.stderr)
        return 2
    except PosencError as err:
        print(f"error: {str(err).splitlines()[0]}", file=sys.stderr)
        return 2
    fused = ", ".join(f"{n} {k}" for k, n in entry["fused"].items()) or "nothing fused"
    print(f"{Path(args.artifact).name}: {FAST_ONNX} written ({entry['layout']} layout, {entry['nodes']} nodes; "
          f"{fused}; largest difference {entry['parity']['max_abs_diff']:.1e})")
    if "half" in entry:
        rows = "; ".join(f"{r['length']} tokens: top-1 {r['top1_agreement']:.3f}, nats/byte x{r['nats_ratio']:.3f}"
                         for r in entry["half"]["budget"]["rows"])
        print(f"{Path(args.artifact).name}: {HALF_ONNX} written (float16; {rows})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
