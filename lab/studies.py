"""The positional-encoding lab's studies, as data: length extrapolation and order sensitivity.

Everything here talks to a worker through client/ (Score, Compare, ListModels); it imports neither torch nor the
worker nor matplotlib (pictures: lab/pictures.py).  The numbers come from the served artifacts.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from lab.tables import Table
from model.corpus import BUILTIN, heldout_bytes
from protos.posenc.v1 import posenc_pb2 as pb

FACTORS = (1, 2, 4, 8)  # the extrapolation study's default multiples of the trained context


# --- 1. length extrapolation ---------------------------------------------------------------------------


def eval_text(text_bytes: int, seed: int, corpus: str | None = None) -> tuple[list[int], dict[str, Any]]:
    """`text_bytes` consecutive held-out bytes starting at an offset drawn with `seed` (seed 0: the start)."""
    held = heldout_bytes(corpus)
    if text_bytes > len(held):
        raise ValueError(f"--text-bytes {text_bytes} exceeds the {len(held)} held-out bytes")
    offset = 0 if seed == 0 else int(np.random.default_rng(seed).integers(0, len(held) - text_bytes + 1))
    data = held[offset:offset + text_bytes]
    return data, {"corpus": corpus or BUILTIN, "split": "held-out (last 10% of the bytes; never trained on)",
                  "seed": seed, "offset": offset, "text_bytes": len(data),
                  "sha256": hashlib.sha256(bytes(data)).hexdigest()}


def model_tokens(stub, info: pb.ModelInfo, data: list[int], timeout: float) -> list[int]:
    """The held-out text in the model's own tokens: the bytes themselves for a byte model; otherwise the
    worker's Tokenize with the model's tokenizer (on the text of whole characters: a window cut mid-character
    drops the partial character at either end)."""
    if info.tokenizer in ("", "bytes-utf8"):
        return list(data)
    text = bytes(data).decode("utf-8", errors="ignore")
    resp = stub.Tokenize(pb.TokenizeRequest(model=info.name, text=text), timeout=timeout)
    return [t.id for t in resp.tokens]


def machine() -> str:
    """This machine as a results file names it: host, architecture, CPUs, Python."""
    return f"{platform.node()} ({platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()})"


def load() -> list[float]:
    """The load averages over 1, 5 and 15 minutes, as a results file records them beside its figures."""
    return [round(x, 2) for x in os.getloadavg()]


def extrapolate(stub, models: list[str] | None = None, factors=FACTORS, text_bytes: int = 16384, seed: int = 0,
                corpus: str | None = None, concurrency: int = 4, timeout: float = 600.0) -> dict[str, Any]:
    """Held-out perplexity of each model at factor x its trained context, by non-overlapping windows over the same
    text (Press et al.'s protocol): every token in a window is scored given the window before it."""
    listing = {m.name: m for m in stub.ListModels(pb.ListModelsRequest(), timeout=30).models}
    names = models or sorted(listing)
    unknown = [n for n in names if n not in listing]
    if unknown:
        raise ValueError(f"unknown model(s) {', '.join(unknown)}; served: {', '.join(sorted(listing))}")
    data, text = eval_text(text_bytes, seed, corpus)
    start = time.monotonic()
    rows: dict[str, Any] = {}
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        for name in names:
            info = listing[name]
            ctx = info.trained_context
            cells = {}
            tokens = model_tokens(stub, info, data, timeout)
            for f in factors:
                length = f * ctx
                if info.max_positions and length > info.max_positions:
                    cells[str(f)] = {"length": length, "unavailable":
                                     f"beyond its {info.max_positions}-position table"}
                    continue
                windows = [tokens[i:i + length] for i in range(0, len(tokens) - length + 1, length)]
                if not windows:
                    cells[str(f)] = {"length": length, "unavailable": f"text shorter than {length} tokens"}
                    continue
                calls = [pool.submit(stub.Score, pb.ScoreRequest(model=name, prompt=pb.Prompt(
                    tokens=pb.TokenIds(ids=w))), timeout=timeout) for w in windows]
                answers = [c.result() for c in calls]
                total = sum(a.total_logprob for a in answers)
                scored = sum(len(w) - 1 for w in windows)
                scored_bytes = sum(-a.total_logprob / a.nats_per_byte for a in answers if a.nats_per_byte > 0)
                nats = -total / scored
                per_byte = -total / scored_bytes if scored_bytes else None
                cells[str(f)] = {"length": length, "windows": len(windows), "tokens": scored,
                                 "nats_per_token": round(nats, 5), "perplexity": round(math.exp(nats), 4),
                                 "nats_per_byte": round(per_byte, 5) if per_byte else None,
                                 "perplexity_per_byte": round(math.exp(per_byte), 4) if per_byte else None}
            rows[name] = {"variant": info.variant, "trained_context": ctx, "cells": cells}
    return {"study": "length extrapolation", "protocol": "non-overlapping windows of factor x trained context; "
            "perplexity = exp(mean next-token loss over every scored token); perplexity_per_byte = exp(the same "
            "loss summed and divided by the scored tokens' UTF-8 bytes): one scale for every tokenizer",
            "factors": list(factors), "text": text, "seconds": round(time.monotonic() - start, 1), "rows": rows,
            "date": datetime.now(UTC).isoformat(timespec="seconds"), "machine": machine(), "load": load()}


def per_byte(cell: dict[str, Any]) -> float | None:
    """A cell's perplexity per byte of text (results written before it was recorded: per token, which for byte
    models is the same)."""
    return cell.get("perplexity_per_byte") or cell.get("perplexity")


def extrapolation_table(result: dict[str, Any]) -> Table:
    factors = result["factors"]
    ctx = {r["trained_context"] for r in result["rows"].values()}
    header = ["model", *(f"{f}x" + (f" ({f * next(iter(ctx))})" if len(ctx) == 1 else "") for f in factors),
              f"{factors[-1]}x / 1x"]
    rows = []
    for name, row in result["rows"].items():
        cells = [row["cells"][str(f)] for f in factors]
        values = [per_byte(c) for c in cells]
        shown = [f"{v:.2f}" if v else "n/a" for v in values]
        first, last = values[0], values[-1]
        rows.append([name, *shown, f"{last / first:.2f}" if first and last else "n/a"])
    t = result["text"]
    note = (f"Perplexity per byte on {t['text_bytes']} held-out bytes of {t['corpus']} (offset {t['offset']}, "
            f"seed {t['seed']}, sha256 {t['sha256'][:12]}), each model in its own tokens (windows of the column's "
            "length in tokens); n/a: beyond the model's position table.")
    return Table(header, rows, notes=[note])


# --- 2. order sensitivity --------------------------------------------------------------------------------


def compare_table(resp: pb.CompareResponse, k: int = 3) -> Table:
    """The prompts as the worker decoded them (a worker before that field: the tokens' display forms joined)."""
    text = resp.text or "".join(t.piece for t in resp.tokens)
    permuted = resp.permuted_text or "".join(t.piece for t in resp.permuted_tokens)

    def tops(cands):
        return ", ".join(f"{c.token.piece} {c.probability:.2f}" for c in cands[:k])

    rows = []
    for m in resp.models:
        if m.error:
            rows.append([m.model, m.error, "", "", "", ""])
        else:
            rows.append([m.model, tops(m.top), tops(m.permuted_top), f"{m.total_variation:.3f}",
                         f"{m.js_divergence:.3f}", "yes" if m.top1_changed else "no"])
    return Table(["model", f"top {k} after prompt", f"top {k} after permuted", "total variation", "JS (nats)",
                  "top-1 changed"], rows,
                 intro=[f"prompt {text!r} vs permuted {permuted!r}: next-token distributions side by side"])


def load_json(path: str | Path) -> dict[str, Any]:
    return json.loads(Path(path).read_text())


def rpc_error(err: grpc.RpcError) -> str:
    return f"error: {err.code().name}: {err.details()}"
