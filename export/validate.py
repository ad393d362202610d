"""Parity validation: ONNX Runtime against the PyTorch reference, read as a checklist.

The reference model is rebuilt from the artifact itself (config from model.json, weights from the graph's
initializers), so `python -m export validate artifacts/NAME` needs nothing but the artifact.  Checked:
batch 1 and 3 at lengths 1, 7, the trained context, 2x and 4x it (learned: up to its table); a left-padded
batch; prefill followed by decode steps through the KV cache; 32 greedy tokens; and the graph checks.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import torch
from onnx import numpy_helper

from export import artifact
from export.encoding import check_encoding
from export.errors import ArtifactError
from export.graphcheck import check_graph
from export.wrapper import input_names, output_names, state_names
from model.config import ModelConfig
from model.transformer import Transformer

# Tolerances (max abs diff).  Measured on the default models: logits <= ~2e-6, probabilities <= ~5e-7.
# Attention probabilities: 3e-5 (Optimum validates at 1e-5 to 3e-4 by architecture).  Most models sit near 1e-6;
# Transformer-XL's trained scores reach ~100, where float32 summation order alone moves a probability by ~2e-5.
TOLERANCE = {"logits": 1e-4, "attentions": 3e-5, "present": 1e-4}
GREEDY_TOKENS = 32


@dataclass
class Check:
    case: str
    output: str
    shape: str
    max_abs_diff: float | None
    tolerance: float | None
    passed: bool
    detail: str = ""


@dataclass
class Report:
    name: str
    checks: list[Check] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return bool(self.checks) and all(c.passed for c in self.checks)

    def worst(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for c in self.checks:
            if c.max_abs_diff is not None:
                key = "present" if c.output.startswith("present") else c.output
                out[key] = max(out.get(key, 0.0), c.max_abs_diff)
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "passed": self.passed, "max_abs_diff": self.worst(),
                "tolerance": TOLERANCE, "checks": [asdict(c) for c in self.checks]}

    def format_table(self) -> str:
        rows = [f"validation of {self.name}",
                f"{'case':<34} {'output':<30} {'shape':<22} {'max abs diff':>12} {'tol':>8}  result"]
        for c in self.checks:
            diff = "" if c.max_abs_diff is None else f"{c.max_abs_diff:.2e}"
            tol = "" if c.tolerance is None else f"{c.tolerance:.0e}"
            rows.append(f"{c.case:<34} {c.output:<30} {c.shape:<22} {diff:>12} {tol:>8}  "
                        f"{'PASS' if c.passed else 'FAIL'}{'  ' + c.detail if c.detail else ''}")
        rows.append(f"{'PASSED' if self.passed else 'FAILED'}: {sum(c.passed for c in self.checks)}/"
                    f"{len(self.checks)} checks; worst: " +
                    ", ".join(f"{k} {v:.2e}" for k, v in self.worst().items()))
        return "\n".join(rows)


def reference_from_graph(proto: onnx.ModelProto, cfg: ModelConfig) -> Transformer:
    """The PyTorch model with the graph's own weights (initializers are named after the parameters)."""
    model = Transformer(cfg).eval()
    inits = {i.name: i for i in proto.graph.initializer}
    state = {}
    for name, tensor in model.state_dict().items():
        init = inits.get(name) or inits.get(f"model.{name}")
        if init is None:
            raise ArtifactError(f"graph has no initializer for weight {name}; cannot rebuild the reference")
        state[name] = torch.from_numpy(numpy_helper.to_array(init).copy()).reshape(tensor.shape)
    model.load_state_dict(state)
    return model


class Runner:
    """Runs the same inputs through ONNX Runtime and PyTorch and records the differences."""

    """`past` is every carried tensor in graph order: the KV pairs, then the variant's own state (cpe)."""

    def __init__(self, session: ort.InferenceSession, model: Transformer, report: Report):
        self.session, self.model, self.report = session, model, report
        self.states = state_names(model)
        self.names = output_names(model.cfg.n_layers, self.states)
        self.inputs = input_names(model.cfg.n_layers, self.states)[2:]

    def empty_past(self, batch: int) -> list[np.ndarray]:
        cfg = self.model.cfg
        kv = [np.zeros((batch, cfg.n_heads, 0, cfg.head_dim), np.float32)] * (2 * cfg.n_layers)
        return kv + [t.numpy() for t in self.model.initial_state(batch)]

    def ort(self, ids: np.ndarray, mask: np.ndarray, past: list[np.ndarray]) -> list[np.ndarray]:
        feeds = {"input_ids": ids, "attention_mask": mask, **dict(zip(self.inputs, past, strict=True))}
        return self.session.run(self.names, feeds)

    @torch.inference_mode()
    def torch(self, ids: np.ndarray, mask: np.ndarray, past: list[np.ndarray]) -> list[np.ndarray]:
        n_kv = 2 * self.model.cfg.n_layers
        pairs = tuple((torch.from_numpy(past[2 * i]), torch.from_numpy(past[2 * i + 1])) for i in range(n_kv // 2))
        state = tuple(torch.from_numpy(t) for t in past[n_kv:]) or None
        out = self.model(torch.from_numpy(ids), torch.from_numpy(mask), pairs, state=state)
        return [out.logits.numpy(), out.attentions.numpy(), *[t.numpy() for kv in out.presents for t in kv],
                *[t.numpy() for t in out.state]]

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


def lengths_for(cfg: ModelConfig) -> list[int]:
    wanted = [1, 7, cfg.context, 2 * cfg.context, 4 * cfg.context]
    limit = cfg.max_positions
    return [n for n in dict.fromkeys(wanted) if limit is None or n <= limit]


def run_checks(session: ort.InferenceSession, model: Transformer, report: Report, seed: int = 0) -> None:
    cfg = model.cfg
    run = Runner(session, model, report)
    rng = np.random.default_rng(seed)

    def ids(b: int, n: int) -> np.ndarray:
        return rng.integers(0, cfg.vocab_size, (b, n), dtype=np.int64)

    for n in lengths_for(cfg):
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

    # greedy decoding: the same tokens from both engines
    prompt_len = 8
    tokens = min(GREEDY_TOKENS, (cfg.max_positions or 10**9) - prompt_len)
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


def session_for(path: Path) -> ort.InferenceSession:
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 2
    opts.log_severity_level = 3
    return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])


def validate_folder(folder: str | Path, reference: Transformer | None = None,
                    verify_manifest: bool = True) -> Report:
    folder = Path(folder)
    if verify_manifest:
        artifact.verify(folder)
    meta = artifact.read_json(folder / artifact.MODEL_JSON)
    cfg = ModelConfig.from_dict(meta["config"])
    proto = onnx.load(str(folder / artifact.MODEL_ONNX))
    graph_ref = reference_from_graph(proto, cfg)
    model = reference if reference is not None else graph_ref
    report = Report(meta.get("name", folder.name))
    if reference is not None:  # the graph must carry exactly the weights it was exported from
        same = all(torch.equal(a, b) for a, b in zip(reference.state_dict().values(),
                                                       graph_ref.state_dict().values(), strict=True))
        report.checks.append(Check("graph", "weights", "", None, None, same,
                                   "initializers equal the checkpoint" if same else "weights differ"))
    weights = {k: v.numpy() for k, v in graph_ref.state_dict().items()}
    symbolic = {"input_ids": [0, 1], "attention_mask": [0, 1]}
    symbolic.update({f"past_key_values.{i}.{p}": [0, 2] for i in range(cfg.n_layers) for p in ("key", "value")})
    symbolic.update({f"past_{name}": [0] for name, _ in graph_ref.pos.state_spec()})
    for f in check_graph(proto, cfg.context, weights, symbolic, bounded_table=cfg.max_positions is not None):
        report.checks.append(Check("graph", f.check, "", None, None, f.passed, f.detail))
    if meta.get("max_positions") != cfg.max_positions:
        report.checks.append(Check("graph", "max_positions", "", None, None, False,
                                   f"model.json says {meta.get('max_positions')}, config implies {cfg.max_positions}"))
    run_checks(session_for(folder / artifact.MODEL_ONNX), model, report)
    encoding = meta.get("encoding") or {}
    if encoding.get("file"):
        ctx = cfg.context
        lengths = [1, 7, ctx] + ([] if cfg.max_positions else [4 * ctx])
        report.checks += check_encoding(model.pos, folder, lengths)
    return report


def report_json(report: Report) -> str:
    return json.dumps(report.to_dict(), indent=2)
