"""The positional-encoding lab, client side: length extrapolation, order sensitivity, encoding pictures, report.

Everything here talks to a worker over gRPC (Score, Compare, Encoding, Predict) and draws with matplotlib; it
imports neither torch nor the worker.  The numbers come from the served artifacts, the pictures from their
encoding graphs.
"""

from __future__ import annotations

import base64
import hashlib
import html
import io
import json
import math
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from model.corpus import BUILTIN, heldout_bytes
from model.tokenizer import decode
from protos.posenc.v1 import posenc_pb2 as pb

FACTORS = (1, 2, 4, 8)


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, out: str | Path | None) -> bytes:
    """PNG bytes of a figure, also written to `out` when given (atomically)."""
    plt = _plt()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, bbox_inches="tight")
    plt.close(fig)
    data = buf.getvalue()
    if out is not None:
        write_atomic(Path(out), data)
    return data


def write_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(data)
    tmp.replace(path)


# --- 1. length extrapolation -----------------------------------------------------------------------------


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
            for f in factors:
                length = f * ctx
                if info.max_positions and length > info.max_positions:
                    cells[str(f)] = {"length": length, "unavailable":
                                     f"beyond its {info.max_positions}-position table"}
                    continue
                windows = [data[i:i + length] for i in range(0, len(data) - length + 1, length)]
                if not windows:
                    cells[str(f)] = {"length": length, "unavailable": f"text shorter than {length} bytes"}
                    continue
                calls = [pool.submit(stub.Score, pb.ScoreRequest(model=name, prompt=pb.Prompt(
                    tokens=pb.TokenIds(ids=w))), timeout=timeout) for w in windows]
                total = sum(c.result().total_logprob for c in calls)
                tokens = sum(len(w) - 1 for w in windows)
                nats = -total / tokens
                cells[str(f)] = {"length": length, "windows": len(windows), "tokens": tokens,
                                 "nats_per_token": round(nats, 5), "perplexity": round(math.exp(nats), 4)}
            rows[name] = {"variant": info.variant, "trained_context": ctx, "cells": cells}
    return {"study": "length extrapolation", "protocol": "non-overlapping windows of factor x trained context; "
            "perplexity = exp(mean next-byte loss over every scored token)", "factors": list(factors),
            "text": text, "seconds": round(time.monotonic() - start, 1), "rows": rows}


def extrapolation_table(result: dict[str, Any]) -> str:
    factors = result["factors"]
    ctx = {r["trained_context"] for r in result["rows"].values()}
    head = " | ".join(f"{f}x" + (f" ({f * next(iter(ctx))})" if len(ctx) == 1 else "") for f in factors)
    lines = [f"| model | {head} | {factors[-1]}x / 1x |", "|---" * (len(factors) + 2) + "|"]
    for name, row in result["rows"].items():
        cells = [row["cells"][str(f)] for f in factors]
        shown = [f"{c['perplexity']:.2f}" if "perplexity" in c else "n/a" for c in cells]
        first, last = cells[0].get("perplexity"), cells[-1].get("perplexity")
        ratio = f"{last / first:.2f}" if first and last else "n/a"
        lines.append(f"| {name} | {' | '.join(shown)} | {ratio} |")
    t = result["text"]
    lines.append("")
    lines.append(f"Perplexity per byte on {t['text_bytes']} held-out bytes of {t['corpus']} (offset {t['offset']}, "
                 f"seed {t['seed']}, sha256 {t['sha256'][:12]}); n/a: beyond the model's position table.")
    return "\n".join(lines)


def extrapolation_plot(result: dict[str, Any], out: str | Path | None = None) -> bytes:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, row in result["rows"].items():
        pts = [(f, row["cells"][str(f)]["perplexity"]) for f in result["factors"]
               if "perplexity" in row["cells"][str(f)]]
        if pts:
            xs, ys = zip(*pts, strict=True)
            ax.plot(xs, ys, marker="o", label=f"{name}" + (" (table ends at 1x)" if len(pts) == 1 else ""))
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(result["factors"], [f"{f}x" for f in result["factors"]])
    ax.set_xlabel("evaluation length / trained context")
    ax.set_ylabel("held-out perplexity per byte (log)")
    ax.set_title("Train short, test long: perplexity beyond the trained context")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, out)


# --- 2. order sensitivity --------------------------------------------------------------------------------


def compare_table(resp: pb.CompareResponse, k: int = 3) -> str:
    text = decode([t.id for t in resp.tokens])
    permuted = decode([t.id for t in resp.permuted_tokens])
    lines = [f"prompt {text!r} vs permuted {permuted!r}: next-token distributions side by side", "",
             f"| model | top {k} after prompt | top {k} after permuted | total variation | JS (nats) | top-1 changed |",
             "|---|---|---|---|---|---|"]

    def tops(cands):
        return ", ".join(f"{c.token.piece} {c.probability:.2f}" for c in cands[:k])

    for m in resp.models:
        if m.error:
            lines.append(f"| {m.model} | {m.error} | | | | |")
            continue
        lines.append(f"| {m.model} | {tops(m.top)} | {tops(m.permuted_top)} | {m.total_variation:.3f} | "
                     f"{m.js_divergence:.3f} | {'yes' if m.top1_changed else 'no'} |")
    return "\n".join(lines)


# --- 3. encoding pictures --------------------------------------------------------------------------------


def tensors_of(resp: pb.EncodingResponse) -> dict[str, np.ndarray]:
    return {t.name: np.frombuffer(t.data, "<f4").reshape(t.shape) for t in resp.tensors}


def _causal(grid: np.ndarray) -> np.ndarray:
    """Future keys (above the diagonal) blanked: a causal model never uses them."""
    out = grid.astype(np.float64).copy()
    out[np.triu_indices(grid.shape[-1], 1)] = np.nan
    return out


def encoding_plot(resp: pb.EncodingResponse, out: str | Path | None = None) -> bytes:
    plt = _plt()
    t = tensors_of(resp)
    title = f"{resp.model} ({resp.variant})"
    if "position_embedding" in t:
        e = t["position_embedding"]
        norm = e / np.maximum(np.linalg.norm(e, axis=1, keepdims=True), 1e-12)
        fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
        im = axes[0].imshow(e.T, aspect="auto", cmap="RdBu_r", interpolation="nearest")
        what = ("what the convolution adds to a constant input" if resp.variant == "cpe"
                else "position embedding added to each token")
        axes[0].set(title=what, xlabel="position", ylabel="dimension")
        fig.colorbar(im, ax=axes[0])
        im = axes[1].imshow(norm @ norm.T, cmap="viridis", vmin=-1, vmax=1, interpolation="nearest")
        axes[1].set(title="cosine similarity between positions", xlabel="position", ylabel="position")
        fig.colorbar(im, ax=axes[1])
    elif "score_bias" in t:
        b = t["score_bias"]
        heads = b.shape[0]
        cols = min(heads, 4)
        rows = math.ceil(heads / cols) + 1
        fig = plt.figure(figsize=(3.2 * cols, 3.0 * rows))
        for h in range(heads):
            ax = fig.add_subplot(rows, cols, h + 1)
            im = ax.imshow(_causal(b[h]), cmap="magma", interpolation="nearest")
            ax.set_title(f"head {h}", fontsize=9)
            ax.set_xticks([])
            ax.set_yticks([])
            fig.colorbar(im, ax=ax, shrink=0.8)
        ax = fig.add_subplot(rows, 1, rows)
        n = b.shape[-1]
        for h in range(heads):
            ax.plot(np.arange(n), b[h, n - 1, ::-1], label=f"head {h}")  # last query: bias by distance
        ax.set(xlabel="distance to the key (query at the last position)", ylabel="bias added to the score")
        ax.legend(fontsize=7, ncol=min(heads, 8))
        ax.grid(alpha=0.3)
        how = " (for constant unit-norm queries and keys)" if resp.variant in ("shaw", "xl", "deberta") else ""
        title += f": attention score bias per head{how}, queries by keys"
    elif "rotary_cos" in t:
        cos, sin, scores = t["rotary_cos"], t["rotary_sin"], t["rotary_scores"]
        freqs = np.arctan2(sin[1], cos[1]) if len(cos) > 1 else np.zeros(cos.shape[1])
        fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
        im = axes[0].imshow(cos.T, aspect="auto", cmap="RdBu_r", vmin=-1, vmax=1, interpolation="nearest")
        axes[0].set(title="cos(position x frequency) per rotation pair", xlabel="position", ylabel="pair")
        fig.colorbar(im, ax=axes[0])
        axes[1].semilogy(np.arange(len(freqs)), np.abs(freqs) + 1e-12, marker=".")
        axes[1].set(title="rotation frequency per pair (rad / position)", xlabel="pair", ylabel="theta")
        axes[1].grid(alpha=0.3)
        n = scores.shape[0]
        axes[2].plot(np.arange(n), scores[n - 1, ::-1])
        axes[2].set(title="q.k of equal vectors vs distance", xlabel="distance", ylabel="score / head_dim")
        axes[2].grid(alpha=0.3)
    else:
        n = 16
        fig, ax = plt.subplots(figsize=(5, 4.5))
        ax.imshow(np.tril(np.ones((n, n))), cmap="Greys", vmin=0, vmax=1.5, interpolation="nearest")
        ax.set(title="the causal mask: the only source of order", xlabel="key", ylabel="query")
        title += f": {resp.note or 'no positional encoding'}"
    fig.suptitle(title, fontsize=10)
    return _save(fig, out)


# --- 4. the report ---------------------------------------------------------------------------------------


def _img(png: bytes, alt: str) -> str:
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{base64.b64encode(png).decode()}">'


def _md_table_html(md: str) -> str:
    md = md.replace("␠", "␣")  # common fonts lack the SYMBOL FOR SPACE glyph; OPEN BOX reads the same
    lines = md.splitlines()
    first = next((i for i, r in enumerate(lines) if r.startswith("|")), len(lines))
    intro = "".join(f"<p>{html.escape(n)}</p>" for n in lines[:first] if n)
    rows = [r for r in lines[first:] if r.startswith("|") and not r.startswith("|---")]
    out = [intro, "<table>"]
    for i, r in enumerate(rows):
        tag = "th" if i == 0 else "td"
        cells = [c.strip() for c in r.strip("|").split("|")]
        out.append("<tr>" + "".join(f"<{tag}>{html.escape(c)}</{tag}>" for c in cells) + "</tr>")
    out.append("</table>")
    notes = [r for r in lines[first:] if r and not r.startswith("|")]
    return "\n".join(out) + "".join(f"<p>{html.escape(n)}</p>" for n in notes)


def report(stub, out: str | Path, prompt: str = "dog bites man", permuted: str | None = None,
           extrapolation: dict[str, Any] | None = None, length: int = 64, models: list[str] | None = None,
           timeout: float = 120.0) -> Path:
    """One self-contained HTML file (images inline as data: URIs): extrapolation, order sensitivity, and per
    model its encoding picture and attention heatmaps for `prompt`."""
    from service.heatmap import draw

    listing = {m.name: m for m in stub.ListModels(pb.ListModelsRequest(), timeout=30).models}
    names = models or sorted(listing)
    parts = ["<h1>posenc lab report</h1>",
             f"<p>{len(names)} models: {html.escape(', '.join(names))}. Generated "
             f"{time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}.</p>"]
    if extrapolation is not None:
        parts += ["<h2>Length extrapolation</h2>", _img(extrapolation_plot(extrapolation), "extrapolation plot"),
                  _md_table_html(extrapolation_table(extrapolation))]
    req = pb.CompareRequest(prompt=pb.Prompt(text=prompt), models=names)
    if permuted is not None:
        req.permuted.CopyFrom(pb.Prompt(text=permuted))
    parts += ["<h2>Order sensitivity</h2>", _md_table_html(compare_table(stub.Compare(req, timeout=timeout)))]
    for name in names:
        info = listing[name]
        n = min(length, info.max_positions or length)
        enc = stub.Encoding(pb.EncodingRequest(model=name, length=n), timeout=timeout)
        pred = stub.Predict(pb.PredictRequest(model=name, prompt=pb.Prompt(text=prompt), top_k=5,
                                              attention=pb.ATTENTION_FULL), timeout=timeout)
        maps = [(m.layer, m.head, np.frombuffer(m.data, "<f4").reshape(m.shape)) for m in pred.attention]
        buf = io.BytesIO()
        draw(maps, [t.piece for t in pred.tokens], buf, title=f"{name}: {prompt!r}")
        top = ", ".join(f"{html.escape(c.token.piece.replace(chr(0x2420), chr(0x2423)))} {c.probability:.2f}"
                        for c in pred.top)
        parts += [f'<h2 id="{html.escape(name)}">{html.escape(name)} ({html.escape(info.variant)})</h2>',
                  f"<p>held-out loss {info.heldout_loss:.3f} nats/byte, trained context {info.trained_context}; "
                  f"next after {html.escape(repr(prompt))}: {top}</p>",
                  _img(encoding_plot(enc), f"{name} encoding"), _img(buf.getvalue(), f"{name} attention")]
    page = ("<!doctype html><html><head><meta charset='utf-8'><title>posenc lab report</title><style>"
            "body{font-family:sans-serif;max-width:1200px;margin:auto;padding:1em}img{max-width:100%;display:block;"
            "margin:.5em 0}table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:.2em .5em}"
            "</style></head><body>" + "\n".join(parts) + "</body></html>")
    out = Path(out)
    write_atomic(out, page.encode())
    return out


def load_json(path: str | Path) -> dict[str, Any]:
    return json.loads(Path(path).read_text())


def rpc_error(err: grpc.RpcError) -> str:
    return f"error: {err.code().name}: {err.details()}"
