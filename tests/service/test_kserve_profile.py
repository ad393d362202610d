"""KServe's `profile` output (asked for by name) through the standard client, tritonclient, over gRPC and REST,
equal to the posenc.v1 Profile answer of each unpadded prompt on the same worker: every row and the last N, the
columns the model config and the output name, and the refusals of a bad row count."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from protos.posenc.v1 import posenc_pb2 as pb
from tests.http.tritonclient_profile import IDS, MASK

ROOT = Path(__file__).resolve().parents[2]
MODEL = "rope"


def client(kind: str, port: int, out: Path) -> tuple[dict, dict]:
    res = subprocess.run([sys.executable, str(ROOT / "tests" / "http" / "tritonclient_profile.py"), kind,
                          f"127.0.0.1:{port}", MODEL, str(out)], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout.strip().splitlines()[-1]), dict(np.load(out))


def posenc_profiles(stub, root: Path, last: int) -> np.ndarray:
    """posenc.v1 Profile of each unpadded row, widened to every distance bucket model.json's profile graph names (a
    bucket the prompt cannot reach holds no mass): (batch, layers, heads, columns)."""
    spec = json.loads((root / MODEL / "model.json").read_text())["profile"]
    rows = []
    for ids, mask in zip(IDS, MASK, strict=True):
        resp = stub.Profile(pb.ProfileRequest(model=MODEL, prompt=pb.Prompt(tokens=pb.TokenIds(
            ids=[int(i) for i in ids[mask == 1]])), last=last), timeout=60)
        v = np.frombuffer(resp.values, "<f4").reshape(resp.shape)
        assert list(resp.columns) == spec["columns"][:resp.buckets] + spec["columns"][spec["buckets"]:]
        wide = np.zeros(v.shape[:2] + (len(spec["columns"]),), np.float32)
        wide[..., :resp.buckets] = v[..., :resp.buckets]
        wide[..., spec["buckets"]:] = v[..., resp.buckets:]
        rows.append(wide)
    return np.stack(rows)


@pytest.mark.parametrize("kind", ["grpc", "http"])
def test_tritonclient_profile_equals_posenc_profile(rope_alone, kind, tmp_path):
    srv, stub, root = rope_alone
    summary, arrays = client(kind, srv.port if kind == "grpc" else srv.http_port, tmp_path / "out.npz")
    columns = json.loads((root / MODEL / "model.json").read_text())["profile"]["columns"]
    assert summary["config_columns"].split(",") == columns and summary["columns"].split(",") == columns
    meta = {t["name"]: [int(d) for d in t["shape"]] for t in summary["metadata"]}
    assert meta["profile"] == [-1, 2, 4, len(columns)]
    for last in (0, 3):
        got = arrays[f"last{last}"]
        assert got.shape == (2, 2, 4, len(columns)) and got.dtype == np.float32
        np.testing.assert_allclose(got, posenc_profiles(stub, root, last), rtol=0, atol=1e-6)
    # each row's distance buckets and sink-free columns are a distribution and an entropy: not all zeros
    assert np.allclose(arrays["last0"][..., :columns.index("first")].sum(-1), 1, atol=1e-5)
    assert summary["default_outputs"] == ["attentions", "logits"]  # the profile comes only when named
    if kind == "grpc":
        assert summary["logits_is_none"] and summary["config_outputs"]["profile"] == ["-1", "2", "4",
                                                                                     str(len(columns))]
        np.testing.assert_array_equal(arrays["both_profile"], arrays["last0"])
        assert arrays["both_logits"].shape == (2, 9, 256)
    assert "StatusCode.INVALID_ARGUMENT" in summary["too_many"][0] or summary["too_many"][0] == "400"
    assert "last must be in [0, 6] for a 6-token prompt" in summary["too_many"][1]
    assert summary["negative"][0] in ("StatusCode.INVALID_ARGUMENT", "400") and "profile_last" in summary[
        "negative"][1]
