"""The one results writer and the results convention the docs are generated from (docs/tools/fill.py):

  {"meta": {"date": ISO-8601 UTC, "machine": str, "load": [1m, 5m, 15m] or null, "command": "make ..."},
   "tables": {"TABLE_ID": {"columns": [str, ...], "rows": [[cell, ...], ...], "note": optional str}}, ...}

`write` puts out/NAME.json and its markdown beside it, each atomically (model.files.atomic_write), and fills in the
date, the machine and the load a command's `meta` leaves out."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path

from lab.studies import load, machine
from model.files import atomic_write

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results"


def meta(command: str, **extra) -> dict:
    """A results file's `meta`: now, this machine, its load, the command that measured; `extra` adds or overrides."""
    return {"date": datetime.now(UTC).isoformat(timespec="seconds"), "machine": machine(), "load": load(),
            "command": command, **extra}


def cell(x) -> str:
    if x is None:
        return "–"
    if isinstance(x, bool):
        return "yes" if x else "no"
    return str(x).replace("|", "\\|").replace("\n", " ")


def source(name: str, meta: dict) -> str:
    """The line under every generated table: which command, when, on what, under what load, into which file."""
    parts = [f"`{meta['command']}`" if meta.get("command") else None, meta.get("date"), meta.get("machine")]
    load = meta.get("load")
    if isinstance(load, str):  # e.g. rows measured at different times, each with its own load
        parts.append(load)
    else:
        parts.append("load " + " / ".join(f"{x:.2f}" for x in load) if load else "load not recorded")
    judged = meta.get("judged")  # a table made again from the run's figures later (bench peers --rejudge)
    if judged:
        parts.append(f"judged again by `{judged['command']}`, {judged['date']}")
    return "Source: " + ", ".join(p for p in parts if p) + f" (bench/results/{name}.json)."


def render(t: dict) -> str:
    """One table of the convention as markdown, its note under it."""
    lines = ["| " + " | ".join(cell(c) for c in t["columns"]) + " |", "|" + "---|" * len(t["columns"])]
    lines += ["| " + " | ".join(cell(c) for c in row) + " |" for row in t["rows"]]
    if t.get("note"):
        lines += ["", t["note"]]
    return "\n".join(lines)


def markdown(data: dict, name: str) -> str:
    """A results file's every table, titled, for the markdown file written beside its JSON."""
    out = []
    for t in data.get("tables", {}).values():
        if t.get("title"):
            out += [f"**{t['title']}**", ""]
        out += [render(t), ""]
    return "\n".join(out + [source(name, data.get("meta", {}))]) + "\n"


def write(out: Path, name: str, data: dict, report: str | None = None, indent: int = 1) -> str:
    """A command's results: out/NAME.json and out/NAME.md (`report`, else markdown()), each written atomically, with
    `meta`'s date, machine and load filled in where the command left them out; returns the markdown."""
    given = data.get("meta", {})
    data["meta"] = {**meta(given.get("command", "")), **given}
    report = markdown(data, name) if report is None else report
    atomic_write(out / f"{name}.json", json.dumps(data, indent=indent, ensure_ascii=False) + "\n")
    atomic_write(out / f"{name}.md", report)
    return report
