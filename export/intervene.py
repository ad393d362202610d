"""The intervention graph (intervene.onnx): the exact graph with the positions and what they do as inputs, so one
artifact answers "what if" questions per request without a re-export.

Inputs beside the exact graph's (ARCHITECTURE.md section 4), each per batch row:

  position_ids [batch, total] int64   every slot's position, past + new (the exact graph counts them from the mask:
                                       cumsum - 1); pad slots are masked whatever they hold
  positional_on [batch, L] float32     1 keeps layer l's positional computation, 0 removes it: the rotation by the
                                       identity, the layer's score bias zero (a NoPE ablation of that layer)
  head_keep [batch, L, H] float32      1 keeps head h's output in layer l, 0 zeroes it before the output projection
  rope_inv_freq [batch, d_rot/2], rope_attention_factor [batch], rope_override [batch]   (RoPE models only)
                                       the frequencies and cos/sin factor of the layers that rotate with the model's
                                       own scaling, used where rope_override is 1 (another scaling for that row);
                                       where it is 0 the graph computes the model's own

Outputs are the exact graph's: logits, attentions, present.*.  With position_ids = cumsum(mask) - 1, every switch 1
and rope_override 0, it computes what the exact graph does.  The graph is traced from the PyTorch model
(model.attention.Intervention), never rewritten from model.onnx (a model with mixers: from the same trace as its
maps graph, below); where model.onnx keeps its weights in
model.onnx.data, intervene.onnx refers to the same bytes there (each tensor checked equal first), so nothing is
stored twice.  `add_intervene` proves it against the PyTorch model on a left-padded batch whose rows carry
different interventions, a cached step, and lengths past the trained context.  intervene_profile.onnx is the
same graph with export/profile.py's reduction appended: profiles under an intervention.

A model with mixers (model/mixers.py, ssm.py, deltanet.py) also gets intervene_maps.onnx: the same graph traced
with Transformer.use_exact_maps, one output more, mixer_maps [batch, M, heads, new, past + new]: the exact matrix
of every channel (a short convolution) or head (Mamba-2, Gated DeltaNet) of the M layers with a mixer, beside an
attention included, which the served maps average in groups (or, beside an attention, do not show).  It is a graph
of its own because a convolution's matrices are d_model per layer: only a request that asks for them pays.  Such a
model is traced once: intervene.onnx is the maps graph less that output and the nodes only it needed (the mixers
compute everything else as they do without exact maps).
intervene_maps_profile.onnx is it with export/profile.py's reduction of mixer_maps appended: their profiles.
"""

from __future__ import annotations

import logging
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import torch
from onnx import numpy_helper
from torch import nn
from torch.export import Dim

from export import artifact, dynamo, profile, rewrite
from export.dynamo import onnx_export
from export.errors import ExportError
from export.report import TOLERANCE
from export.signature import BATCH, NEW, TOTAL, flatten_past, name_dims, past_dims, spec_of, split_past
from export.wrapper import example_inputs
from model import rope_scaling
from model.attention import Intervention
from model.files import sha256_file
from model.transformer import Transformer

log = logging.getLogger(__name__)

INTERVENE_ONNX = "intervene.onnx"
INTERVENE_PROFILE_ONNX = "intervene_profile.onnx"
INTERVENE_MAPS_ONNX = "intervene_maps.onnx"
INTERVENE_MAPS_PROFILE_ONNX = "intervene_maps_profile.onnx"
ROPE_INPUTS = ("rope_inv_freq", "rope_attention_factor", "rope_override")


def takes_rope(model: Transformer) -> bool:
    """Whether a request may give this model another RoPE scaling: a RoPE variant with a layer that rotates by the
    model's own base and scaling."""
    cfg = model.cfg
    return model.pos.rope_scaled and any(cfg.layer(i).encoding == "model" for i in range(cfg.n_layers))


def rope_pairs(model: Transformer) -> int:
    """d_rot / 2: the width of rope_inv_freq (the whole head under a type whose pairs span it, proportional)."""
    cfg = model.cfg
    return (cfg.head_dim if rope_scaling.get(cfg.rope_scaling).whole_head else cfg.rope_dim) // 2


def extra_inputs(model: Transformer) -> list[dict[str, Any]]:
    """The inputs intervene.onnx takes beside the exact graph's, as model.json declares them."""
    cfg = model.cfg
    out = [{"name": "position_ids", "dtype": "int64", "shape": [BATCH, TOTAL]},
           {"name": "positional_on", "dtype": "float32", "shape": [BATCH, cfg.n_layers]},
           {"name": "head_keep", "dtype": "float32", "shape": [BATCH, cfg.n_layers, cfg.n_heads]}]
    if takes_rope(model):
        out += [{"name": "rope_inv_freq", "dtype": "float32", "shape": [BATCH, rope_pairs(model)]},
                {"name": "rope_attention_factor", "dtype": "float32", "shape": [BATCH]},
                {"name": "rope_override", "dtype": "float32", "shape": [BATCH]}]
    return out


class InterveneModule(nn.Module):
    """The reference model with an Intervention, flat tensors in and out (export.signature's order, the extra
    inputs after attention_mask)."""

    def __init__(self, model: Transformer, exact: bool = False):
        """exact: the mixers' exact matrices as one output more, last (the maps graph)."""
        super().__init__()
        self.model, self.rope, self.exact = model.eval(), takes_rope(model), exact

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                positional_on: torch.Tensor, head_keep: torch.Tensor, rope: list[torch.Tensor],
                past: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        pairs, state = split_past(past, self.model.cfg)
        edit = Intervention(positional_on, head_keep, tuple(rope) if self.rope else None)
        self.model.use_exact_maps(self.exact)
        try:
            out = self.model(input_ids, attention_mask, pairs, state=state or None, position_ids=position_ids,
                             intervention=edit)
        finally:
            self.model.use_exact_maps(False)
        flat = (out.logits, out.attentions, *flatten_past(out.presents, out.state, self.model.cfg))
        return (*flat, out.mixer_maps) if self.exact else flat


def example(model: Transformer, batch: int = 2, new: int = 7, past: int = 6, seed: int = 0,
            neutral: bool = False) -> tuple[Any, ...]:
    """Inputs for tracing and for the parity check: a left-padded row, positions that are not the mask's count
    (shifted, gapped), a layer switched off and heads ablated in one row, another row's own RoPE frequencies."""
    cfg = model.cfg
    ids, mask, kv = example_inputs(model, batch, new, past, seed)
    g = torch.Generator().manual_seed(seed + 1)
    S, L, H = mask.shape[1], cfg.n_layers, cfg.n_heads
    counted = (mask.cumsum(-1) - 1).clamp(min=0)
    steps = torch.randint(1, 4, (batch, S), generator=g) * mask  # gaps of 1-3 between real slots
    positions = counted if neutral else (steps.cumsum(-1) - steps[:, :1]).clamp(min=0) * mask + 3 * mask
    on = torch.ones(batch, L)
    keep = torch.ones(batch, L, H)
    if not neutral:
        on[0, L - 1] = 0.0
        keep[batch - 1, 0, H - 1] = 0.0
    rope: list[torch.Tensor] = []
    if takes_rope(model):
        P = rope_pairs(model)
        inv = 1.0 / (10000.0 * (0.5 + torch.rand(batch, 1, generator=g))) ** (torch.arange(P) / P)
        use = torch.zeros(batch)
        if not neutral:
            use[batch - 1] = 1.0
        rope = [inv.to(torch.float32), torch.full((batch,), 1.1), use]
    return ids, mask, positions.to(torch.int64), on, keep, rope, kv


def mixer_maps(model: Transformer) -> list[dict[str, int]]:
    """The layers with a mixer and how many exact matrices each has (mixer_maps' second and third axes)."""
    cfg = model.cfg
    return [{"layer": i, "heads": cfg.mixer_map_heads(i)} for i in range(cfg.n_layers) if cfg.mixer_map_heads(i)]


def maps_output(model: Transformer) -> dict[str, Any]:
    layers = mixer_maps(model)
    return {"name": "mixer_maps", "dtype": "float32",
            "shape": [BATCH, len(layers), max(e["heads"] for e in layers), NEW, TOTAL]}


def export_intervene(model: Transformer, path: Path, opset: int, attention: str,
                     exact: bool = False) -> onnx.ModelProto:
    """Trace the intervention graph to `path` (weights inside the file; add_intervene may point them elsewhere);
    with `exact`, the maps graph.  Returns the graph written."""
    cfg = model.cfg
    args = example(model)
    spec = spec_of(model)
    batch, new, past_len = Dim("batch"), Dim("new"), Dim("past", min=0)
    dynamic = ({0: batch, 1: new}, {0: batch, 1: Dim.AUTO}, {0: batch, 1: Dim.AUTO}, {0: batch}, {0: batch},
               [{0: batch}] * len(args[5]), past_dims(spec, batch, past_len))
    names_in = ["input_ids", "attention_mask", *[d["name"] for d in extra_inputs(model)]]
    names_in += [s["input"] for s in spec["state"]]
    names_out = ["logits", "attentions"] + [s["output"] for s in spec["state"]] + (["mixer_maps"] if exact else [])
    start = time.perf_counter()

    def trace(module: InterveneModule) -> onnx.ModelProto:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model.use_onnx_ops(attention == "onnx")
            try:
                return onnx_export(module, args, opset_version=opset, input_names=names_in, output_names=names_out,
                                   dynamic_shapes=dynamic, external_data=False, optimize=False,
                                   verbose=False).model_proto
            finally:
                model.use_onnx_ops(False)

    # kept by the digest of what it is traced from, its weights apart (export.dynamo; the test suite's folder)
    proto, traced = dynamo.export_kept(InterveneModule(model, exact),
                                       ("intervene", opset, attention, exact, __file__, names_in, names_out), trace)
    name_dims(proto, {"inputs": spec["inputs"] + extra_inputs(model),
                      "outputs": spec["outputs"] + ([maps_output(model)] if exact else [])})
    onnx.save_model(proto, str(path))
    log.info("intervention graph of %s %s in %.1fs", cfg.variant, "traced" if traced else "from the graph cache",
             time.perf_counter() - start)
    return proto


def without_maps(proto: onnx.ModelProto, path: Path) -> None:
    """Write to path the maps graph (changed in place) less its mixer_maps output and every node only that output
    needed: the intervention graph.  The maps graph's mixers compute every other output as they do without exact
    maps (the matrices are extra nodes beside them), so this is the graph a trace without them gives, node for node."""
    kept = [o for o in proto.graph.output if o.name != "mixer_maps"]
    if len(kept) != len(proto.graph.output) - 1:
        raise ExportError("the maps graph has no mixer_maps output")
    proto.graph.ClearField("output")
    proto.graph.output.extend(kept)
    rewrite.prune(proto)
    onnx.save_model(proto, str(path))


def share_weights(folder: Path, path: Path) -> int:
    """Point every initializer of `path` whose name and bytes equal one model.onnx keeps in model.onnx.data at those
    bytes, and rewrite it; returns how many now refer there."""
    data = folder / artifact.MODEL_DATA
    if not data.exists():
        return 0
    source = onnx.load(str(folder / artifact.MODEL_ONNX), load_external_data=False)
    where = {}
    for init in source.graph.initializer:
        entry = {e.key: e.value for e in init.external_data}
        if entry.get("location") == artifact.MODEL_DATA:
            where[init.name] = (int(entry.get("offset", 0)), int(entry["length"]))
    proto = onnx.load(str(path))
    shared = 0
    with open(data, "rb") as f:
        for init in proto.graph.initializer:
            spot = where.get(init.name)
            raw = numpy_helper.to_array(init).tobytes()
            if spot is None or spot[1] != len(raw):
                continue
            f.seek(spot[0])
            if f.read(spot[1]) != raw:
                continue
            init.ClearField("raw_data")
            for fieldname in ("float_data", "int64_data", "int32_data", "double_data"):
                init.ClearField(fieldname)
            init.data_location = onnx.TensorProto.EXTERNAL
            for key, value in (("location", artifact.MODEL_DATA), ("offset", str(spot[0])),
                               ("length", str(spot[1]))):
                e = init.external_data.add()
                e.key, e.value = key, value
            shared += 1
    onnx.save_model(proto, str(path))
    return shared


def check(folder: Path, model: Transformer, file: str = INTERVENE_ONNX) -> dict[str, float]:
    """The graph against the PyTorch model on the example's interventions (a prompt, then a cached step past the
    trained context): the largest difference per output; ExportError past export.report's tolerances."""
    sess = ort.InferenceSession(str(folder / file), providers=["CPUExecutionProvider"])
    names = [i.name for i in sess.get_inputs()]
    exact = any(o.name == "mixer_maps" for o in sess.get_outputs())
    worst = {"logits": 0.0, "attentions": 0.0, "present": 0.0, **({"mixer_maps": 0.0} if exact else {})}
    cfg = model.cfg
    long = max(cfg.context + 5, 12) if model.pos.max_positions(cfg) is None else 6
    for seed, (new, past) in enumerate(((7, 0), (1, long))):
        ids, mask, positions, on, keep, rope, kv = example(model, new=new, past=past, seed=seed)
        if model.pos.max_positions(cfg) is not None:  # a learned table: positions stay inside it
            positions = positions.clamp(max=model.pos.max_positions(cfg) - 1)
        feeds = [ids, mask, positions, on, keep, *rope, *kv]
        with torch.no_grad():
            want = InterveneModule(model, exact)(ids, mask, positions, on, keep, rope, kv)
        got = sess.run(None, {n: t.numpy() for n, t in zip(names, feeds, strict=True)})
        for i, (w, g) in enumerate(zip(want, got, strict=True)):  # mixer_maps, last, held as the maps are
            key = "logits" if i == 0 else "attentions" if i == 1 else "mixer_maps" if exact and i == len(got) - 1 \
                else "present"
            diff = float(np.max(np.abs(w.numpy() - g))) if g.size else 0.0
            worst[key] = max(worst[key], diff if np.isfinite(g).all() else float("inf"))
    for key, diff in worst.items():  # a mixer's matrices held as the maps are
        if not diff <= TOLERANCE["attentions" if key == "mixer_maps" else key]:
            raise ExportError(f"{file}: {key} differ from PyTorch's by {diff:.3g} under interventions "
                              f"(tolerance {TOLERANCE[key]:g})")
    return worst


def add_intervene(folder: Path, model: Transformer, meta: dict[str, Any]) -> dict[str, Any]:
    """intervene.onnx and intervene_profile.onnx beside the folder's model.onnx, proven; model.json's entry."""
    path = folder / INTERVENE_ONNX
    layers = mixer_maps(model)
    if layers:  # one trace: the maps graph, and this graph as it is without its mixer_maps output
        without_maps(export_intervene(model, folder / INTERVENE_MAPS_ONNX, int(meta["opset"]),
                                      meta.get("attention", "onnx"), True), path)
    else:
        export_intervene(model, path, int(meta["opset"]), meta.get("attention", "onnx"))
    shared = share_weights(folder, path)
    parity = check(folder, model)
    profile.write_profile(onnx.load(str(path), load_external_data=False), meta, folder / INTERVENE_PROFILE_ONNX)
    cfg = model.cfg
    maps: dict[str, Any] = {}
    if layers:
        share_weights(folder, folder / INTERVENE_MAPS_ONNX)
        profile.write_mixer_profile(onnx.load(str(folder / INTERVENE_MAPS_ONNX), load_external_data=False), meta,
                                    folder / INTERVENE_MAPS_PROFILE_ONNX, max(e["heads"] for e in layers))
        maps = {"maps_file": INTERVENE_MAPS_ONNX, "maps_profile_file": INTERVENE_MAPS_PROFILE_ONNX,
                "maps_layers": [e["layer"] for e in layers], "maps_heads": [e["heads"] for e in layers]}
        parity["mixer_maps"] = check(folder, model, INTERVENE_MAPS_ONNX)["mixer_maps"]
    return {"file": INTERVENE_ONNX, "profile_file": INTERVENE_PROFILE_ONNX, **maps, "inputs": extra_inputs(model),
            "positions": bool(model.pos.index_positions), "in_layers": model.pos.in_layers(),
            "rope": takes_rope(model), "rope_pairs": rope_pairs(model) if takes_rope(model) else 0,
            "shared_weights": shared, "parity": parity, "trained_context": cfg.context,
            "source_sha256": sha256_file(folder / artifact.MODEL_ONNX)}
