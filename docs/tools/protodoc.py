"""The posenc.v1 reference page (api/posenc-v1.md in the site) from the .proto sources and their comments.

A small reader of proto3 files: comments (a `//` block directly above a declaration leads it, a `//` after it on
the same line trails it), `syntax`, `package`, `import` and `option` statements, `message` blocks (nested messages
and enums, `oneof`, `map<K, V>`, `repeated`, `optional`, `reserved`), `enum` blocks and `service` blocks with their
`rpc`s (`stream` on either side).  Field options in brackets are read past.  It reads what protoc accepts; a file
protoc would refuse may be read wrongly rather than refused (tests/docs/test_reference.py holds it to protoc's
own descriptors).  docs/tools/mkdocs_hooks.py renders the page at every site build.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from markdown.extensions.toc import slugify

SCALARS = {"double", "float", "int32", "int64", "uint32", "uint64", "sint32", "sint64", "fixed32", "fixed64",
           "sfixed32", "sfixed64", "bool", "string", "bytes"}
TOKEN = re.compile(r"(?P<comment>//[^\n]*|/\*.*?\*/)|(?P<string>\"(?:\\.|[^\"\\])*\"|'(?:\\.|[^'\\])*')"
                   r"|(?P<word>[A-Za-z_.][\w.]*)|(?P<number>-?\d[\w.+-]*)|(?P<symbol>[{}()\[\]<>;=,])|(?P<space>\s+)",
                   re.S)


class ProtoError(ValueError):
    """Text this reader cannot follow (the file, the line and what it expected)."""


@dataclass
class Field:
    name: str
    type: str    # as written: a scalar, a message or enum name, or "map<K, V>"
    number: int
    label: str = ""  # "", "repeated" or "optional"
    oneof: str = ""  # the oneof it belongs to
    comment: str = ""


@dataclass
class Enum:
    name: str  # dotted inside the package: Outer.Kind
    values: list[tuple[str, int, str]] = field(default_factory=list)  # (name, number, comment)
    comment: str = ""


@dataclass
class Message:
    name: str  # dotted inside the package: Outer.Inner
    fields: list[Field] = field(default_factory=list)
    comment: str = ""


@dataclass
class Rpc:
    name: str
    request: str
    response: str
    client_streaming: bool = False
    server_streaming: bool = False
    comment: str = ""


@dataclass
class Service:
    name: str
    rpcs: list[Rpc] = field(default_factory=list)
    comment: str = ""


@dataclass
class ProtoFile:
    path: str
    package: str = ""
    comment: str = ""  # the comment block at the top of the file, before `syntax`
    messages: list[Message] = field(default_factory=list)  # nested ones too, each after its parent
    enums: list[Enum] = field(default_factory=list)
    services: list[Service] = field(default_factory=list)

    def resolve(self, name: str, scope: str) -> str | None:
        """The message or enum a type name written inside `scope` (Outer.Inner) means, by proto's scoping (the
        innermost scope first), dotted inside the package; None when the file does not define it."""
        known = {m.name for m in self.messages} | {e.name for e in self.enums}
        name = name.removeprefix(".").removeprefix(self.package + ".") if self.package else name.lstrip(".")
        parts = scope.split(".") if scope else []
        for i in range(len(parts), -1, -1):
            candidate = ".".join(parts[:i] + [name])
            if candidate in known:
                return candidate
        return None


class Reader:
    """Tokens of one file, with each comment's text kept by line for the declarations that follow."""

    def __init__(self, text: str, path: str):
        self.path = path
        self.tokens: list[tuple[str, str, int]] = []  # (kind, text, line)
        self.comments: dict[int, str] = {}  # line -> text of the comment there
        self.code_lines: set[int] = set()   # lines that hold something other than a comment
        line, pos = 1, 0
        while pos < len(text):
            m = TOKEN.match(text, pos)
            if not m:
                raise ProtoError(f"{path}:{line}: cannot read {text[pos:pos + 20]!r}")
            kind, value = m.lastgroup, m.group()
            if kind == "comment":
                body = value[2:] if value.startswith("//") else value[2:-2]
                for n, part in enumerate(body.split("\n")):
                    self.comments[line + n] = part[1:] if part.startswith(" ") else part
            elif kind != "space":
                self.tokens.append((kind, value, line))
                self.code_lines.add(line)
            line += value.count("\n")
            pos = m.end()
        self.i = 0

    def peek(self) -> str:
        return self.tokens[self.i][1] if self.i < len(self.tokens) else ""

    def line(self) -> int:
        return self.tokens[min(self.i, len(self.tokens) - 1)][2] if self.tokens else 1

    def take(self, expected: str | None = None) -> str:
        if self.i >= len(self.tokens):
            raise ProtoError(f"{self.path}: the file ends where {expected or 'more'} was expected")
        value = self.tokens[self.i][1]
        if expected is not None and value != expected:
            raise ProtoError(f"{self.path}:{self.line()}: expected {expected!r}, found {value!r}")
        self.i += 1
        return value

    def skip_statement(self) -> None:
        """Past the next `;` (or a `{...}` block) at this depth: options, reserved ranges, imports."""
        depth = 0
        while True:
            value = self.take()
            depth += value in "{[(" and len(value) == 1
            depth -= value in "}])" and len(value) == 1
            if depth == 0 and value in (";", "}"):
                return

    def leading(self) -> str:
        """The block of comment lines directly above the next token (no blank line, no code between), when that
        token is the first on its line."""
        line = self.line()
        if self.i > 0 and self.tokens[self.i - 1][2] == line:
            return ""
        block, n = [], line - 1
        while n in self.comments and n not in self.code_lines:
            block.append(self.comments[n])
            n -= 1
        return "\n".join(reversed(block)).strip("\n")

    def trailing(self, line: int) -> str:
        """The comment after the code on `line`."""
        if line not in self.comments or line not in self.code_lines:
            return ""
        return self.comments[line].strip()


def parse(text: str, path: str = "<proto>") -> ProtoFile:
    r = Reader(text, path)
    out = ProtoFile(path)
    out.comment = r.leading()
    while r.i < len(r.tokens):
        word = r.peek()
        if word == "package":
            r.take()
            out.package = r.take()
            r.take(";")
        elif word == "message":
            message(r, out, "")
        elif word == "enum":
            enum(r, out, "")
        elif word == "service":
            service(r, out)
        elif word == ";":
            r.take()
        else:  # syntax, import, option
            r.skip_statement()
    return out


def message(r: Reader, out: ProtoFile, scope: str) -> None:
    comment = r.leading()
    r.take("message")
    name = f"{scope}.{r.take()}" if scope else r.take()
    msg = Message(name, comment=comment)
    out.messages.append(msg)
    r.take("{")
    block(r, out, msg, "")


def block(r: Reader, out: ProtoFile, msg: Message, oneof: str) -> None:
    """The body of a message (or of one of its oneofs) up to its closing brace."""
    while r.peek() != "}":
        word, comment = r.peek(), r.leading()
        if word == "message":
            message(r, out, msg.name)
        elif word == "enum":
            enum(r, out, msg.name)
        elif word == "oneof":
            r.take()
            group = r.take()
            r.take("{")
            block(r, out, msg, group)
        elif word in ("option", "reserved", "extensions"):
            r.skip_statement()
        elif word == ";":
            r.take()
        else:
            label = r.take() if word in ("repeated", "optional", "required") else ""
            if r.peek() == "map":
                r.take()
                r.take("<")
                key = r.take()
                r.take(",")
                value = r.take()
                r.take(">")
                kind = f"map<{key}, {value}>"
            else:
                kind = r.take()
            name = r.take()
            r.take("=")
            number = int(r.take(), 0)
            if r.peek() == "[":
                while r.take() != "]":
                    pass
            end = r.line()
            r.take(";")
            msg.fields.append(Field(name, kind, number, label, oneof,
                                    join(comment, r.trailing(end))))
    r.take("}")


def enum(r: Reader, out: ProtoFile, scope: str) -> None:
    comment = r.leading()
    r.take("enum")
    name = f"{scope}.{r.take()}" if scope else r.take()
    e = Enum(name, comment=comment)
    out.enums.append(e)
    r.take("{")
    while r.peek() != "}":
        if r.peek() in ("option", "reserved"):
            r.skip_statement()
            continue
        if r.peek() == ";":
            r.take()
            continue
        lead = r.leading()
        value = r.take()
        r.take("=")
        number = int(r.take(), 0)
        if r.peek() == "[":
            while r.take() != "]":
                pass
        end = r.line()
        r.take(";")
        e.values.append((value, number, join(lead, r.trailing(end))))
    r.take("}")


def service(r: Reader, out: ProtoFile) -> None:
    comment = r.leading()
    r.take("service")
    svc = Service(r.take(), comment=comment)
    out.services.append(svc)
    r.take("{")
    while r.peek() != "}":
        if r.peek() != "rpc":
            r.skip_statement()
            continue
        lead = r.leading()
        r.take("rpc")
        name = r.take()
        r.take("(")
        client_streaming = r.peek() == "stream" and bool(r.take())
        request = r.take()
        r.take(")")
        r.take("returns")
        r.take("(")
        server_streaming = r.peek() == "stream" and bool(r.take())
        response = r.take()
        r.take(")")
        end = r.line()
        if r.peek() == "{":
            r.skip_statement()
        else:
            r.take(";")
        svc.rpcs.append(Rpc(name, request, response, client_streaming, server_streaming,
                            join(lead, r.trailing(end))))
    r.take("}")


def join(leading: str, trailing: str) -> str:
    return "\n".join(part for part in (leading, trailing) if part)


def read(path: Path) -> ProtoFile:
    return parse(path.read_text(), str(path))


# --- the page -----------------------------------------------------------------------------------------------

def text(comment: str) -> str:
    """A comment as markdown: `<`, `>` and `&` escaped outside code spans; lines that start indented (a comment's
    own table or list) keep their line breaks, and one indented deeper than the line above continues it."""
    parts = comment.split("`")
    for i in range(0, len(parts), 2):
        parts[i] = parts[i].replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    out, indent = "", 0
    for n, line in enumerate("`".join(parts).split("\n")):
        depth = len(line) - len(line.lstrip())
        if n:  # an indented line starts a new line of the page, unless it is indented deeper than the one above
            out += "<br>" if depth and not depth > indent > 0 else " "
        indent = depth if depth and not depth > indent > 0 else indent
        out += " ".join(line.split())
    return out


def cell(comment: str) -> str:
    return text(comment).replace("|", "\\|") or "–"


class Page:
    """Markdown for one file, with every message and enum a heading of its own and type names linking to them."""

    def __init__(self, proto: ProtoFile, source: str):
        self.proto, self.source = proto, source
        self.slugs = {m.name: slugify(f"message {m.name}", "-") for m in proto.messages}
        self.slugs |= {e.name: slugify(f"enum {e.name}", "-") for e in proto.enums}

    def type(self, written: str, scope: str) -> str:
        if written.startswith("map<"):
            key, value = written[4:-1].split(", ")
            return f"map&lt;`{key}`, {self.type(value, scope)}&gt;"
        target = None if written in SCALARS else self.proto.resolve(written, scope)
        return f"[`{written}`](#{self.slugs[target]})" if target else f"`{written}`"

    def render(self) -> str:
        p = self.proto
        out = [f"# {p.package or p.path} reference", "",
               f"Every service, message and enum of `{self.source}`, with the comments the file gives them "
               f"(generated from the file at each site build).", ""]
        if p.comment:
            out += [text(p.comment), ""]
        for svc in p.services:
            out += [f"## service {svc.name}", ""] + ([text(svc.comment), ""] if svc.comment else [])
            out += ["| rpc | request | response | what it does |", "|---|---|---|---|"]
            for rpc in svc.rpcs:
                req = ("stream " if rpc.client_streaming else "") + self.type(rpc.request, "")
                resp = ("stream " if rpc.server_streaming else "") + self.type(rpc.response, "")
                out.append(f"| `{rpc.name}` | {req} | {resp} | {cell(rpc.comment)} |")
            out.append("")
        out += ["## Messages", ""]
        for m in p.messages:
            out += [f"### message {m.name}", ""] + ([text(m.comment), ""] if m.comment else [])
            if not m.fields:
                out += ["No fields.", ""]
                continue
            out += ["| field | number | type | description |", "|---|---|---|---|"]
            for f in m.fields:
                kind = (f"{f.label} " if f.label else "") + self.type(f.type, m.name)
                where = f"oneof `{f.oneof}`: " if f.oneof else ""
                out.append(f"| `{f.name}` | {f.number} | {kind} | {where}{cell(f.comment)} |")
            out.append("")
        out += ["## Enums", ""]
        for e in p.enums:
            out += [f"### enum {e.name}", ""] + ([text(e.comment), ""] if e.comment else [])
            out += ["| value | number | description |", "|---|---|---|"]
            out += [f"| `{name}` | {number} | {cell(comment)} |" for name, number, comment in e.values]
            out.append("")
        return "\n".join(out)


def page(path: Path, source: str) -> str:
    """The reference page of one .proto file; `source` is how the page names it (its path in the repository)."""
    return Page(read(path), source).render()
