"""The generated reference pages against what they describe, each read another way: the client page against the
client's source read by ast (every public class, function and method, its arguments, a docstring for each), the
HTTP page against the OpenAPI document (every route, every schema, every field), and the document the site ships
checked by openapi-spec-validator.  tests/http/test_openapi.py holds that document equal to what a running worker
serves; tests/test_docs.py builds the site with these pages in it."""

import ast
import json
import re
from pathlib import Path

import pytest
from openapi_spec_validator import validate

from docs.tools import reference

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def pages() -> dict[str, str]:
    return reference.pages()


def in_source(path: Path) -> dict[str, tuple[list[str], bool]]:
    """{name or Class.method: (argument names, has a docstring)} of what a file defines publicly, read by ast."""
    out = {}

    def args(fn) -> list[str]:
        a = fn.args
        return [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs] + [
            x.arg for x in (a.vararg, a.kwarg) if x is not None]

    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
            out[node.name] = (args(node), bool(ast.get_docstring(node)))
        elif isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
            init = [n for n in node.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"]
            fields = [n.target.id for n in node.body if isinstance(n, ast.AnnAssign)]  # a dataclass's arguments
            bases = [b.id for b in node.bases if isinstance(b, ast.Name)]  # an exception is shown with its base
            shown = args(init[0])[1:] if init else fields or bases
            out[node.name] = (shown, bool(ast.get_docstring(node)))
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and not item.name.startswith("_"):
                    out[f"{node.name}.{item.name}"] = (args(item)[1:], bool(ast.get_docstring(item)))
    return out


def on_page(markdown: str, module: str) -> dict[str, tuple[str, str]]:
    """{heading: (its code block, the prose under it)} of one module's section of the client page."""
    section = markdown.split(f"\n## {module}\n", 1)[1].split("\n## ", 1)[0]
    out = {}
    for m in re.finditer(r"\n#{3,4} (\S+)\n\n```python\n(.*?)\n```\n(.*?)(?=\n#{3,4} |\Z)", section, re.S):
        out[m[1]] = (m[2], m[3].strip())
    return out


def arguments(code: str) -> list[str]:
    """The argument names of a signature shown on the page, read by ast (a class is read as a def)."""
    fn = ast.parse(re.sub(r"^class ", "def ", code) + ": ...").body[0]
    a = fn.args
    return [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs] + [x.arg for x in (a.vararg, a.kwarg) if x]


@pytest.mark.parametrize("module", ["client.api", "client.channel"])
def test_the_client_page_has_every_public_item_with_its_arguments_and_a_docstring(pages, module):
    source = in_source(ROOT / (module.replace(".", "/") + ".py"))
    shown = on_page(pages["api/client.md"], module)
    assert set(shown) == set(source)
    for name, (args, _) in source.items():
        assert arguments(shown[name][0]) == args, (name, shown[name][0])
    undocumented = [name for name, (code, prose) in shown.items() if not prose]
    assert not undocumented, f"public names of {module} without a docstring: {undocumented}"


def sections(markdown: str, level: str) -> dict[str, str]:
    parts = re.split(rf"^{level} (.+)$", markdown, flags=re.M)
    return dict(zip(parts[1::2], parts[2::2], strict=True))


def test_the_http_page_has_every_route_schema_and_field_of_the_document(pages):
    doc = json.loads(pages["api/openapi.json"])
    page = pages["api/http.md"]
    routes = {k: v.split("\n## Schemas", 1)[0] for k, v in sections(page, "##").items() if k != "Schemas"}
    assert set(routes) == {f"{m.upper()} {p}" for p, ops in doc["paths"].items() for m in ops}
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            text = routes[f"{method.upper()} {path}"]
            refs = {json.dumps(x) for x in [op.get("requestBody", {})] + list(op["responses"].values())}
            names = set(re.findall(r'"#/components/schemas/(\w+)"', " ".join(refs)))
            assert set(re.findall(r"\(#schema-([\w-]+)\)", text)) == {n.lower() for n in names}, (path, method)
            assert set(re.findall(r"path parameter `(\w+)`", text)) == {p["name"] for p in op.get("parameters", [])}
    schemas = sections(page.split("\n## Schemas\n", 1)[1], "###")
    assert set(schemas) == {f"schema {name}" for name in doc["components"]["schemas"]}
    for name, schema in doc["components"]["schemas"].items():
        rows = re.findall(r"^\| `(\w+)` \| .*? \| (yes|no) \|", schemas[f"schema {name}"], re.M)
        props = schema.get("properties", {})
        assert dict(rows) == {f: "yes" if f in schema.get("required", []) else "no" for f in props}, name


def test_the_shipped_document_is_valid_openapi_and_the_workers_own(pages):
    doc = json.loads(pages["api/openapi.json"])
    validate(doc)
    assert doc == reference.document() and doc["paths"]["/openapi.json"]["get"]


def test_the_reference_cli_writes_the_pages_and_refuses_bad_arguments(tmp_path, capsys):
    assert reference.main([str(tmp_path)]) == 0
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*") if p.is_file()) == sorted(
        reference.FILES)
    assert reference.main([]) == 2 and "usage" in capsys.readouterr().err
