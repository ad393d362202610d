"""Checkpoint (or random weights) -> ONNX artifact, with torch.onnx's dynamo exporter.

One graph serves prefill (past length 0) and decode.  Every positional computation happens in the graph from
the attention mask, so the graph has no length baked in; the validator proves it (export.validate).
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import time
import warnings
from pathlib import Path
from typing import Any

import onnx
import torch
from torch.export import Dim

from export import artifact, dynamo, fuse, intervene, profile
from export.dynamo import onnx_export
from export.encoding import export_encoding
from export.errors import ExportError
from export.signature import input_names, name_dims, output_names, past_dims, spec_of
from export.validate import validate_folder
from export.wrapper import GraphModule, example_inputs
from model import checkpoint, rope_scaling
from model.config import preset
from model.tokenizer import NAME as TOKENIZER_NAME
from model.transformer import Transformer
from model.variants import max_positions

log = logging.getLogger(__name__)

SUPPORTED_OPSETS = range(18, 24)
DEFAULT_OPSET = 23
# How attention is written in the graph: "explicit" (MatMul, Add, Softmax, MatMul at any supported opset) or
# "onnx" (one Attention-23 node per layer returning the probabilities, RoPE as RotaryEmbedding-23; opset 23).
# "onnx" is the default: 5-17% faster on onnxruntime 1.32 CPU (bench/results), the same parity checks.
ATTENTION_KINDS = ("explicit", "onnx")
DEFAULT_ATTENTION = "onnx"
ONNX_OPS_OPSET = 23
# Graphs whose weights pass this many bytes keep them in model.onnx.data beside model.onnx (onnxruntime reads it
# from the same folder).  A single ONNX protobuf is limited to 2 GB, and onnxruntime loading a graph with embedded
# weights holds the parsed protobuf and its own tensors at once (about twice the weights at its peak; with the
# weights in a file beside it, about once), so every real-size model (an imported one, the peers' model) uses it.
EXTERNAL_DATA_BYTES = 64 * 2**20
CHAT_TEMPLATE = "chat_template.jinja"  # the chat template's file in an artifact (and in a Hugging Face folder)

def weight_bytes(model: Transformer) -> int:
    return sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))


def export_onnx(model: Transformer, path: Path, opset: int, attention: str = DEFAULT_ATTENTION,
                external_data: bool | None = None) -> dict[str, Any]:
    """Write the graph to `path`; external_data None: only when the weights would not fit one protobuf."""
    if opset not in SUPPORTED_OPSETS:
        raise ExportError(f"unsupported opset {opset}; supported: {SUPPORTED_OPSETS.start}-{SUPPORTED_OPSETS.stop - 1}")
    if attention not in ATTENTION_KINDS:
        raise ExportError(f"unknown attention kind {attention!r}; known: {', '.join(ATTENTION_KINDS)}")
    if attention == "onnx" and opset < ONNX_OPS_OPSET:
        raise ExportError(f"attention 'onnx' (Attention-23, RotaryEmbedding-23) needs opset {ONNX_OPS_OPSET}, "
                          f"got {opset}")
    cfg = model.cfg
    spec = spec_of(model)
    ids, mask, past = example_inputs(model)
    batch, new, past_len = Dim("batch"), Dim("new"), Dim("past", min=0)
    # The mask spans past + new; Dim.AUTO lets torch.export derive that relation instead of a guard failing.
    dynamic = ({0: batch, 1: new}, {0: batch, 1: Dim.AUTO}, past_dims(spec, batch, past_len))
    start = time.perf_counter()
    if external_data is None:
        external_data = weight_bytes(model) > EXTERNAL_DATA_BYTES

    def trace(module: GraphModule) -> Any:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model.use_onnx_ops(attention == "onnx")
            try:
                # optimize=False: onnxscript's optimizer folds weights into new initializers, and validation rebuilds
                # the PyTorch reference from the initializers by parameter name; onnxruntime folds at load anyway
                return onnx_export(module, (ids, mask, past), opset_version=opset, input_names=input_names(spec),
                                   output_names=output_names(spec), dynamic_shapes=dynamic, external_data=False,
                                   optimize=False, verbose=False)
            finally:
                model.use_onnx_ops(False)  # the reference the graph is validated against is the explicit model

    if external_data:
        # Written from the exporter's IR, which refers to the parameters themselves: the weights stream to
        # model.onnx.data without a whole in-memory proto (a second copy of them) first; then the small graph
        # is read back without its data, its dims named, and rewritten in place
        program = trace(GraphModule(model))
        program.save(str(path), external_data=True)
        del program
        data = path.with_name(path.name + ".data")
        if data.name != artifact.MODEL_DATA:
            data.rename(path.parent / artifact.MODEL_DATA)
        proto = onnx.load(str(path), load_external_data=False)
        for init in proto.graph.initializer:
            for entry in init.external_data:
                if entry.key == "location":
                    entry.value = artifact.MODEL_DATA
        traced = True
    else:
        # a graph kept by the digest of what it is traced from, its weights apart (export.dynamo; the test suite's
        # folder): written with this model's weights instead of traced again
        proto, traced = dynamo.export_kept(GraphModule(model), ("model", opset, attention, __file__,
                                                               json.dumps(spec, sort_keys=True)),
                                           lambda module: trace(module).model_proto)
    name_dims(proto, spec)
    onnx.save_model(proto, str(path))  # external initializers keep their references; no data is loaded or written
    log.info("%s %s in %.1fs (%d nodes)", "exported" if traced else "from the graph cache:", cfg.variant,
             time.perf_counter() - start, len(proto.graph.node))
    return spec


def model_json(model: Transformer, name: str, opset: int, spec: dict[str, Any], source: dict[str, Any],
               training: dict[str, Any], attention: str = DEFAULT_ATTENTION,
               tokenizer: dict[str, Any] | None = None) -> dict[str, Any]:
    cfg = model.cfg
    return {
        "format": artifact.FORMAT,
        "name": name,
        "variant": cfg.variant,
        "config": cfg.to_dict(),
        "layers": cfg.layer_plan(),  # each layer's attention (full / sliding W), encoding, RoPE base, soft-cap
        "sizes": {"vocab_size": cfg.vocab_size, "d_model": cfg.d_model, "n_heads": cfg.n_heads,
                  "n_kv_heads": cfg.kv_heads, "n_layers": cfg.n_layers, "head_dim": cfg.head_dim, "d_mlp": cfg.d_mlp,
                  "parameters": sum(p.numel() for p in model.parameters())},
        "tokenizer": tokenizer or {"type": TOKENIZER_NAME, "vocab_size": cfg.vocab_size},
        "max_positions": max_positions(cfg),
        # a prompt runs in one call, never in pieces: the RoPE scaling's frequencies follow the length reached
        "whole_prompts": rope_scaling.get(cfg.rope_scaling).length_dependent,
        "trained_context": cfg.context,
        "opset": opset,
        "attention": attention,
        **spec,
        "source": source,
        "training": training,
        "heldout_loss": training.get("heldout_loss"),
    }


def load_source(checkpoint_dir: str | None, init: str | None, variant: str | None,
                preset_name: str, seed: int) -> tuple[Transformer, dict[str, Any], dict[str, Any]]:
    if checkpoint_dir:
        model, meta = checkpoint.load(checkpoint_dir)
        source = {"kind": "checkpoint", "path": str(checkpoint_dir),
                  "sha256": meta["files"][checkpoint.WEIGHTS]["sha256"]}
        return model, source, meta.get("training", {})
    if init != "random" or not variant:
        raise ExportError("give --checkpoint DIR, --checkpoints DIR, or --init random --variant NAME")
    torch.manual_seed(seed)
    model = Transformer(preset(preset_name, variant)).eval()
    return model, {"kind": "random", "preset": preset_name, "seed": seed}, {}


def tokenizer_entry(vocab_size: int, special: dict[str, Any], chat: dict[str, Any] | None = None) -> dict[str, Any]:
    """model.json's tokenizer for an artifact carrying a tokenizer.json (the `tokenizers` library's format).
    chat: {"template": Jinja source, "tokens": {"bos_token": "<s>", ...}}, written to chat_template.jinja and
    recorded as `chat_template`: the file, its sha256, the source (the worker renders it from model.json, which the
    manifest vouches for) and the special token strings."""
    entry = {"type": artifact.HF_TOKENIZER, "file": artifact.TOKENIZER_JSON, "vocab_size": vocab_size,
             **{k: v for k, v in special.items() if v is not None}}
    if chat is not None:
        digest = hashlib.sha256(chat["template"].encode("utf-8")).hexdigest()
        entry["chat_template"] = {"file": CHAT_TEMPLATE, "sha256": digest, "template": chat["template"],
                                  "tokens": dict(chat.get("tokens") or {})}
    return entry


def build_artifact(model: Transformer, out: Path, *, name: str, opset: int, source: dict[str, Any],
                   training: dict[str, Any], force: bool, validate: bool = True,
                   attention: str = DEFAULT_ATTENTION, tokenizer: tuple[Path, dict[str, Any]] | None = None,
                   extra: dict[str, Any] | None = None, external_data: bool | None = None, fast: str = "auto",
                   interventions: bool = True):
    """Export, validate and write the artifact atomically; returns the validation report (or None).

    tokenizer: (tokenizer.json to copy in, its model.json entry); default the byte tokenizer.  extra: more
    model.json keys (an import's validation_max_length, its family).  fast: auto, on or off: the fast graph
    beside the exact one (export.fuse; auto: models of fuse.FAST_MIN_PARAMETERS or more).  interventions: the
    intervention graph beside it (export/intervene.py: positions, switches and ablations as inputs)."""
    report = None
    with artifact.staging(out, force) as tmp:
        spec = export_onnx(model, tmp / artifact.MODEL_ONNX, opset, attention, external_data)
        entry = None
        if tokenizer is not None:
            shutil.copyfile(tokenizer[0], tmp / artifact.TOKENIZER_JSON)
            entry = tokenizer[1]
            chat = entry.get("chat_template")
            if chat is not None:  # covered by the manifest like every file of the folder
                (tmp / chat["file"]).write_bytes(chat["template"].encode("utf-8"))
        meta = model_json(model, name, opset, spec, source, training, attention, entry)
        if (tmp / artifact.MODEL_DATA).exists():
            meta["onnx_external_data"] = artifact.MODEL_DATA
        meta.update(extra or {})
        meta["encoding"] = export_encoding(model.pos, tmp, opset)
        artifact.write_json(tmp / artifact.MODEL_JSON, meta)
        if validate:
            report = validate_folder(tmp, reference=model, verify_manifest=False)
            if not report.passed:
                raise ExportError(f"validation failed for {name}:\n{report.format_table()}")
        if fuse.wanted(meta["sizes"]["parameters"], fast):
            try:
                meta["fast"] = fuse.add_fast(tmp, meta)
            except ExportError as err:  # asked for: refused; by default the artifact keeps its exact graph alone
                if fast == "on":
                    raise
                log.warning("%s: no fast graph: %s", name, err)
            artifact.write_json(tmp / artifact.MODEL_JSON, meta)
        meta["profile"] = profile.add_profile(tmp, meta)  # attention profiles reduced in the graph (export/profile.py)
        if interventions:
            meta["intervene"] = intervene.add_intervene(tmp, model, meta)
        artifact.write_json(tmp / artifact.MODEL_JSON, meta)
        artifact.write_manifest(tmp, report.to_dict() if report else None)
    return report
