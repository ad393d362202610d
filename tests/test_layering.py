"""ARCHITECTURE.md's arrows: who may import whom, no import cycles (every kind of import counted), no module over 400
lines.  Scans with ast."""

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STDLIB = set(sys.stdlib_module_names)
PACKAGES = ("model", "export", "protos", "service", "client", "lab", "bench", "docs/tools")
# Torch-free, stdlib-only corners of model/ that the worker and the lab may use.
MODEL_CORNER = {"model.tokenizer", "model.config", "model.layer_spec", "model.errors", "model.cli",
                "model.files"}
ALLOWED = {
    "model": {"model", "torch", "numpy", "safetensors", "tokenizers"},
    "export": {"export", "model", "torch", "onnx", "onnxruntime", "onnxscript", "numpy", "safetensors", "tokenizers",
               "protos", "fastjsonschema", "transformers"},
    # protos: the ModelConfig builder (config.pbtxt) shared with the worker, and model.json's schema
    # (protos/model.schema.json), checked on writing; transformers: the proof at import (export/proof.py), lazily
    "protos": {"protos", "google", "grpc", "grpc_tools"},  # grpc_tools: only the build-time generator script
    "service": {"service", "protos", "onnxruntime", "numpy", "grpc", "grpc_health", "grpc_reflection", "google",
                "prometheus_client", "tokenizers", "starlette", "uvicorn", "anyio", "pydantic", "pydantic_core",
                "jinja2", "fastjsonschema", *MODEL_CORNER},  # jinja2: chat templates (service/chat_template.py)
    "client": {"client", "protos", "grpc", "google", "numpy", "model.cli"},  # model.cli: the one Parser (stdlib)
    "lab": {"lab", "client", "protos", "grpc", "google", "numpy", "matplotlib", "model.corpus", "model.files"},
    # lab/experiments/: the studies that train their own models (torch, transformers, tokenizers, model), export them
    # (export), serve them in process (service) and measure through lab/studies.py; results by bench.lib.results
    "lab/experiments": {"lab", "client", "protos", "grpc", "google", "numpy", "matplotlib", "model", "export",
                        "service", "torch", "transformers", "tokenizers", "bench.lib"},
    # docs/tools/: the site's generators read the code they describe (client, protos, the worker's OpenAPI document),
    # fill pages from bench/results through bench.lib.results and run a real worker for the notebook and the viewer
    "docs/tools": {"docs", "bench.lib", "client", "protos", "grpc", "google", "numpy", "model", "export", "service",
                   "lab", "mkdocs", "markdown", "nbformat", "nbclient", "selenium", "requests"},
}
# Packages whose imports inside functions must each say why (a "# lazy: <reason>" comment in the function, above the
# import, with the measured cost where the reason is cost).  bench/ may import anything: its sections load the
# optional engines (transformers, Optimum, OpenVINO, ...) they measure, only when asked to.
LAZY_EXPLAINED = ("model", "export", "protos", "service", "client", "lab", "docs/tools")


def imports(path: Path) -> set[str]:
    """Every module a file imports, wherever the import stands (top, function, TYPE_CHECKING block)."""
    tree = ast.parse(path.read_text(), str(path))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names |= {f"{node.module}.{a.name}" for a in node.names}  # from model import tokenizer
    return names


def allowed(package: str, name: str) -> bool:
    """One rule wherever the import is: an import inside a function is still an arrow (client/ never imports lab/,
    not even lazily; `posenc`, which offers both, lives in lab/cli.py)."""
    top = name.split(".")[0]
    if top in STDLIB:
        return True
    rules = ALLOWED[package]
    if top in ("model", "bench") and top not in rules:  # only the corners the row names: model.cli, bench.lib
        return any(name == r or name.startswith(r + ".") for r in rules)
    return top in rules


def sources(package: str):
    return [p for p in sorted((ROOT / package).rglob("*.py")) if "_pb2" not in p.name]


def governed(row: str):
    """The files a row of ALLOWED governs: its folder's, less those a narrower row governs (lab/experiments/ in
    lab/)."""
    narrower = [ROOT / r for r in ALLOWED if r.startswith(row + "/")]
    return [p for p in sources(row) if not any(p.is_relative_to(n) for n in narrower)]


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_import_arrows(package):
    bad = []
    for p in governed(package):
        for n in sorted(imports(p)):
            if not allowed(package, n):
                bad.append(f"{p.relative_to(ROOT)}: {n}")
    assert not bad, "imports that break ARCHITECTURE.md's arrows:\n" + "\n".join(bad)


def test_the_scan_sees_a_violation(tmp_path):
    bad = tmp_path / "x.py"
    bad.write_text("import torch\nfrom export import thing\n")
    assert not allowed("service", "torch") and "torch" in imports(bad)
    assert not allowed("client", "lab.pictures") and not allowed("client", "lab") and allowed("lab", "client.cli")
    inside = tmp_path / "lazy.py"
    inside.write_text("def picture():\n    # lazy: only for a picture\n    from lab.heatmap import draw\n")
    assert "lab.heatmap.draw" in imports(inside) and not allowed("client", "lab.heatmap.draw")
    assert not allowed("service", "model.transformer") and allowed("service", "model.tokenizer")


def unexplained_lazy_imports(path: Path) -> list[str]:
    """Imports inside a function with no "# lazy:" comment between the function's first line and the import."""
    text = path.read_text()
    lines, bad = text.splitlines(), []
    for fn in ast.walk(ast.parse(text, str(path))):
        if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        for node in ast.walk(fn):
            if isinstance(node, ast.Import | ast.ImportFrom) and not any(
                    "# lazy:" in line for line in lines[fn.lineno - 1:node.lineno]):
                where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name
                bad.append(f"{where}:{node.lineno}: {lines[node.lineno - 1].strip()}")
    return bad


@pytest.mark.parametrize("package", LAZY_EXPLAINED)
def test_imports_inside_functions_say_why(package):
    bad = [b for p in sources(package) for b in unexplained_lazy_imports(p)]
    assert not bad, ("imports inside functions without a '# lazy: <measured reason>' comment (import at the top, "
                     "or say why not):\n" + "\n".join(bad))


def test_the_lazy_scan_sees_an_unexplained_import(tmp_path):
    src = tmp_path / "x.py"
    src.write_text("import os\n\n\ndef f():\n    import json\n\n\ndef g():\n    # lazy: 40 MB\n    import json\n")
    assert [b.split(":")[1] for b in unexplained_lazy_imports(src)] == ["5"]


def module_of(path: Path, root: Path = ROOT) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(paths: list[Path], root: Path = ROOT) -> dict[str, set[str]]:
    """Module -> the project's modules it imports, every import counted: at the top, inside functions, and under
    `if TYPE_CHECKING:` (an import a type checker follows is an arrow all the same)."""
    mods = {module_of(p, root): p for p in paths}
    graph = {}
    for mod, path in mods.items():
        deps = set()
        # `from pkg import name` runs pkg/__init__.py first, whatever `name` is (a submodule too): an arrow to pkg
        packages = {n.module for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.ImportFrom)
                    and n.level == 0 and n.module in mods and mods[n.module].name == "__init__.py"}
        for name in imports(path) | packages:
            while name and name not in mods:  # `from a.b import c`: c may be a name inside a.b
                name = name.rpartition(".")[0]
            if name and name != mod:
                deps.add(name)
        graph[mod] = deps
    return graph


def first_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle (its modules in order, the first repeated at the end), or None."""
    state, stack = {}, []

    def visit(m: str) -> list[str] | None:
        state[m] = "open"
        stack.append(m)
        for d in sorted(graph[m]):
            if state.get(d) == "open":
                return stack[stack.index(d):] + [d]
            if d not in state and (found := visit(d)):
                return found
        stack.pop()
        state[m] = "done"
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_no_import_cycles():
    """The project's modules import each other in no cycle, whatever kind of import closes it."""
    cycle = first_cycle(import_graph([p for pkg in PACKAGES for p in sources(pkg)]))
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


@pytest.mark.parametrize("how", ["top", "function", "type_checking"])
def test_the_cycle_scan_sees_a_planted_cycle_of_every_kind(tmp_path, how):
    """A two-module cycle closed at the top, inside a function, or under TYPE_CHECKING is found; without the closing
    import there is none."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg.b import B\n\n\nclass A(B):\n    pass\n")
    closing = {"top": "from pkg.a import A\n",
               "function": "def make():\n    # lazy: planted\n    from pkg.a import A\n    return A()\n",
               "type_checking": "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from pkg.a import A\n"}
    (pkg / "b.py").write_text("class B:\n    pass\n\n\n" + closing[how])
    paths = sorted(pkg.rglob("*.py"))
    assert first_cycle(import_graph(paths, tmp_path)) == ["pkg.a", "pkg.b", "pkg.a"]
    (pkg / "b.py").write_text("class B:\n    pass\n")
    assert first_cycle(import_graph(sorted(pkg.rglob("*.py")), tmp_path)) is None


@pytest.mark.parametrize("package", PACKAGES)
def test_no_module_over_400_lines(package):
    long = [f"{p.relative_to(ROOT)}: {n}" for p in sources(package)
            if (n := len(p.read_text().splitlines())) > 400 and package != "protos"]
    assert not long, "modules over 400 lines:\n" + "\n".join(long)


def test_a_submodule_taken_from_its_package_is_an_arrow_to_the_package(tmp_path):
    """`from pkg import helper` in pkg/load.py runs pkg/__init__.py, which imports pkg.load: a cycle, though
    pkg.helper itself imports nothing; `from pkg.helper import x` would not close it."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from pkg.load import run\n")
    (pkg / "helper.py").write_text("def x():\n    return 1\n")
    (pkg / "load.py").write_text("from pkg import helper\n\n\ndef run():\n    return helper.x()\n")
    assert first_cycle(import_graph(sorted(pkg.rglob("*.py")), tmp_path)) == ["pkg", "pkg.load", "pkg"]
    (pkg / "load.py").write_text("from pkg.helper import x\n\n\ndef run():\n    return x()\n")
    assert first_cycle(import_graph(sorted(pkg.rglob("*.py")), tmp_path)) is None

