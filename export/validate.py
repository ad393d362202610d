"""Parity validation: ONNX Runtime against the PyTorch reference, read as a checklist.

The reference model is rebuilt from the artifact itself (config from model.json, weights from the graph's
initializers), so `python -m export validate artifacts/NAME` needs nothing but the artifact.  Checked:
batch 1 and 3 at lengths 1, 7, the trained context, 2x and 4x it (learned: up to its table); a left-padded
batch; prefill followed by decode steps through the KV cache; a batch as the worker builds one (pasts of 0, 5 and
11, middle padding) with every row equal to itself alone; decode steps at a past of 2x the trained context
(learned: not run beyond its table); 32 greedy tokens; and the graph checks.
"""

from __future__ import annotations

import gc
import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import torch

from export import artifact
from export.encoding import check_encoding
from export.errors import ArtifactError
from export.graphcheck import check_graph, initializer_array, is_external
from export.report import TOLERANCE, Check, Report
from export.signature import carried_names, flatten_past, output_names, spec_of, split_past, symbolic_axes
from model.config import ModelConfig
from model.transformer import Transformer
from model.variants import max_positions

GREEDY_TOKENS = 32
# A graph at least this large is validated after a full garbage collection, which frees the export's proto and program
# (if the caller just exported) before onnxruntime loads the graph: at real size that is the peak.  A smaller graph's
# garbage is as small and left to the interpreter's own collector: a full collection walks every object of a process
# that imported torch (about 0.6 s once it has exported a few models, most of a tiny model's validation).
COLLECT_BYTES = 16 * 2**20


def graph_weights(proto: onnx.ModelProto, cfg: ModelConfig, base_dir: Path | None = None,
                  like: Transformer | None = None) -> dict[str, np.ndarray]:
    """The graph's own weights by parameter name (initializers are named after the parameters), shaped like the
    model's.  External-data initializers (a proto loaded without them) are memory-mapped from base_dir, not read;
    `like` gives the names and shapes (default: a model of cfg built on the meta device, no memory)."""
    if like is None:
        with torch.device("meta"):
            like = Transformer(cfg)
    inits = {i.name: i for i in proto.graph.initializer}
    out = {}
    for name, tensor in like.state_dict().items():
        init = inits.get(name) or inits.get(f"model.{name}")
        if init is None:
            raise ArtifactError(f"graph has no initializer for weight {name}; cannot rebuild the reference")
        out[name] = initializer_array(init, base_dir).reshape(tensor.shape)
    return out


def reference_from_graph(proto: onnx.ModelProto, cfg: ModelConfig, base_dir: Path | None = None) -> Transformer:
    """The PyTorch model with the graph's own weights (base_dir: the graph's folder, for external data)."""
    model = Transformer(cfg).eval()
    weights = graph_weights(proto, cfg, base_dir, like=model)
    with torch.no_grad():
        for name, tensor in model.state_dict().items():  # views of the parameters: copied in one at a time
            tensor.copy_(torch.tensor(weights[name]))
    return model


class Runner:
    """Runs the same inputs through ONNX Runtime and PyTorch and records the differences.

    `past` is every carried tensor in graph order: the KV pairs, then the variant's own state (cpe)."""

    def __init__(self, session: ort.InferenceSession, model: Transformer, report: Report):
        self.session, self.model, self.report = session, model, report
        spec = spec_of(model)
        self.names = output_names(spec)
        self.inputs = carried_names(spec)

    def empty_past(self, batch: int) -> list[np.ndarray]:
        pairs, state = self.model.empty_past(batch), self.model.initial_state(batch)
        return [t.numpy() for t in flatten_past(pairs, state, self.model.cfg)]

    def ort(self, ids: np.ndarray, mask: np.ndarray, past: list[np.ndarray]) -> list[np.ndarray]:
        feeds = {"input_ids": ids, "attention_mask": mask, **dict(zip(self.inputs, past, strict=True))}
        return self.session.run(self.names, feeds)

    @torch.inference_mode()
    def torch(self, ids: np.ndarray, mask: np.ndarray, past: list[np.ndarray]) -> list[np.ndarray]:
        pairs, state = split_past([torch.from_numpy(t) for t in past], self.model.cfg)
        out = self.model(torch.from_numpy(ids), torch.from_numpy(mask), pairs, state=state or None)
        presents = flatten_past(out.presents, out.state, self.model.cfg)
        return [t.numpy() for t in (out.logits, out.attentions, *presents)]

    def compare(self, case: str, ids, mask, past_ort, past_ref) -> tuple[list[np.ndarray], list[np.ndarray]]:
        got, want = self.ort(ids, mask, past_ort), self.torch(ids, mask, past_ref)
        presents = []
        for name, g, w in zip(self.names, got, want, strict=True):
            key = "present" if name.startswith("present") else name  # KV and the variant's state alike
            if g.shape != w.shape:
                self.report.checks.append(Check(case, name, str(list(g.shape)), None, None, False,
                                                f"shape differs from PyTorch {list(w.shape)}"))
                continue
            diff = float(np.abs(g - w).max()) if g.size else 0.0
            if key == "present":
                presents.append(diff)
                continue
            self.report.checks.append(Check(case, name, str(list(g.shape)), diff, TOLERANCE[key],
                                            bool(np.isfinite(g).all()) and diff <= TOLERANCE[key]))
        worst = max(presents) if presents else 0.0
        self.report.checks.append(Check(case, "present.*", str(list(got[2].shape)), worst, TOLERANCE["present"],
                                        worst <= TOLERANCE["present"]))
        return got, want


def lengths_for(cfg: ModelConfig, max_length: int | None = None) -> list[int]:
    """1, 7, the trained context, 2x and 4x it, within the model's max_positions and `max_length` (model.json's
    validation_max_length: a real-size model's attentions at 4x its context would not fit in memory)."""
    wanted = [1, 7, cfg.context, 2 * cfg.context, 4 * cfg.context]
    limits = [m for m in (max_positions(cfg), max_length) if m]
    return [n for n in dict.fromkeys(wanted) if all(n <= m for m in limits)]


def run_checks(session: ort.InferenceSession, model: Transformer, report: Report, seed: int = 0,
               max_length: int | None = None) -> None:
    cfg = model.cfg
    run = Runner(session, model, report)
    rng = np.random.default_rng(seed)

    def ids(b: int, n: int) -> np.ndarray:
        return rng.integers(0, cfg.vocab_size, (b, n), dtype=np.int64)

    for n in lengths_for(cfg, max_length):
        for b in (1, 3):
            run.compare(f"B={b} T={n} past=0", ids(b, n), np.ones((b, n), np.int64), run.empty_past(b),
                        run.empty_past(b))

    # left-padded batch: rows of different lengths
    n = min(cfg.context, 40)
    mask = np.ones((3, n), np.int64)
    mask[1, : n // 2] = 0
    mask[2, : n - 1] = 0
    run.compare(f"left-padded B=3 T={n}", ids(3, n), mask, run.empty_past(3), run.empty_past(3))

    # prefill then decode steps, each side feeding its own cache back, with a left-padded row
    b, prefill, steps = 2, min(9, cfg.context - 4), 3
    mask = np.ones((b, prefill), np.int64)
    mask[1, :3] = 0
    got, want = run.compare(f"prefill B={b} T={prefill}", ids(b, prefill), mask, run.empty_past(b),
                            run.empty_past(b))
    for s in range(steps):
        mask = np.concatenate([mask, np.ones((b, 1), np.int64)], axis=1)
        got, want = run.compare(f"decode step {s + 1} past={mask.shape[1] - 1}", ids(b, 1), mask, got[2:],
                                want[2:])

    worker_cases(run, ids, report, max_length)

    # greedy decoding: the same tokens from both engines
    prompt_len = 8
    tokens = min(GREEDY_TOKENS, (max_positions(cfg) or 10**9) - prompt_len)
    prompt = ids(1, prompt_len)
    seqs = []
    for engine in (run.ort, run.torch):
        seq, mask, past, cur = [], np.ones((1, prompt_len), np.int64), run.empty_past(1), prompt
        for _ in range(tokens):
            out = engine(cur, mask, past)
            nxt = int(out[0][0, -1].argmax())
            seq.append(nxt)
            past, cur = out[2:], np.array([[nxt]], np.int64)
            mask = np.concatenate([mask, np.ones((1, 1), np.int64)], axis=1)
        seqs.append(seq)
    same = seqs[0] == seqs[1]
    report.checks.append(Check(f"greedy {tokens} tokens (KV cache)", "tokens", f"[{tokens}]", None, None, same,
                               "identical" if same else f"ort {seqs[0]} vs torch {seqs[1]}"))


PASTS, NEWS = (0, 5, 11), (2, 1, 2)  # a batch as the worker assembles one: three pasts, one row's new token short


def worker_cases(run: Runner, ids, report: Report, max_length: int | None = None) -> None:
    """What the worker does with the graph, beyond a plain forward: rows with different pasts in one call (the
    cache left-padded to the longest past, the new tokens left-padded to the longest: a row with a past and fewer
    new tokens has padding in the middle), and decoding at a past of twice the trained context.  Each batched row
    must also equal the row run alone through ONNX Runtime, which is what the worker promises its callers."""
    cfg = run.model.cfg
    growing = [s["sequence_axis"] is not None for s in spec_of(run.model)["state"]]
    limit = min(max_positions(cfg) or 10**9, max_length or 10**9)  # the table; a real-size model's memory cap
    P, T = max(PASTS), max(NEWS)
    case = f"B=3 past {'/'.join(map(str, PASTS))} new {'/'.join(map(str, NEWS))} (middle padding)"
    if P + T > limit:
        report.checks.append(Check(case, "not run", "", None, None, True,
                                   f"needs {P + T} positions; the limit is {limit}"))
    else:
        rows = []  # (past tensors per engine, new ids) per row, each past made by that engine's own prefill
        for p, t in zip(PASTS, NEWS, strict=True):
            if p == 0:
                pasts = (run.empty_past(1), run.empty_past(1))
            else:
                prompt, mask = ids(1, p), np.ones((1, p), np.int64)
                pasts = (run.ort(prompt, mask, run.empty_past(1))[2:], run.torch(prompt, mask, run.empty_past(1))[2:])
            rows.append((pasts, ids(1, t)))
        batch_ids, mask = np.zeros((3, T), np.int64), np.zeros((3, P + T), np.int64)
        batch_past: list[list[np.ndarray]] = [[], []]
        for b, ((_, new), p, t) in enumerate(zip(rows, PASTS, NEWS, strict=True)):
            batch_ids[b, T - t:] = new[0]
            mask[b, P - p:P] = 1
            mask[b, P + T - t:] = 1
        for e in range(2):
            for k, g in enumerate(growing):
                parts = [r[0][e][k] for r in rows]
                if g:  # left-pad each row's cache to the longest past along the sequence axis
                    parts = [np.pad(x, ((0, 0), (0, 0), (P - x.shape[2], 0), (0, 0))) for x in parts]
                batch_past[e].append(np.concatenate(parts, axis=0))
        got, _ = run.compare(case, batch_ids, mask, batch_past[0], batch_past[1])
        for b, ((pasts, new), p, t) in enumerate(zip(rows, PASTS, NEWS, strict=True)):
            alone = run.ort(new, np.ones((1, p + t), np.int64), pasts[0])
            keys = np.r_[P - p:P, P + T - t:P + T]
            for name, g, a in (("logits", got[0][b, T - t:], alone[0][0]),
                               ("attentions", got[1][b][:, :, T - t:][..., keys], alone[1][0])):
                diff = float(np.abs(g - a).max()) if g.shape == a.shape else float("inf")
                report.checks.append(Check(f"{case}: row past={p} vs alone", name, str(list(a.shape)), diff,
                                           TOLERANCE[name], diff <= TOLERANCE[name]))

    # decode steps at a past of twice the trained context (a long conversation), each engine on its own cache
    past = 2 * cfg.context
    case = f"decode at past={past} (2x context)"
    if past + 2 > limit:
        report.checks.append(Check(case, "not run", "", None, None, True,
                                   f"needs {past + 2} positions; the limit is {limit} "
                                   f"({'the table' if limit == max_positions(cfg) else 'validation_max_length'})"))
        return
    mask = np.ones((2, past), np.int64)
    mask[1, :5] = 0  # a left-padded row too
    got, want = run.compare(f"prefill B=2 T={past}", ids(2, past), mask, run.empty_past(2), run.empty_past(2))
    for step in range(2):
        mask = np.concatenate([mask, np.ones((2, 1), np.int64)], axis=1)
        got, want = run.compare(f"{case} step {step + 1}", ids(2, 1), mask, got[2:], want[2:])


def session_for(path: Path) -> ort.InferenceSession:
    """The validator's session: torch's thread count (the export's budget), threads that sleep between runs.  The
    checks alternate small onnxruntime runs with the PyTorch reference in this thread, and onnxruntime's default
    spin-wait after each run took the cores the reference was about to use."""
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = torch.get_num_threads()
    opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    opts.log_severity_level = 3
    return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])


def share_file_weights(model: Transformer, weights: dict[str, np.ndarray]) -> None:
    """The model's parameters become views of the graph's weights, memory-mapped copy-on-write from its external
    data (the caller checked they are equal bit for bit, or took them from the graph): the model's own anonymous
    copy is freed before onnxruntime loads its own, and what PyTorch reads during the checks are clean file pages
    the kernel may drop.  Initializers small enough to sit in the proto are copied."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            value = weights[name]
            param.data = torch.from_numpy(value if isinstance(value, np.memmap) else np.array(value))


def validate_folder(folder: str | Path, reference: Transformer | None = None,
                    verify_manifest: bool = True) -> Report:
    """reference: the model the artifact was exported from (its weights must equal the graph's); default one
    rebuilt from the graph.  Memory: the graph is loaded without its external data (weights are compared and
    fingerprinted from the memory-mapped file), no second model is built when a reference is given, the
    onnxruntime session reads the file itself, and with external data the PyTorch side reads the weights from
    the mapped file too (share_file_weights): at real size the peak is onnxruntime's load beside file pages."""
    folder = Path(folder)
    if verify_manifest:
        artifact.verify(folder)
    meta = artifact.read_json(folder / artifact.MODEL_JSON)
    cfg = ModelConfig.from_dict(meta["config"])
    path = folder / artifact.MODEL_ONNX
    proto = onnx.load(str(path), load_external_data=False)
    external = any(is_external(i) for i in proto.graph.initializer)
    report = Report(meta.get("name", folder.name))
    same = True
    if reference is not None:  # the graph must carry exactly the weights it was exported from
        weights = graph_weights(proto, cfg, folder, like=reference)
        model = reference
        ref = reference.state_dict()
        same = all(np.array_equal(ref[k].numpy(), v) for k, v in weights.items())
        del ref
        report.checks.append(Check("graph", "weights", "", None, None, same,
                                   "initializers equal the checkpoint" if same else "weights differ"))
    elif external:  # its weights come from the file below, not copied in
        model = Transformer(cfg).eval()
        weights = graph_weights(proto, cfg, folder, like=model)
    else:
        model = reference_from_graph(proto, cfg, folder)
        weights = graph_weights(proto, cfg, folder, like=model)
    symbolic = symbolic_axes(spec_of(model))
    table = None
    if max_positions(cfg) is not None:  # the graph's table's rows against what model.json promises the worker
        param = next((f"pos.{n}" for n, p in model.pos.named_parameters() if p.ndim == 2), "pos (no table)")
        table = (param, meta.get("max_positions"))
    for f in check_graph(proto, cfg.context, weights, symbolic, table, path=path):
        report.checks.append(Check("graph", f.check, "", None, None, f.passed, f.detail))
    del weights  # unmaps what the checks above read
    if external and same:
        share_file_weights(model, graph_weights(proto, cfg, folder, like=model))
    del proto
    if sum(f.stat().st_size for f in (path, folder / artifact.MODEL_DATA) if f.is_file()) >= COLLECT_BYTES:
        gc.collect()  # the export's own proto and program, if the caller just exported, before a session is built
    if meta.get("max_positions") != max_positions(cfg):
        report.checks.append(Check("graph", "max_positions", "", None, None, False,
                                   f"model.json says {meta.get('max_positions')}, config implies {max_positions(cfg)}"))
    max_length = meta.get("validation_max_length")
    run_checks(session_for(path), model, report, max_length=max_length)
    encoding = meta.get("encoding") or {}
    if encoding.get("file"):
        ctx = cfg.context
        lengths = [n for n in [1, 7, ctx] + ([] if max_positions(cfg) else [4 * ctx]) if n <= (max_length or n)]
        report.checks += check_encoding(model.pos, folder, lengths)
    return report


def report_json(report: Report) -> str:
    return json.dumps(report.to_dict(), indent=2)
