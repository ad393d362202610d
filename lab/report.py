"""The lab's report: one self-contained HTML page (images inline), rendered from data rows, never from markdown."""

from __future__ import annotations

import base64
import html
import io
import time
from pathlib import Path
from typing import Any

from client.api import attention_maps
from lab.heatmap import draw
from lab.pictures import encoding_plot, extrapolation_plot
from lab.studies import compare_table, extrapolation_table, write_atomic
from protos.posenc.v1 import posenc_pb2 as pb


def _img(png: bytes, alt: str) -> str:
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{base64.b64encode(png).decode()}">'


def report(stub, out: str | Path, prompt: str = "dog bites man", permuted: str | None = None,
           extrapolation: dict[str, Any] | None = None, length: int = 64, models: list[str] | None = None,
           timeout: float = 120.0) -> Path:
    """One self-contained HTML file (images inline as data: URIs): extrapolation, order sensitivity, and per
    model its encoding picture and attention heatmaps for `prompt`."""
    listing = {m.name: m for m in stub.ListModels(pb.ListModelsRequest(), timeout=30).models}
    names = models or sorted(listing)
    parts = ["<h1>posenc lab report</h1>",
             f"<p>{len(names)} models: {html.escape(', '.join(names))}. Generated "
             f"{time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}.</p>"]
    if extrapolation is not None:
        parts += ["<h2>Length extrapolation</h2>", _img(extrapolation_plot(extrapolation), "extrapolation plot"),
                  extrapolation_table(extrapolation).html()]
    req = pb.CompareRequest(prompt=pb.Prompt(text=prompt), models=names)
    if permuted is not None:
        req.permuted.CopyFrom(pb.Prompt(text=permuted))
    parts += ["<h2>Order sensitivity</h2>", compare_table(stub.Compare(req, timeout=timeout)).html()]
    for name in names:
        info = listing[name]
        n = min(length, info.max_positions or length)
        enc = stub.Encoding(pb.EncodingRequest(model=name, length=n), timeout=timeout)
        pred = stub.Predict(pb.PredictRequest(model=name, prompt=pb.Prompt(text=prompt), top_k=5,
                                              attention=pb.ATTENTION_FULL), timeout=timeout)
        maps = attention_maps(pred)
        buf = io.BytesIO()
        draw(maps, [t.piece for t in pred.tokens], buf, title=f"{name}: {prompt!r}")
        top = ", ".join(f"{html.escape(c.token.piece.replace(chr(0x2420), chr(0x2423)))} {c.probability:.2f}"
                        for c in pred.top)
        parts += [f'<h2 id="{html.escape(name)}">{html.escape(name)} ({html.escape(info.variant)})</h2>',
                  f"<p>held-out loss {_loss(info.heldout_loss)}, trained context {info.trained_context}; "
                  f"next after {html.escape(repr(prompt))}: {top}</p>",
                  _img(encoding_plot(enc), f"{name} encoding"), _img(buf.getvalue(), f"{name} attention")]
    page = ("<!doctype html><html><head><meta charset='utf-8'><title>posenc lab report</title><style>"
            "body{font-family:sans-serif;max-width:1200px;margin:auto;padding:1em}img{max-width:100%;display:block;"
            "margin:.5em 0}table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:.2em .5em}"
            "</style></head><body>" + "\n".join(parts) + "</body></html>")
    out = Path(out)
    write_atomic(out, page.encode())
    return out


def _loss(value: float) -> str:
    """ListModels' 0 means no figure was measured (a rope-scale copy was never trained; random weights)."""
    return f"{value:.3f} nats/byte" if value > 0 else "not measured"
