"""The lab's report: one self-contained HTML page (images inline), rendered from data rows, never from markdown.

Its sections: length extrapolation (when given), order sensitivity, each model's encoding picture and attention
maps, each model's attention profile (the Profile RPC's layer x distance heatmap), and the tables of the studies that
train their own models, read from their results files (`STUDIES`: the hybrid NoPE/RoPE designs, length
generalization on the papers' tasks, passkey retrieval), or one line each saying how to make them."""

from __future__ import annotations

import base64
import html
import io
import time
from pathlib import Path
from typing import Any, NamedTuple

import grpc

from client.api import attention_maps
from lab.heatmap import draw, profile_heatmap
from lab.pictures import encoding_plot, extrapolation_plot
from lab.studies import compare_table, extrapolation_table, load_json
from lab.tables import Table
from model.files import atomic_write
from protos.posenc.v1 import posenc_pb2 as pb

RESULTS = Path(__file__).resolve().parent.parent / "bench" / "results"  # in a checkout of posenc


class Study(NamedTuple):
    """A study whose results file the report shows: its file's name, heading, the command that makes it, its code."""

    name: str
    title: str
    make: str
    source: str


STUDIES = (Study("hybrid", "Hybrid NoPE / RoPE designs", "make hybrid-study", "lab/experiments/hybrid.py"),
           Study("lengthgen", "Length generalization on the papers' tasks", "make lengthgen",
                 "lab/experiments/lengthgen.py"),
           Study("passkey", "Passkey retrieval by length and needle depth", "make passkey", "lab/passkey.py"))
HYBRID = RESULTS / "hybrid.json"


def _img(png: bytes, alt: str) -> str:
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{base64.b64encode(png).decode()}">'


def report(stub, out: str | Path, prompt: str = "dog bites man", permuted: str | None = None,
           extrapolation: dict[str, Any] | None = None, length: int = 64, models: list[str] | None = None,
           timeout: float = 120.0, hybrid: str | Path = HYBRID, results: str | Path = RESULTS) -> Path:
    """One self-contained HTML file (images inline as data: URIs): extrapolation, order sensitivity, per model
    its encoding picture and attention heatmaps for `prompt`, the models' attention profiles of `prompt`, and each
    study's tables from its results file (`hybrid`; the others NAME.json under `results`) where it exists."""
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
    parts += profiles(stub, names, prompt, timeout)
    for study in STUDIES:
        path = Path(hybrid) if study.name == "hybrid" else Path(results) / f"{study.name}.json"
        parts += study_tables(study, path)
    page = ("<!doctype html><html><head><meta charset='utf-8'><title>posenc lab report</title><style>"
            "body{font-family:sans-serif;max-width:1200px;margin:auto;padding:1em}img{max-width:100%;display:block;"
            "margin:.5em 0}table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:.2em .5em}"
            "</style></head><body>" + "\n".join(parts) + "</body></html>")
    out = Path(out)
    atomic_write(out, page)
    return out


def profiles(stub, names: list[str], prompt: str, timeout: float) -> list[str]:
    """Each model's attention profile of `prompt` (every query row): the layer x distance heatmap, heads
    averaged, from the Profile RPC; a model without a profile graph gets the worker's one-line reason."""
    parts = ["<h2 id=\"profiles\">Attention by distance</h2>",
             f"<p>Per model and layer, the attention mass at each distance from the query (log-2 buckets) and on the "
             f"first position, averaged over the heads and over every query row of {html.escape(repr(prompt))}; "
             "reduced in the worker's profile graph (docs/profiles.md).</p>"]
    for name in names:
        try:
            resp = stub.Profile(pb.ProfileRequest(model=name, prompt=pb.Prompt(text=prompt)), timeout=timeout)
        except grpc.RpcError as err:
            if err.code() != grpc.StatusCode.FAILED_PRECONDITION:
                raise
            parts.append(f"<p>{html.escape(name)}: {html.escape(err.details())}</p>")
            continue
        buf = io.BytesIO()
        profile_heatmap(resp, buf)
        parts += [f"<h3>{html.escape(name)}</h3>", _img(buf.getvalue(), f"{name} profile")]
    return parts


def hybrid_tables(path: Path) -> list[str]:
    """The hybrid NoPE/RoPE study's section (study_tables)."""
    return study_tables(STUDIES[0], path)


def study_tables(study: Study, path: Path) -> list[str]:
    """A study's tables from its results file (doc["tables"]: each a title or its key, columns, rows, a note), or
    one line saying how to make the file."""
    parts = [f"<h2 id=\"{study.name}\">{html.escape(study.title)}</h2>"]
    if not path.is_file():
        return parts + [f"<p>No results at {html.escape(str(path))}: run <code>{html.escape(study.make)}</code> in a "
                        "checkout of posenc to train or serve its models and write it.</p>"]
    doc = load_json(str(path))
    when = (doc.get("meta") or {}).get("date", "")
    parts.append(f"<p>From {html.escape(str(path))}{', ' + html.escape(when) if when else ''} "
                 f"({html.escape(study.source)}).</p>")
    for key, t in doc["tables"].items():
        rows = [[_cell(c) for c in row] for row in t["rows"]]
        parts += [f"<h3>{html.escape(t.get('title') or key.replace('_', ' '))}</h3>",
                  Table([str(c) for c in t["columns"]], rows, notes=[t["note"]] if t.get("note") else []).html()]
    return parts


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _loss(value: float) -> str:
    """ListModels' 0 means no figure was measured (a rope-scale copy was never trained; random weights)."""
    return f"{value:.3f} nats/byte" if value > 0 else "not measured"
