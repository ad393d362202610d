"""KServe's `sink_mass` output for a model with learned attention sinks (the imported gpt_oss), through the standard
client, tritonclient, over gRPC and REST, on a left-padded batch: per layer, head and query row it is the mass
posenc.v1 Predict reports beside each map (AttentionMap.sink_mass) and the sink column transformers' eager attention
computes and drops, the mass the attentions output's rows leave, and 0 for a padded query row.  A model without
sinks does not list the output and refuses a request naming it.  Asked for alone on a batch whose maps are far over
the message limit, it is answered without the worker holding them (its resident memory measured); an artifact
without a profile graph reads it from the maps and is refused where they would not fit."""

from __future__ import annotations

import json
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer

from protos.posenc.v1 import posenc_pb2 as pb
from service.registry import Limits
from tests.hf.test_gpt_oss_sinks import TEXT, served, transformers_sinks  # noqa: F401  (served: the fixture)
from tests.service.test_reliability import rewrite, worker_process
from tests.serving import start

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
            # summed in float32 in the profile graph, in float64 from Predict's maps
            np.testing.assert_allclose(mass[b, m.layer, m.head, real], m.sink_mass, rtol=0, atol=1e-6)
        _, sinks = transformers_sinks(entry["hf"], ids[b, real].tolist(), monkeypatch)
        for layer in range(L):
            np.testing.assert_allclose(mass[b, layer][:, real], sinks[layer], rtol=0, atol=3e-5)
    assert mass.max() > 0.5 and mass[..., mask[1] == 1].min() < 0.05  # the tiny model's sinks take much and little


ROWS, LONG = 16, 1024


def memory(pid: int) -> dict[str, int]:
    """The process's resident set now and at its peak (since the last reset), in bytes."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    return {name: int(fields[name].split()[0]) * 1024 for name in ("VmRSS", "VmHWM")}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_sink_mass_alone_holds_no_attention_maps(hf_zoo, tmp_path, monkeypatch):
    """16 rows of 1,024 tokens over REST (tritonclient) to a real worker process: their maps, every layer and head,
    are 512 MiB, over the message limit, so `attentions` is refused (413); `sink_mass` alone is answered, and the
    worker's peak resident memory while it answers grows by less than an eighth of those maps (the mass is reduced
    in the profile graph, a piece of rows and a layer at a time; holding the maps, it grew by 1.2 GB).  A padded
    row's padding holds 0, and the first row's values equal transformers' sink column."""
    entry = hf_zoo["gpt_oss"]
    cfg = entry["hf"].config
    L, H = cfg.num_hidden_layers, cfg.num_attention_heads
    models = tmp_path / "models"
    shutil.copytree(entry["artifact"], models / "gpt_oss")
    ids = np.random.default_rng(7).integers(3, 300, (ROWS, LONG))
    mask = np.ones_like(ids)
    mask[1, :100] = 0
    maps = 4 * ROWS * L * H * LONG * LONG
    port = free_port()
    with open(tmp_path / "worker.log", "w+") as log:
        proc, _ = worker_process(models, log, "--long-context", "1", "--http-port", str(port))
        try:
            summary, _ = client("long", port, ids[:2, :40], mask[:2, -40:], tmp_path)  # warm: graphs loaded
            assert summary["attentions"][0] == "OK"
            Path(f"/proc/{proc.pid}/clear_refs").write_text("5")  # the peak starts again from now
            before = memory(proc.pid)
            summary, arrays = client("long", port, ids, mask, tmp_path)
            after = memory(proc.pid)
        finally:
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=60) == 0
    assert summary["attentions"][0] == "413" and "bytes" in summary["attentions"][1]
    assert summary["sink_mass"] == ["OK", ""]
    mass = arrays["sink_mass"]
    assert mass.shape == (ROWS, L, H, LONG) and mass.dtype == np.float32
    grown = after["VmHWM"] - before["VmRSS"]
    assert grown < maps / 8, (grown, maps)
    assert not mass[1][..., :100].any() and mass[1][..., 100:].min() > 0
    _, sinks = transformers_sinks(entry["hf"], ids[0].tolist(), monkeypatch)
    for layer in range(L):
        np.testing.assert_allclose(mass[0, layer], sinks[layer], rtol=0, atol=3e-5)


def test_without_a_profile_graph_sink_mass_counts_the_maps_it_is_read_from(served, hf_zoo, tmp_path,  # noqa: F811
                                                                            monkeypatch):
    """An artifact exported before profile graphs reads `sink_mass` from the attention maps: a prompt whose maps fit
    in the message limit (1 MiB here) gets the values the profile graph gives and transformers' sink column; one
    whose maps do not (1.28 MB for 200 tokens, its sink_mass 6.4 KB) is refused (413) like `attentions`."""
    srv, _ = served
    entry = hf_zoo["gpt_oss"]
    models = tmp_path / "models"
    folder = shutil.copytree(entry["artifact"], models / "gpt_oss")
    (folder / "profile.onnx").unlink()
    rewrite(folder, lambda meta: meta.pop("profile"))
    old = start(models, http_port=0, limits=Limits(max_message_bytes=1 << 20))
    try:
        assert old.registry.models["gpt_oss"].profile is None
        ids = np.random.default_rng(3).integers(3, 300, (1, 200))
        short = ids[:, :40], np.ones((1, 40), np.int64)
        (summary, arrays), (graph, want) = client("long", old.http_port, *short, tmp_path), \
            client("long", srv.http_port, *short, tmp_path)
        refused, _ = client("long", old.http_port, ids, np.ones_like(ids), tmp_path)
    finally:
        old.stop(grace=1)
    assert summary == graph == {"attentions": ["OK", ""], "sink_mass": ["OK", ""]}
    np.testing.assert_allclose(arrays["sink_mass"], want["sink_mass"], rtol=0, atol=1e-6)
    _, sinks = transformers_sinks(entry["hf"], ids[0, :40].tolist(), monkeypatch)
    for layer, column in enumerate(sinks):
        np.testing.assert_allclose(arrays["sink_mass"][0, layer], column, rtol=0, atol=3e-5)
    assert refused["attentions"][0] == refused["sink_mass"][0] == "413"
    assert "attention maps its sink_mass is read from" in refused["sink_mass"][1]
