"""KServe's `sink_mass` output for a model with learned attention sinks (the imported gpt_oss), through the standard
client, tritonclient, over gRPC and REST, on a left-padded batch: per layer, head and query row it is the mass
posenc.v1 Predict reports beside each map (AttentionMap.sink_mass) and the sink column transformers' eager attention
computes and drops, the mass the attentions output's rows leave, and 0 for a padded query row.  A model without
sinks does not list the output and refuses a request naming it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer

from protos.posenc.v1 import posenc_pb2 as pb
from tests.hf.test_gpt_oss_sinks import TEXT, served, transformers_sinks  # noqa: F401  (served: the fixture)

ROOT = Path(__file__).resolve().parents[2]
SHORT = "x[-7:]"


def batch(folder: Path) -> tuple[np.ndarray, np.ndarray]:
    """TEXT and SHORT's token ids, SHORT left-padded to TEXT's length (pad id 0, mask 0)."""
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    long, short = tok.encode(TEXT).ids, tok.encode(SHORT).ids
    assert len(short) < len(long)
    pad = len(long) - len(short)
    ids = np.array([long, [0] * pad + short], np.int64)
    mask = np.array([[1] * len(long), [0] * pad + [1] * len(short)], np.int64)
    return ids, mask


def client(kind: str, port: int, ids: np.ndarray, mask: np.ndarray, tmp: Path) -> tuple[dict, dict]:
    np.savez(tmp / "in.npz", ids=ids, mask=mask)
    res = subprocess.run([sys.executable, str(ROOT / "tests" / "hf" / "tritonclient_sinks.py"), kind,
                          f"127.0.0.1:{port}", str(tmp / "in.npz"), str(tmp / "out.npz")],
                         capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout.strip().splitlines()[-1]), dict(np.load(tmp / "out.npz"))


@pytest.mark.parametrize("kind", ["grpc", "http"])
def test_tritonclient_sink_mass_equals_predict_and_transformers(served, hf_zoo, kind, tmp_path,  # noqa: F811
                                                                monkeypatch):
    srv, stub = served
    entry = hf_zoo["gpt_oss"]
    cfg = entry["hf"].config
    L, H = cfg.num_hidden_layers, cfg.num_attention_heads
    ids, mask = batch(entry["folder"])
    summary, arrays = client(kind, srv.port if kind == "grpc" else srv.http_port, ids, mask, tmp_path)

    assert summary["metadata"]["gpt_oss"]["sink_mass"] == [-1, L, H, -1]
    assert "sink_mass" in summary["config"]["gpt_oss"]
    assert "sink_mass" not in summary["metadata"]["ministral"] and "sink_mass" not in summary["config"]["ministral"]
    assert summary["default_outputs"] == ["attentions", "logits"]  # sink_mass comes only when named
    assert summary["alone_outputs"] == ["sink_mass"]
    assert summary["refused"][0] in ("StatusCode.INVALID_ARGUMENT", "400") and "sink_mass" in summary["refused"][1]

    mass, att = arrays["sink_mass"], arrays["attentions"]
    B, T = ids.shape
    assert mass.shape == (B, L, H, T) and mass.dtype == np.float32
    np.testing.assert_array_equal(arrays["alone"], mass)
    for b in range(B):
        real = np.flatnonzero(mask[b])
        assert not mass[b][..., mask[b] == 0].any()  # a padded query row: no sink mass
        # the rows the maps leave: 1 - each real query row's sum over the keys
        np.testing.assert_allclose(mass[b][..., real], 1 - att[b][..., real, :].astype(np.float64).sum(-1),
                                   rtol=0, atol=1e-6)
        want = stub.Predict(pb.PredictRequest(model="gpt_oss", prompt=pb.Prompt(tokens=pb.TokenIds(
            ids=ids[b, real].tolist())), attention=pb.ATTENTION_FULL), timeout=60)
        assert len(want.attention) == L * H
        for m in want.attention:
            np.testing.assert_allclose(mass[b, m.layer, m.head, real], m.sink_mass, rtol=0, atol=1e-7)
        _, sinks = transformers_sinks(entry["hf"], ids[b, real].tolist(), monkeypatch)
        for layer in range(L):
            np.testing.assert_allclose(mass[b, layer][:, real], sinks[layer], rtol=0, atol=3e-5)
    assert mass.max() > 0.5 and mass[..., mask[1] == 1].min() < 0.05  # the tiny model's sinks take much and little
