"""The committed stubs are exactly what the generator produces from the committed .proto sources."""

from pathlib import Path

from protos import generate


def test_regenerating_changes_nothing(tmp_path):
    fresh = generate.generate(tmp_path)
    assert fresh, "the generator produced no stubs"
    for path in fresh:
        committed = generate.ROOT / path.relative_to(tmp_path)
        assert committed.is_file(), f"{committed} is not committed"
        assert committed.read_text() == path.read_text(), f"{committed} is stale: run python -m protos.generate"
    committed_all = {p.relative_to(generate.ROOT) for p in (generate.ROOT / "protos").rglob("*_pb2*.py")}
    assert committed_all == {p.relative_to(tmp_path) for p in fresh}


def test_stubs_import():
    from protos.posenc.v1 import posenc_pb2, posenc_pb2_grpc

    assert posenc_pb2.DESCRIPTOR.package == "posenc.v1"
    assert hasattr(posenc_pb2_grpc, "PosencServicer")
    assert Path(posenc_pb2.__file__).parent.name == "v1"
