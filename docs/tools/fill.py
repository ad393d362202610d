"""make docs: fill every generated figure in README.md and docs/*.md from the results files under bench/results/.

  python -m docs.tools.fill [--check]

A page asks for a table with a pair of markers and never holds a measured number typed by hand:

  <!-- table: NAME/TABLE_ID -->
  (generated: the table, then a line saying which command measured it, when, where and under what load)
  <!-- /table -->

  text <!-- fig: NAME/KEY/KEY/0/KEY|.1f -->290.5<!-- /fig --> text

NAME is a results file, bench/results/NAME.json (NAME may hold a folder: lab/extrapolation), TABLE_ID a key of its
`tables`; a figure's path walks the file's keys (list items by index) and may end in a format spec after `|`.
Every results file follows one convention (bench/lib/results.py, the writer every command uses).

Files written before the convention existed and by commands outside bench/ are read through ADAPTERS, which build
the same shape from the file's own fields.  Without --check the pages are rewritten (atomically) where a block is
stale; with --check nothing is written and the exit status is 1 when a page differs from what the results say
(tests/test_docs.py runs the same comparison).  A marker naming a file, table or key that does not exist is one
line on stderr and exit status 2.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Callable
from pathlib import Path

from bench.lib.results import RESULTS, cell, render, source
from model.cli import Parser
from model.files import atomic_write

ROOT = Path(__file__).resolve().parents[2]

TABLE = re.compile(r"(<!-- table: (?P<ref>[^ ]+?) -->\n)(?P<body>.*?)(<!-- /table -->)", re.S)
FIG = re.compile(r"(<!-- fig: (?P<ref>[^|>]+?)(?:\|(?P<fmt>[^ >]*))? -->)(?P<body>.*?)(<!-- /fig -->)", re.S)


class DocsError(Exception):
    """A marker that names no results file, table or key (one line: the page, the marker, what is missing)."""


def pages(root: Path = ROOT) -> list[Path]:
    """Every page the generator fills: README.md and the site's markdown."""
    return [root / "README.md"] + sorted((root / "docs").rglob("*.md"))


# --- reading results ----------------------------------------------------------------------------------------

def _extrapolation(d: dict) -> dict:
    """lab/extrapolation.json (posenc extrapolate): perplexity per byte by factor of the trained context."""
    factors = [str(f) for f in d["factors"]]
    rows = []
    for name, r in d["rows"].items():
        cells = r["cells"]
        ppl = [cells[f].get("perplexity_per_byte", cells[f].get("perplexity")) if f in cells else None
               for f in factors]
        ratio = f"{ppl[-1] / ppl[0]:.2f}" if ppl[0] and ppl[-1] else None
        rows.append([name] + [f"{p:.2f}" if p else None for p in ppl] + [ratio])
    rows.sort(key=lambda row: (row[-1] is None, float(row[-1] or 0)))
    ctx = next(iter(d["rows"].values()))["trained_context"]
    columns = ["model"] + [f"{f}x ({int(f) * ctx})" for f in factors] + [f"{factors[-1]}x / {factors[0]}x"]
    text = d.get("text", {})
    note = (f"Perplexity per byte on {text.get('text_bytes', '?')} held-out bytes of {text.get('corpus', '?')} "
            f"(offset {text.get('offset', 0)}), {d.get('seconds', '?')} s in all; – : no positions that far.")
    return {"meta": {"date": d.get("date"), "machine": d.get("machine"), "load": d.get("load"),
                     "command": "posenc extrapolate"},
            "tables": {"perplexity": {"columns": columns, "rows": rows, "note": note}}}


def _swarm(d: dict) -> dict:
    """swarm.json (make swarm-test): what each step of the live Swarm test measured."""
    def calls(step: dict) -> str:
        return f"{step['requests']} calls, {step['failed']} failed, {step.get('resent_after_refusal', 0)} resent"

    rows = [["deploy to healthy replicas", f"{d['deploy_to_healthy_s']} s", ""],
            ["rolling update, start-first", f"{d['rolling_update']['seconds']} s", calls(d["rolling_update"])],
            ["update to a broken setting, until rolled back", f"{d['failed_update_rolled_back']['seconds']} s",
             calls(d["failed_update_rolled_back"])],
            ["one replica SIGKILLed, until a replacement is healthy",
             f"{d['replica_killed']['kill_to_replica_healthy_s']} s", calls(d["replica_killed"])],
            ["scale to 1, then back to 3 healthy", f"{d['scale_1_and_back']['down_to_1_s']} s + "
             f"{d['scale_1_and_back']['up_to_3_healthy_s']} s", calls(d["scale_1_and_back"])]]
    rows += [[f"closed-loop calls/s with {n} replica{'s' if n != '1' else ''}", v, ""]
             for n, v in d["calls_per_s_by_replicas"].items()]
    rows.append(["the whole test", f"{d['total_s']} s", ""])
    return {"meta": {"date": d.get("date"), "machine": f"{d['machine']['cpus']} CPUs, Docker {d['docker']}",
                     "load": d.get("load"), "command": "make swarm-test"},
            "tables": {"steps": {"columns": ["step", "time", "calls during it"], "rows": rows}}}


# Results files that do not carry `meta` and `tables` themselves (written by commands outside bench/).
ADAPTERS: dict[str, Callable[[dict], dict]] = {"lab/extrapolation": _extrapolation, "swarm": _swarm}


def load(name: str, results: Path = RESULTS) -> dict:
    """bench/results/NAME.json in the convention's shape."""
    path = results / f"{name}.json"
    try:
        data = json.loads(path.read_text())
    except OSError:
        raise DocsError(f"no results file {path.relative_to(results.parent.parent)}") from None
    except ValueError as e:
        raise DocsError(f"{path.relative_to(results.parent.parent)} is not JSON: {e}") from None
    if name in ADAPTERS:  # the adapter's tables, and any the file carries itself (those win)
        try:
            adapted = ADAPTERS[name](data)
        except (KeyError, IndexError, TypeError, ValueError) as e:
            if "tables" not in data:
                raise DocsError(f"bench/results/{name}.json lacks what its adapter reads ({e!r}); write `tables` in "
                                "it instead") from None
            adapted = {}
        data = {**data, "meta": data.get("meta") or adapted.get("meta", {}),
                "tables": {**adapted.get("tables", {}), **data.get("tables", {})}}
    return data


class Results:
    """Results files read once each, by name."""

    def __init__(self, results: Path = RESULTS):
        self.dir = results
        self.cache: dict[str, dict] = {}

    def get(self, name: str) -> dict:
        if name not in self.cache:
            self.cache[name] = load(name, self.dir)
        return self.cache[name]

    def split(self, ref: str) -> tuple[str, list[str]]:
        """NAME/KEY/KEY -> (NAME, [KEY, KEY]) for the shortest NAME that is a results file."""
        parts = ref.split("/")
        for i in range(1, len(parts)):
            name = "/".join(parts[:i])
            if (self.dir / f"{name}.json").is_file():
                return name, parts[i:]
        raise DocsError(f"{ref!r} names no results file under bench/results")


# --- rendering (bench.lib.results: cell, render, source) --------------------------------------------------

def table(name: str, table_id: str, results: Results) -> str:
    data = results.get(name)
    tables = data.get("tables", {})
    if table_id not in tables:
        raise DocsError(f"bench/results/{name}.json has no table {table_id!r} (it has: {', '.join(tables) or 'none'})")
    return render(tables[table_id]) + "\n\n" + source(name, data.get("meta", {})) + "\n"




def figure(ref: str, fmt: str | None, results: Results) -> str:
    name, keys = results.split(ref)
    value = results.get(name)
    for key in keys:
        try:
            value = value[int(key)] if isinstance(value, list) else value[key]
        except (KeyError, IndexError, ValueError, TypeError):
            raise DocsError(f"bench/results/{name}.json has no {'/'.join(keys)!r} (stopped at {key!r})") from None
    if isinstance(value, (dict, list)):
        raise DocsError(f"bench/results/{name}.json: {'/'.join(keys)!r} is not a single value")
    return format(value, fmt) if fmt else cell(value)






def fill(text: str, results: Results) -> str:
    """The page with every generated block and figure recomputed."""
    def one_table(m: re.Match) -> str:
        name, _, table_id = m["ref"].rpartition("/")
        if not name:
            raise DocsError(f"table marker {m['ref']!r} is not NAME/TABLE_ID")
        return m.group(1) + table(name, table_id, results) + m.group(4)

    text = TABLE.sub(one_table, text)
    return FIG.sub(lambda m: m.group(1) + figure(m["ref"], m["fmt"], results) + m.group(5), text)


def stale(root: Path = ROOT, results: Path | None = None, errors: list[str] | None = None) -> dict[Path, str]:
    """Pages whose generated parts differ from the results files, with the text they should have.  A marker that
    names nothing raises DocsError, or, given a list, is appended to it and leaves its page out."""
    res = Results(results or root / "bench" / "results")
    out = {}
    for page in pages(root):
        text = page.read_text()
        try:
            new = fill(text, res)
        except DocsError as e:
            if errors is None:
                raise DocsError(f"{page.relative_to(root)}: {e}") from None
            errors.append(f"{page.relative_to(root)}: {e}")
            continue
        if new != text:
            out[page] = new
    return out


def main(argv: list[str] | None = None) -> int:
    p = Parser(prog="python -m docs.tools.fill", description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="write nothing; exit 1 when a page is stale")
    args = p.parse_args(argv)
    errors: list[str] = []
    todo = stale(errors=errors)
    for page, text in todo.items():
        rel = page.relative_to(ROOT)
        if args.check:
            print(f"docs.tools.fill: {rel} differs from bench/results (make docs rewrites it)", file=sys.stderr)
            continue
        atomic_write(page, text)
        print(f"docs.tools.fill: {rel} updated")
    for e in errors:
        print(f"docs.tools.fill: {e}", file=sys.stderr)
    return 2 if errors else 1 if args.check and todo else 0


if __name__ == "__main__":
    sys.exit(main())
