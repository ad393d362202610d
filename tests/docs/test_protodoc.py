"""The posenc.v1 reference page against protoc: the reader's messages, fields, enums and rpcs equal the descriptor
protoc generated (protos/posenc/v1/posenc_pb2.py), their comments equal the ones protoc attaches (its source info),
and every one of them is on the rendered page with its type, and nothing else is.  A second file with what
posenc.proto does not use (nested messages and enums, map, client streams, options, reserved) is compiled by
protoc here and held to the same."""

import re
from pathlib import Path

import pytest
from google.protobuf import descriptor_pb2
from grpc_tools import protoc

from docs.tools import protodoc
from protos.posenc.v1 import posenc_pb2

ROOT = Path(__file__).resolve().parents[2]
POSENC = ROOT / "protos" / "posenc" / "v1" / "posenc.proto"
F = descriptor_pb2.FieldDescriptorProto
SCALAR = {getattr(F, f"TYPE_{s.upper()}"): s for s in protodoc.SCALARS}

EVERYTHING = """\
// A file with what the reader must follow.
syntax = "proto3";

package demo.x;

import "google/protobuf/timestamp.proto";

option java_package = "x.demo";

// Kinds at the top.
enum Kind {
  KIND_UNSET = 0;  // nothing
  // The other one.
  KIND_OTHER = 1 [deprecated = true];
  reserved 5;
}

/* A block comment. */
message Outer {
  // Inside Outer.
  message Inner {
    enum Level { LOW = 0; HIGH = 1; }
    Level level = 1;
    repeated Inner children = 2;  // recursive
  }
  reserved 9, 11 to 12;
  reserved "gone";
  Inner inner = 1;
  map<string, Inner> by_name = 2;  // keyed
  map<int32, Kind> kinds = 3;
  oneof choice {
    // A text.
    string text = 4;
    Outer.Inner.Level level = 5;
  }
  optional double scale = 6;
  repeated int32 counts = 7 [packed = true];
  google.protobuf.Timestamp at = 8;
  message Empty {}
}

message Flat { Outer.Inner inner = 1; int64 n = 2; }

// Every shape of call.
service Demo {
  option deprecated = false;
  rpc Unary(Flat) returns (Outer);  // one in, one out
  // Both ways.
  rpc Both(stream Flat) returns (stream Outer.Inner);
  rpc Up(stream Flat) returns (Flat) { option deprecated = true; }
}
"""


def compiled(path: Path, include: Path, out: Path) -> descriptor_pb2.FileDescriptorProto:
    """protoc's own descriptor of the file, with the comments it attaches (--include_source_info), written to out."""
    well_known = Path(protoc.__file__).parent / "_proto"
    args = ["protoc", f"-I{include}", f"-I{well_known}", "--include_source_info", f"--descriptor_set_out={out}",
            str(path.relative_to(include))]
    assert protoc.main(args) == 0, "protoc refused the file"
    return descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes()).file[0]


def type_of(f: F, package: str, maps: dict[str, str]) -> str:
    """A field's type as protoc knows it: a scalar, a message or enum dotted inside the package, or map<K, V>."""
    if f.type in SCALAR:
        return SCALAR[f.type]
    name = f.type_name.removeprefix(f".{package}.").lstrip(".")
    return maps.get(name, name)


def from_descriptor(fd: descriptor_pb2.FileDescriptorProto) -> dict:
    """Everything the page shows, read from a descriptor: {kind name: {item: (type or number, label, oneof)}}."""
    out, maps = {}, {}

    def walk(msgs, scope):
        for m in msgs:
            name = f"{scope}{m.name}"
            entries = [n for n in m.nested_type if n.options.map_entry]
            for n in entries:  # map<K, V> is a repeated nested NameEntry{key, value} to protoc
                k, v = n.field
                maps[f"{name}.{n.name}"] = f"map<{type_of(k, fd.package, maps)}, {type_of(v, fd.package, maps)}>"
            walk([n for n in m.nested_type if not n.options.map_entry], name + ".")
            for e in m.enum_type:
                out[f"enum {name}.{e.name}"] = {v.name: v.number for v in e.value}
            fields = {}
            for f in m.field:
                mapped = type_of(f, fd.package, maps).startswith("map<")
                label = ("repeated" if f.label == F.LABEL_REPEATED and not mapped
                         else "optional" if f.proto3_optional else "")
                oneof = m.oneof_decl[f.oneof_index].name if f.HasField("oneof_index") and not f.proto3_optional else ""
                fields[f.name] = (f.number, type_of(f, fd.package, maps), label, oneof)
            out[f"message {name}"] = fields

    walk(fd.message_type, "")
    for e in fd.enum_type:
        out[f"enum {e.name}"] = {v.name: v.number for v in e.value}
    for s in fd.service:
        out[f"service {s.name}"] = {m.name: (m.input_type.removeprefix(f".{fd.package}."), m.client_streaming,
                                             m.output_type.removeprefix(f".{fd.package}."), m.server_streaming)
                                    for m in s.method}
    return out


def from_reader(p: protodoc.ProtoFile) -> dict:
    out = {}
    for m in p.messages:
        out[f"message {m.name}"] = {f.name: (f.number, resolved(p, f.type, m.name), f.label, f.oneof)
                                    for f in m.fields}
    for e in p.enums:
        out[f"enum {e.name}"] = {name: number for name, number, _ in e.values}
    for s in p.services:
        out[f"service {s.name}"] = {r.name: (p.resolve(r.request, ""), r.client_streaming,
                                             p.resolve(r.response, ""), r.server_streaming) for r in s.rpcs}
    return out


def resolved(p: protodoc.ProtoFile, written: str, scope: str) -> str:
    if written.startswith("map<"):
        key, value = written[4:-1].split(", ")
        return f"map<{key}, {resolved(p, value, scope)}>"
    return written if written in protodoc.SCALARS else p.resolve(written, scope) or written


def comments_by_protoc(fd: descriptor_pb2.FileDescriptorProto) -> dict[str, str]:
    """Leading and trailing comments protoc attaches to each message, field, enum, value, service and rpc."""
    names: dict[tuple, str] = {}

    def walk(msgs, scope, path):
        for i, m in enumerate(msgs):
            name = f"{scope}{m.name}"
            names[(*path, i)] = f"message {name}"
            for j, f in enumerate(m.field):
                names[(*path, i, 2, j)] = f"message {name}.{f.name}"
            for j, e in enumerate(m.enum_type):
                enums((*path, i, 4, j), f"{name}.{e.name}", e)
            walk(m.nested_type, name + ".", (*path, i, 3))

    def enums(path, name, e):
        names[path] = f"enum {name}"
        for k, v in enumerate(e.value):
            names[(*path, 2, k)] = f"enum {name}.{v.name}"

    walk(fd.message_type, "", (4,))
    for i, e in enumerate(fd.enum_type):
        enums((5, i), e.name, e)
    for i, s in enumerate(fd.service):
        names[(6, i)] = f"service {s.name}"
        for j, m in enumerate(s.method):
            names[(6, i, 2, j)] = f"service {s.name}.{m.name}"
    out = {}
    for loc in fd.source_code_info.location:
        if tuple(loc.path) in names:
            parts = [c for c in (loc.leading_comments, loc.trailing_comments) if c]
            lines = [line[1:] if line.startswith(" ") else line for c in parts for line in c.rstrip("\n").split("\n")]
            out[names[tuple(loc.path)]] = "\n".join(line.rstrip() for line in lines).strip()
    return {k: v for k, v in out.items() if v}


def comments_by_reader(p: protodoc.ProtoFile) -> dict[str, str]:
    out = {}
    for m in p.messages:
        out[f"message {m.name}"] = m.comment
        out |= {f"message {m.name}.{f.name}": f.comment for f in m.fields}
    for e in p.enums:
        out[f"enum {e.name}"] = e.comment
        out |= {f"enum {e.name}.{name}": comment for name, _, comment in e.values}
    for s in p.services:
        out[f"service {s.name}"] = s.comment
        out |= {f"service {s.name}.{r.name}": r.comment for r in s.rpcs}
    return {k: "\n".join(line.rstrip() for line in v.split("\n")).strip() for k, v in out.items() if v}


def from_page(markdown: str) -> dict:
    """The page's headings and table rows read back: {heading: {first cell: the other cells}}."""
    out, current = {}, None
    for line in markdown.splitlines():
        heading = re.match(r"#{2,3} ((?:message|enum|service) \S+)$", line)
        if heading:
            current = out.setdefault(heading[1], {})
        elif current is not None and re.match(r"\| `\w+` \|", line):
            cells = [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]
            current[cells[0].strip("`")] = cells[1:]
    return out


def shown_type(cell: str, slugs: dict[str, str]) -> str:
    """A type cell as text, each link replaced by the full name of the message or enum its anchor is the heading of
    (so a link to the wrong heading reads as the wrong type)."""
    cell = re.sub(r"\[`[\w.]+`\]\(#([\w-]+)\)", lambda m: slugs.get(m[1], "?" + m[1]), cell)
    return cell.replace("`", "").replace("&lt;", "<").replace("&gt;", ">")


@pytest.fixture(scope="module")
def everything(tmp_path_factory) -> tuple[Path, descriptor_pb2.FileDescriptorProto]:
    folder = tmp_path_factory.mktemp("proto")
    path = folder / "demo" / "everything.proto"
    path.parent.mkdir()
    path.write_text(EVERYTHING)
    return path, compiled(path, folder, folder / "everything.pb")


def test_the_reader_finds_what_the_committed_descriptor_holds():
    fd = descriptor_pb2.FileDescriptorProto.FromString(posenc_pb2.DESCRIPTOR.serialized_pb)
    parsed = protodoc.read(POSENC)
    assert parsed.package == fd.package == "posenc.v1"
    want, got = from_descriptor(fd), from_reader(parsed)
    assert set(want) == set(got)
    assert want == got
    assert "message GenerateResponse" in got and got["service Posenc"]["Generate"][3] is True


def test_the_reader_follows_nested_messages_maps_oneofs_and_streams(everything):
    path, fd = everything
    parsed = protodoc.read(path)
    want, got = from_descriptor(fd), from_reader(parsed)
    assert want == got
    assert got["message Outer"]["by_name"][1] == "map<string, Outer.Inner>"
    assert got["message Outer"]["level"] == (5, "Outer.Inner.Level", "", "choice")
    assert got["message Outer"]["scale"][2] == "optional"
    assert got["service Demo"]["Both"] == ("Flat", True, "Outer.Inner", True)


@pytest.mark.parametrize("which", ["posenc", "everything"])
def test_comments_are_the_ones_protoc_attaches(which, everything, tmp_path):
    if which == "posenc":
        path, fd = POSENC, compiled(POSENC, ROOT, tmp_path / "posenc.pb")
    else:
        path, fd = everything
    want, got = comments_by_protoc(fd), comments_by_reader(protodoc.read(path))
    assert want == got
    assert len(want) >= (5 if which == "everything" else 30)


@pytest.mark.parametrize("which", ["posenc", "everything"])
def test_every_item_is_on_the_page_with_its_type_and_nothing_else(which, everything):
    if which == "posenc":
        path, fd = POSENC, descriptor_pb2.FileDescriptorProto.FromString(posenc_pb2.DESCRIPTOR.serialized_pb)
    else:
        path, fd = everything
    want, shown = from_descriptor(fd), from_page(protodoc.page(path, "x.proto"))
    slugs = {protodoc.slugify(h, "-"): h.split(" ", 1)[1] for h in want}  # a link's anchor -> what it names
    assert set(shown) == set(want)
    for heading, items in want.items():
        assert set(shown[heading]) == set(items), heading
        for name, expected in items.items():
            cells = shown[heading][name]
            if heading.startswith("message"):
                number, kind, label, oneof = expected
                assert cells[0] == str(number), (heading, name, cells)
                assert shown_type(cells[1], slugs) == f"{label} {kind}".strip(), (heading, name, cells)
                assert not oneof or cells[2].startswith(f"oneof `{oneof}`:"), (heading, name, cells)
            elif heading.startswith("enum"):
                assert cells[0] == str(expected)
            else:
                request, client_streams, response, server_streams = expected
                assert shown_type(cells[0], slugs) == ("stream " if client_streams else "") + request, cells
                assert shown_type(cells[1], slugs) == ("stream " if server_streams else "") + response, cells


def test_a_file_the_reader_cannot_follow_is_one_line():
    with pytest.raises(protodoc.ProtoError, match=r"x.proto:2: expected '='"):
        protodoc.parse('syntax = "proto3";\nmessage A { int32 a 1; }\n', "x.proto")
    with pytest.raises(protodoc.ProtoError, match="ends where"):
        protodoc.parse("message A { int32 a = 1;", "x.proto")
