"""bench.gpu_pack and bench.gpu_carry, the two halves of the GPU run's travel: an artifact rebuilt from its pack is
the exported artifact bit for bit, and the CUDA library's pruning keeps one architecture's kernels whole."""

import hashlib
import json
import struct

import numpy as np
import pytest

from bench import gpu_pack
from bench.gpu_carry import FATBIN_MAGIC, keep_arch

pytestmark = pytest.mark.xdist_group("gpu-pack")  # one worker imports the redrawn LLaMA once (make test)


def sha256(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    """A tiny LLaMA redrawn from a seed (every tensor of 256 elements or more), imported with external data, and
    packed."""
    from export.hf import import_artifact
    from tests.hf.helpers import save_family

    root = tmp_path_factory.mktemp("gpu-pack")
    save_family("llama", root / "hf")
    recipe = gpu_pack.redraw(root / "hf", root / "redrawn", seed=7, big=256)
    art = root / "art" / "tiny"
    import_artifact(root / "redrawn", art, validation_max_length=4, external_data=True)
    desc = gpu_pack.pack(art, root / "redrawn", root / "pack")
    return root, art, recipe, desc


def test_unpack_rebuilds_every_file_of_the_artifact(packed, tmp_path):
    root, art, recipe, desc = packed
    data = desc["files"]["model.onnx.data"]
    assert recipe and data["regions"], "nothing was drawn from the seed"
    assert any(len(r["parts"]) > 1 for r in data["regions"]), "the fused QKV weight is several tensors in a row"
    assert desc["drawn_bytes"] > 0.8 * data["size"]
    assert not list((root / "pack").rglob("*.onnx.data")), "a weight file travelled whole"
    folder = gpu_pack.unpack(root / "pack", tmp_path / "models")
    manifest = json.loads((art / "manifest.json").read_text())
    for name, entry in manifest["files"].items():
        assert sha256(folder / name) == entry["sha256"], name
    from service.artifacts import load_artifact

    load_artifact(folder, threads=1)  # the worker's own checks: manifest hashes, model.json, the graph


def test_another_seed_is_refused_not_served(packed, tmp_path):
    root = packed[0]
    desc = json.loads((root / "pack" / "pack.json").read_text())
    desc["seed"] += 1
    (root / "pack-bad").mkdir()
    for f in (root / "pack").iterdir():
        if f.is_file() and f.name != "pack.json":
            (root / "pack-bad" / f.name).write_bytes(f.read_bytes())
    (root / "pack-bad" / "artifact").symlink_to(root / "pack" / "artifact")
    (root / "pack-bad" / "pack.json").write_text(json.dumps(desc))
    with pytest.raises(RuntimeError, match="sha256"):
        gpu_pack.unpack(root / "pack-bad", tmp_path / "models")
    assert not (tmp_path / "models" / desc["name"]).exists()


def test_pieces_finds_transposed_concatenations():
    rng = np.random.default_rng(0)
    a, b, c = (rng.standard_normal((n, 5), dtype=np.float32) for n in (4, 2, 3))
    tensors = {"a": a, "b": b, "c": c}
    first = {}
    for k, t in tensors.items():
        first.setdefault((t[0].tobytes(), t.shape[1]), []).append(k)
    assert gpu_pack._pieces(np.concatenate([a, b, c]).T.copy(), tensors, first) == (["a", "b", "c"], True)
    assert gpu_pack._pieces(np.concatenate([c, a]), tensors, first) == (["c", "a"], False)
    assert gpu_pack._pieces(np.concatenate([a, b[:1]]), tensors, first) is None


def fatbin(entries):
    """A fatbin as CUDA's fatbinary.h lays it out: a 16-byte header, then entries of a 64-byte header (kind, version,
    header size, payload size, ..., the architecture at byte 28) and the payload."""
    body = b""
    for sm, payload in entries:
        head = struct.pack("<HHIQ", 2, 0x101, 64, len(payload)) + bytes(12) + struct.pack("<I", sm)
        body += head + bytes(64 - len(head)) + payload
    return struct.pack("<IHHQ", FATBIN_MAGIC, 1, 16, len(body)) + body


def test_keep_arch_zeroes_other_architectures_only():
    k80, k90 = b"\x11" * 40, b"\x22" * 24
    blob = bytearray(b"\x00" * 8 + fatbin([(80, k80), (90, k90)]) + fatbin([(90, k90), (120, b"\x33" * 16)]))
    before = bytes(blob)
    seen = keep_arch(blob, 0, len(blob), 90)
    assert seen == {("cubin", 80): 40, ("cubin", 90): 48, ("cubin", 120): 16}
    assert len(blob) == len(before)
    assert blob.count(k90) == 2 and k80 not in blob and b"\x33" not in blob
    assert blob.count(struct.pack("<I", FATBIN_MAGIC)) == 2  # every header kept
