"""The study and benchmark results the viewer's Studies section shows, under /v1/posenc/studies.

A worker started with `--studies-dir DIR` (`make serve` gives it bench/results) lists every results file there: a
JSON object whose `tables` holds the results convention's tables (`columns`, `rows` of strings, numbers, booleans or
null, an optional `note` and `title`), with its `meta` (date, machine, load, the command that measured it).  That is
what `make lengthgen`, `make passkey`, the hybrid and scaling studies and every `python -m bench` command write.
Files are read when asked, so a study that finishes while the worker runs is there at the next request; a file that
is not such a document is listed under `skipped` with the reason, never served half-read."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import Response

from service.http.errors import HttpError
from service.http.front import Front, json_response
from service.http.routing import Api, route

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")  # a results file's stem: no separator, no leading dot
Cell = str | int | float | bool | None


class StudyTable(BaseModel):
    id: str
    columns: list[Cell]
    rows: list[list[Cell]]
    note: str = ""
    title: str = ""


class StudyEntry(BaseModel):
    name: str  # the file's stem: GET /v1/posenc/studies/{name}
    tables: list[str]  # its tables' ids, in the file's order
    meta: dict[str, Any]


class SkippedFile(BaseModel):
    name: str
    reason: str


class StudyList(BaseModel):
    folder: str  # --studies-dir, "" when the worker was started without one
    studies: list[StudyEntry]
    skipped: list[SkippedFile]


class Study(BaseModel):
    name: str
    meta: dict[str, Any]
    tables: list[StudyTable]


def _cell_ok(value: Any) -> bool:
    return value is None or isinstance(value, str | int | float | bool)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def read_study(path: Path) -> tuple[dict[str, Any], list[StudyTable]]:
    """A results file's meta and tables, or ValueError saying why it is not a results document."""
    try:
        doc = json.loads(path.read_bytes(), parse_constant=_no_constant)
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as err:  # JSONDecodeError is a ValueError
        raise ValueError(f"not readable JSON: {err}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("tables"), dict) or not doc["tables"]:
        raise ValueError("holds no tables (a JSON object with a non-empty `tables` object)")
    meta = doc.get("meta", {})
    if not isinstance(meta, dict):
        raise ValueError("its `meta` is not an object")
    tables = []
    for tid, t in doc["tables"].items():
        if not isinstance(t, dict) or not isinstance(t.get("columns"), list) or not isinstance(t.get("rows"), list):
            raise ValueError(f"table {tid!r} has no `columns` and `rows` lists")
        if not all(_cell_ok(c) for c in t["columns"]) or not all(
                isinstance(r, list) and all(_cell_ok(c) for c in r) for r in t["rows"]):
            raise ValueError(f"table {tid!r} holds a cell that is not a string, number, boolean or null")
        tables.append(StudyTable(id=tid, columns=t["columns"], rows=t["rows"], note=str(t.get("note") or ""),
                                 title=str(t.get("title") or "")))
    return meta, tables


class Studies(Api):
    """The results folder given to the worker (Front.studies), read at each request in a worker thread."""

    def __init__(self, front: Front):
        super().__init__(front)
        self.folder = front.studies

    def _files(self) -> list[Path]:
        if self.folder is None or not self.folder.is_dir():
            return []
        return sorted(p for p in self.folder.iterdir() if p.suffix == ".json" and NAME.fullmatch(p.stem)
                      and p.is_file())

    def listing(self) -> dict[str, Any]:
        studies, skipped = [], []
        for path in self._files():
            try:
                meta, tables = read_study(path)
            except ValueError as err:
                skipped.append(SkippedFile(name=path.stem, reason=str(err)))
                continue
            studies.append(StudyEntry(name=path.stem, tables=[t.id for t in tables], meta=meta))
        return StudyList(folder=str(self.folder or ""), studies=studies, skipped=skipped).model_dump()

    def one(self, name: str) -> dict[str, Any]:
        if self.folder is None:
            raise HttpError(404, "this worker has no studies folder (start it with --studies-dir DIR)")
        path = self.folder / f"{name}.json"
        if not NAME.fullmatch(name) or path not in self._files():
            raise HttpError(404, f"no study {name!r} in the studies folder (GET /v1/posenc/studies lists them)")
        try:
            meta, tables = read_study(path)
        except ValueError as err:
            raise HttpError(404, f"study {name!r} is not a results file: {err}") from None
        return Study(name=name, meta=meta, tables=tables).model_dump()

    @route("GET", "/v1/posenc/studies", "the study and benchmark results in the worker's --studies-dir",
           response=StudyList)
    async def studies(self, request: Request) -> Response:
        return await self.front.call(lambda: json_response(self.listing()))

    @route("GET", "/v1/posenc/studies/{name}", "one results file's tables and where they were measured",
           response=Study)
    async def study(self, request: Request) -> Response:
        name = request.path_params["name"]
        return await self.front.call(lambda: json_response(self.one(name)))
