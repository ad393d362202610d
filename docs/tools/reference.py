"""The site's reference pages, generated from the code at every build (docs/tools/mkdocs_hooks.py adds them), so none of
them can disagree with what it describes:

  api/client.md     the Python client's API: client.api and client.channel, signatures and docstrings
  api/posenc-v1.md  posenc.v1 from protos/posenc/v1/posenc.proto and its comments (docs/tools/protodoc.py)
  api/http.md       every HTTP route from the worker's OpenAPI document, and its schemas
  api/openapi.json  that document itself, as GET /openapi.json answers it

    python -m docs.tools.reference OUT   writes the four files under OUT (to read them without building the site)
"""

from __future__ import annotations

import inspect
import json
import sys
from pathlib import Path
from types import ModuleType

from markdown.extensions.toc import slugify

import client.api
import client.channel
import protos.posenc.v1
from docs.tools import protodoc
from model.files import atomic_write
from service.http import app, openapi

CLIENT_MODULES: tuple[ModuleType, ...] = (client.api, client.channel)
FILES = ("api/client.md", "api/posenc-v1.md", "api/http.md", "api/openapi.json")
PROTO = Path(protos.posenc.v1.__file__).resolve().parent / "posenc.proto"


def escape(text: str) -> str:
    """`<`, `>` and `&` as entities outside code spans, so prose such as HOST:PORT<n> stays text."""
    parts = text.split("`")
    for i in range(0, len(parts), 2):
        parts[i] = parts[i].replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    return "`".join(parts)


def docstring(obj) -> str:
    """A docstring as markdown: prose escaped, its indented examples as code blocks.  A module's docstring is read
    as written (its margin is the first column); other docstrings lose their common indentation first."""
    doc = (obj.__doc__ or "").strip("\n") if inspect.ismodule(obj) else inspect.getdoc(obj) or ""
    out, code = [], False
    for line in doc.splitlines():
        indented = line.startswith("    ")
        if indented and not code and (not out or not out[-1]):
            out += ["```python"]
            code = True
        elif code and not indented and line.strip():
            out += ["```", ""]
            code = False
        out.append(line[4:] if code else escape(line))
    if code:
        out.append("```")
    return "\n".join(out)


# --- the Python client --------------------------------------------------------------------------------------

def public(module: ModuleType) -> list[tuple[str, object]]:
    """The classes and functions a module defines whose names do not start with an underscore, in source order."""
    found = [(name, obj) for name, obj in vars(module).items() if not name.startswith("_")
             and (inspect.isclass(obj) or inspect.isfunction(obj)) and obj.__module__ == module.__name__]
    return sorted(found, key=lambda item: inspect.getsourcelines(item[1])[1])


def members(cls: type) -> list[tuple[str, object]]:
    """A class's own public methods (static and class methods too) and properties, in source order."""
    found = []
    for name, raw in vars(cls).items():
        if name.startswith("_"):
            continue
        func = raw.__func__ if isinstance(raw, staticmethod | classmethod) else raw.fget if isinstance(
            raw, property) else raw
        if inspect.isfunction(func):
            found.append((name, func, inspect.getsourcelines(func)[1]))
    return [(name, func) for name, func, _ in sorted(found, key=lambda item: item[2])]


def signature(name: str, func, drop_self: bool = False) -> str:
    """`name(arg: annotation = default, ...) -> annotation` as the source writes the annotations."""
    params = list(inspect.signature(func).parameters.values())
    if drop_self and params and params[0].name in ("self", "cls"):
        params = params[1:]
    args, star = [], False
    for p in params:
        if p.kind is p.KEYWORD_ONLY and not star:
            args.append("*")
        star = star or p.kind in (p.KEYWORD_ONLY, p.VAR_POSITIONAL)
        text = {p.VAR_POSITIONAL: "*", p.VAR_KEYWORD: "**"}.get(p.kind, "") + p.name
        if p.annotation is not p.empty:
            text += f": {p.annotation}"
        if p.default is not p.empty:
            text += f" = {p.default!r}" if p.annotation is not p.empty else f"={p.default!r}"
        args.append(text)
    returns = inspect.signature(func).return_annotation
    returns = f" -> {returns}" if returns is not inspect.Signature.empty else ""
    if len(name) + sum(len(a) + 2 for a in args) + len(returns) > 100:  # one argument a line
        return f"{name}(\n" + "".join(f"    {a},\n" for a in args) + f"){returns}"
    return f"{name}({', '.join(args)}){returns}"


def client_page() -> str:
    out = ["# Python client", "",
           "The typed client over posenc.v1 (`client.api`) and the channels it runs on (`client.channel`): every "
           "public class and function, with its signature and docstring, generated from the code at each site "
           "build. The messages it sends and returns are on the [posenc.v1](posenc-v1.md) page; the `posenc` "
           "command line built on it is described in [Serving](../serving.md).", ""]
    for module in CLIENT_MODULES:
        out += [f"## {module.__name__}", "", docstring(module), ""]
        for name, obj in public(module):
            kind = "class" if inspect.isclass(obj) else "def"
            if kind == "class" and issubclass(obj, BaseException):  # raised, not made: its base says what it is
                sig = f"{name}({', '.join(b.__name__ for b in obj.__bases__)})"
            else:
                sig = signature(name, obj if kind == "def" else obj.__init__, drop_self=kind == "class")
            out += [f"### {name}", "", "```python", f"{kind} {sig.rsplit(' -> ', 1)[0] if kind == 'class' else sig}",
                    "```", "", docstring(obj), ""]
            if kind == "class" and issubclass(obj, BaseException):
                continue
            for method, func in members(obj) if kind == "class" else []:
                out += [f"#### {name}.{method}", "", "```python", f"def {signature(method, func, True)}", "```", "",
                        docstring(func), ""]
    return "\n".join(out)


# --- the HTTP API -------------------------------------------------------------------------------------------

def document() -> dict:
    """The OpenAPI document exactly as the worker serves it at GET /openapi.json (service.http.app)."""
    return openapi.document(app.own_spec())


def schema_type(s: dict) -> str:
    """A JSON schema in a few words: its type, array items, alternatives, enum values; $refs link to their table."""
    if "$ref" in s:
        name = s["$ref"].rsplit("/", 1)[1]
        return f"[{name}](#{slugify('schema ' + name, '-')})"
    if "anyOf" in s or "oneOf" in s:
        return " or ".join(schema_type(x) for x in s.get("anyOf", s.get("oneOf")))
    if "enum" in s:
        return "one of " + ", ".join(f"`{json.dumps(v)}`" for v in s["enum"])
    if "const" in s:
        return f"`{json.dumps(s['const'])}`"
    kind = s.get("type", "any")
    if isinstance(kind, list):
        return " or ".join(kind)
    if kind == "array":
        return f"array of {schema_type(s.get('items', {}))}"
    if kind == "object" and isinstance(s.get("additionalProperties"), dict):
        return f"object of {schema_type(s['additionalProperties'])}"
    return kind


def prose(text: str) -> str:
    return escape(" ".join(text.split())).replace("|", "\\|")


def http_page(doc: dict) -> str:
    info, schemas = doc["info"], doc["components"]["schemas"]
    out = [f"# HTTP API ({info['title']})", "", prose(info["description"]), "",
           f"Every route of the worker's HTTP port, generated at each site build from the OpenAPI {doc['openapi']} "
           "document the worker serves at `GET /openapi.json`; the document itself is "
           "[openapi.json](openapi.json). Each route answers 200 with the body below; any other status carries the "
           "error body its row names, and which status each fault gets is on the [Errors](../errors.md) page.", "",
           "| method | path | what |", "|---|---|---|"]
    operations = [(method.upper(), path, op) for path, ops in doc["paths"].items() for method, op in ops.items()]
    for method, path, op in operations:
        out.append(f"| {method} | [`{path}`](#{slugify(f'{method} {path}', '-')}) | {prose(op['summary'])} |")
    out.append("")
    for method, path, op in operations:
        summary = prose(op["summary"])
        out += [f"## {method} {path}", "", summary[:1].upper() + summary[1:] + ".", ""]
        rows = [f"| path parameter `{p['name']}` | {schema_type(p['schema'])} |" for p in op.get("parameters", [])]
        if "requestBody" in op:
            rows += [f"| request body ({media}) | {schema_type(c['schema'])} |"
                     for media, c in op["requestBody"]["content"].items()]
        for status, resp in op["responses"].items():
            what = "any other status" if status == "default" else status
            for media, c in resp.get("content", {}).items() or [("", {})]:
                body = schema_type(c["schema"]) if "schema" in c else "the file" if media else "no body"
                rows.append(f"| {what} ({media}) | {body} |" if media else f"| {what} | {body} |")
        out += ["| part | body |", "|---|---|", *rows, ""]
    out += ["## Schemas", ""]
    for name in sorted(schemas, key=str.lower):
        s = schemas[name]
        out += [f"### schema {name}", ""] + ([prose(s["description"]), ""] if s.get("description") else [])
        props = s.get("properties", {})
        if not props:
            out += [f"Type: {schema_type(s)}.", ""]
            continue
        required = set(s.get("required", []))
        out += ["| field | type | required | default | description |", "|---|---|---|---|---|"]
        for field, p in props.items():
            default = f"`{json.dumps(p['default'])}`" if "default" in p else "–"
            out.append(f"| `{field}` | {schema_type(p)} | {'yes' if field in required else 'no'} | "
                       f"{default.replace('|', chr(92) + '|')} | {prose(p.get('description', '')) or '–'} |")
        out.append("")
    return "\n".join(out)


# --- all of them --------------------------------------------------------------------------------------------

def pages() -> dict[str, str]:
    """Path inside the site -> content, for every generated reference file."""
    doc = document()
    contents = (client_page(), protodoc.page(PROTO, "protos/posenc/v1/posenc.proto"), http_page(doc),
                json.dumps(doc, indent=1) + "\n")
    return dict(zip(FILES, contents, strict=True))


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or args[0].startswith("-"):
        print("usage: python -m docs.tools.reference OUT (a folder: the reference pages are written under it)",
              file=sys.stderr)
        return 2
    for rel, content in pages().items():
        path = Path(args[0]) / rel
        atomic_write(path, content)
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
