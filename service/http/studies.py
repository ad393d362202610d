"""The study and benchmark results the viewer's Studies section shows, under /v1/posenc/studies.

A worker started with `--studies-dir DIR` (`make serve` gives it bench/results) lists every results file there: a
JSON object whose `tables` holds the results convention's tables (`columns`, `rows` of strings, numbers, booleans or
null, an optional `note` and `title`), with its `meta` (date, machine, load, the command that measured it).  That is
what `make lengthgen`, `make passkey`, the hybrid and scaling studies and every `python -m bench` command write.
The folder's own `*.json` files are looked at (names of letters, digits, `_`, `.` and `-`, not starting with a dot;
no subfolder), when asked: a study that finishes while the worker runs is there at the next request (a file is read
again only when it changed).  A file that is not such a document (not JSON, a NaN or a number past a float's range,
no tables, a cell that is not a string, number, boolean or null, over MAX_BYTES, a symbolic link) is listed under
`skipped` with the reason, never served half-read."""

from __future__ import annotations

import json
import math
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
MAX_BYTES = 64 * 1024 * 1024  # a results file past this is named, not read (bench/results' largest: about 0.5 MB)


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


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} is past a float's range")
    return value


def read_study(path: Path) -> tuple[dict[str, Any], list[StudyTable]]:
    """A results file's meta and tables, or ValueError saying why it is not a results document."""
    if path.is_symlink():
        raise ValueError("a symbolic link (only the folder's own files are shown)")
    try:
        size = path.stat().st_size
        if size > MAX_BYTES:
            raise ValueError(f"{size} bytes, over the {MAX_BYTES} a results file may take")
        doc = json.loads(path.read_bytes(), parse_constant=_no_constant, parse_float=_finite)
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
        self._kept: dict[Path, tuple[tuple[int, int, int], Any]] = {}  # path -> (stamp, read_study's answer or error)

    @staticmethod
    def _shown(path: Path) -> bool:
        """A *.json file of the folder with a plain name (a symbolic link too: read_study refuses it, named)."""
        return path.suffix == ".json" and bool(NAME.fullmatch(path.stem)) and (path.is_symlink() or path.is_file())

    def _files(self) -> list[Path]:
        if self.folder is None or not self.folder.is_dir():
            return []
        return sorted(p for p in self.folder.iterdir() if self._shown(p))

    def _read(self, path: Path) -> tuple[dict[str, Any], list[StudyTable]]:
        """read_study's answer, kept while the file's inode, size and modification time stay the same (a results
        file is replaced whole, so any new version has another inode or time)."""
        try:
            st = path.lstat()
        except OSError as err:
            raise ValueError(f"not readable: {err.strerror or err}") from None
        stamp = (st.st_ino, st.st_size, st.st_mtime_ns)
        kept = self._kept.get(path)
        if kept is None or kept[0] != stamp:
            try:
                kept = (stamp, read_study(path))
            except ValueError as err:
                kept = (stamp, err)
            self._kept[path] = kept
        if isinstance(kept[1], ValueError):
            raise kept[1]
        return kept[1]

    def listing(self) -> dict[str, Any]:
        studies, skipped = [], []
        files = self._files()
        for gone in set(self._kept) - set(files):
            self._kept.pop(gone, None)
        for path in files:
            try:
                meta, tables = self._read(path)
            except ValueError as err:
                skipped.append(SkippedFile(name=path.stem, reason=str(err)))
                continue
            studies.append(StudyEntry(name=path.stem, tables=[t.id for t in tables], meta=meta))
        return StudyList(folder=str(self.folder or ""), studies=studies, skipped=skipped).model_dump()

    def one(self, name: str) -> dict[str, Any]:
        if self.folder is None:
            raise HttpError(404, "this worker has no studies folder (start it with --studies-dir DIR)")
        path = self.folder / f"{name}.json"
        if not NAME.fullmatch(name) or not self._shown(path):  # the one file, not the folder's listing
            raise HttpError(404, f"no study {name!r} in the studies folder (GET /v1/posenc/studies lists them)")
        try:
            meta, tables = self._read(path)
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
