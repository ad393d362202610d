"""The budget a copy that cannot match float32 to 1e-4 is held to: next-token agreement and nats per byte against
the float32 exact graph on held-out text the model never trained on (export/quantize.py's int8 and int4 copies,
export/half.py's float16 fast graph).

Each window starts at position 0 with no past and scores every position, in either graph (exact or fast, float32 or
float16): the top-1 next token agrees with float32's on at least `min_top1` of the positions, and nats per byte rise
by at most `max_nats_ratio`, at the trained context and at 4x it (where the model's positions allow), a window at
most MAX_LENGTH tokens (an imported model's 2048-token context scored at 4x would be an 8192-token forward whose
logits and attention scores alone take tens of GB).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
from tokenizers import Tokenizer

from export.errors import ExportError
from export.gqa import SEQLENS, TOTAL
from export.rewrite import LOGITS_POSITIONS
from model.corpus import heldout_bytes

MIN_TOP1 = 0.97
MAX_NATS_RATIO = 1.02
WINDOWS = 16  # held-out windows scored per length: 1,024 positions at 64 tokens, where two flipped near-ties move
# the agreement by 0.002, not by a budget's whole margin
MAX_LENGTH = 512  # longest window scored: logits (length x vocabulary) and attention scores stay a few hundred MB


def heldout_ids(meta: dict[str, Any], folder: Path, corpus: str | None) -> tuple[list[int], Any]:
    """The held-out text as the model's tokens, and a decoder for counting bytes."""
    data = bytes(heldout_bytes(corpus))
    tok = meta.get("tokenizer") or {}
    if tok.get("file"):
        t = Tokenizer.from_file(str(folder / tok["file"]))
        return t.encode(data.decode("utf-8", errors="replace"), add_special_tokens=False).ids, \
            lambda ids: len(t.decode(ids).encode())
    return list(data), len

def _session(path: Path):
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 2
    return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])


def feeds(session, meta: dict[str, Any], ids: np.ndarray) -> dict[str, np.ndarray]:
    """One row of `ids` from position 0 with no past, every position's logits, for either graph."""
    feeds = {"input_ids": ids[None], "attention_mask": np.ones((1, len(ids)), np.int64)}
    types = {i.name: i.type for i in session.get_inputs()}
    for spec in meta["inputs"][2:]:  # the carried state, empty: no past (float16 in a float16 fast graph)
        feeds[spec["name"]] = np.zeros([1 if d == "batch_size" else 0 if isinstance(d, str) else int(d)
                                        for d in spec["shape"]],
                                       np.float16 if types.get(spec["name"]) == "tensor(float16)" else np.float32)
    wants = set(types)
    if LOGITS_POSITIONS in wants:  # a fast graph: every position's logits
        feeds[LOGITS_POSITIONS] = np.arange(len(ids), dtype=np.int64)[None]
    if SEQLENS in wants:  # compact layout: one row of len(ids) tokens from slot 0, no past
        feeds[SEQLENS], feeds[TOTAL] = np.array([len(ids) - 1], np.int32), np.array(len(ids), np.int32)
    return feeds


def _logits(session, meta: dict[str, Any], ids: np.ndarray) -> np.ndarray:
    return session.run(["logits"], feeds(session, meta, ids))[0][0].astype(np.float64)


def _nll(logits: np.ndarray, ids: np.ndarray) -> float:
    logits = logits[:-1]
    m = logits.max(-1, keepdims=True)
    logp = logits - m - np.log(np.exp(logits - m).sum(-1, keepdims=True))
    return float(-logp[np.arange(len(ids) - 1), ids[1:]].sum())


def check_budget(fp32: Path, int8: Path, meta: dict[str, Any], folder: Path, corpus: str | None = None,
                 windows: int = WINDOWS, min_top1: float = MIN_TOP1,
                 max_nats_ratio: float = MAX_NATS_RATIO, max_length: int = MAX_LENGTH) -> dict[str, Any]:
    ids, nbytes = heldout_ids(meta, folder, corpus)
    ctx = int(meta["trained_context"])
    lengths = [n for n in (ctx, 4 * ctx) if meta.get("max_positions") is None or n <= meta["max_positions"]]
    lengths = sorted({min(n, max_length) for n in lengths})
    a, b = _session(fp32), _session(int8)
    rows = []
    for n in lengths:
        agree = total = 0
        nats_a = nats_b = 0.0
        scored_bytes = 0
        for w in range(min(windows, len(ids) // n)):
            window = np.asarray(ids[w * n:(w + 1) * n], np.int64)
            la, lb = _logits(a, meta, window), _logits(b, meta, window)
            agree += int((la.argmax(-1) == lb.argmax(-1)).sum())
            total += n
            nats_a, nats_b = nats_a + _nll(la, window), nats_b + _nll(lb, window)
            scored_bytes += nbytes(window[1:].tolist())
        if not total:
            raise ExportError(f"the held-out text is shorter than {n} tokens: no budget can be measured")
        rows.append({"length": n, "positions": total, "top1_agreement": round(agree / total, 5),
                     "nats_per_byte_fp32": round(nats_a / scored_bytes, 5),
                     "nats_per_byte_int8": round(nats_b / scored_bytes, 5),
                     "nats_ratio": round(nats_b / nats_a, 5)})
    passed = all(r["top1_agreement"] >= min_top1 and r["nats_ratio"] <= max_nats_ratio for r in rows)
    return {"min_top1_agreement": min_top1, "max_nats_ratio": max_nats_ratio, "rows": rows, "passed": passed}

def missed(what: str, report: dict[str, Any]) -> str:
    worst = min(report["rows"], key=lambda r: r["top1_agreement"] - r["nats_ratio"])
    return (f"{what} misses its budget at {worst['length']} tokens: top-1 agreement {worst['top1_agreement']:.3f} "
            f"(>= {report['min_top1_agreement']} needed), nats/byte x{worst['nats_ratio']:.3f} "
            f"(<= {report['max_nats_ratio']}); nothing written")
