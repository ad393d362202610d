"""python -m export quantize: an int8 copy held to a budget against the fp32 artifact, refused when it misses,
served like any artifact."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from export import artifact
from export.budget import check_budget
from export.fuse import main as fuse
from protos.posenc.v1 import posenc_pb2 as pb
from protos.posenc.v1 import posenc_pb2_grpc
from tests.hf.test_profile import profile_of
from tests.serving import start

ROOT = Path(__file__).resolve().parents[2]
LOOSE = ["--min-top1", "0.5", "--max-nats-ratio", "1.2"]  # random tiny weights have near ties everywhere


def quantize(*args):
    return subprocess.run([sys.executable, "-m", "export", "quantize", *map(str, args)], capture_output=True,
                          text=True, cwd=ROOT, timeout=300)


def test_a_copy_that_misses_the_budget_is_refused_and_nothing_is_written(tiny_artifacts, tmp_path):
    root, _ = tiny_artifacts
    out = tmp_path / "rope-int8"
    res = quantize(root / "rope", "--out", out, "--min-top1", "0.9999")
    assert res.returncode == 2 and "misses its budget" in res.stderr and "top-1 agreement" in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1 and not out.exists()
    assert not list(tmp_path.iterdir())  # no staging folder left behind


@pytest.mark.parametrize("variant", ["rope", "learned", "cpe"])
def test_int8_copy_records_its_budget_and_is_served(tiny_artifacts, tmp_path, variant):
    root, _ = tiny_artifacts
    models = tmp_path / "models"
    out = models / f"{variant}-int8"
    res = quantize(root / variant, "--out", out, *LOOSE)
    assert res.returncode == 0, res.stderr
    artifact.verify(out)
    meta = json.loads((out / "model.json").read_text())
    fp32 = json.loads((root / variant / "manifest.json").read_text())["files"]["model.onnx"]["sha256"]
    q = meta["quantization"]
    assert q["method"] == "dynamic" and q["source_sha256"] == fp32 and q["budget"]["passed"]
    ctx = meta["trained_context"]
    want = [ctx] if meta["max_positions"] else [ctx, 4 * ctx]  # learned: its table ends at the context
    assert [r["length"] for r in q["budget"]["rows"]] == want
    ops = {n.op_type for n in onnx.load(str(out / "model.onnx")).graph.node}
    assert {"DynamicQuantizeLinear", "MatMulInteger"} <= ops, ops
    # served like any artifact, and the served answer is the int8 graph's own
    sess = ort.InferenceSession(str(out / "model.onnx"), providers=["CPUExecutionProvider"])
    ids = np.array([list(b"dog bites")], np.int64)
    feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids)}
    for spec in meta["inputs"][2:]:
        feeds[spec["name"]] = np.zeros([1 if d == "batch_size" else 0 if isinstance(d, str) else d
                                        for d in spec["shape"]], np.float32)
    want_top = int(sess.run(["logits"], feeds)[0][0, -1].argmax())
    srv = start(models)
    try:
        import grpc

        with grpc.insecure_channel(f"127.0.0.1:{srv.port}") as ch:
            stub = posenc_pb2_grpc.PosencStub(ch)
            resp = stub.Predict(pb.PredictRequest(model=out.name, prompt=pb.Prompt(text="dog bites")), timeout=30)
            assert resp.top[0].token.id == want_top
            # its profile graph is the quantized model's: the served profile is the one the copy's own maps give
            prompt = pb.Prompt(text="dog bites man")  # within the learned table's 16 positions
            full = stub.Predict(pb.PredictRequest(model=out.name, prompt=prompt, attention=pb.ATTENTION_FULL),
                                timeout=30)
            got = stub.Profile(pb.ProfileRequest(model=out.name, prompt=prompt), timeout=30)
        layers = meta["sizes"]["n_layers"]
        maps = [np.stack([np.frombuffer(m.data, "<f4").reshape(m.shape) for m in full.attention if m.layer == i])
                for i in range(layers)]
        want, _ = profile_of(maps, slice(0, None), False)
        np.testing.assert_allclose(np.frombuffer(got.values, "<f4").reshape(got.shape), want, rtol=0, atol=1e-5)
        files = json.loads((out / "manifest.json").read_text())["files"]
        assert meta["profile"]["source_sha256"] == files["model.onnx"]["sha256"] != fp32
    finally:
        srv.stop(grace=1)


def test_quantizing_twice_or_a_damaged_artifact_is_refused(tiny_artifacts, tmp_path):
    root, _ = tiny_artifacts
    once = tmp_path / "once"
    assert quantize(root / "alibi", "--out", once, *LOOSE).returncode == 0
    res = quantize(once, "--out", tmp_path / "twice", *LOOSE)
    assert res.returncode == 2 and "already quantized" in res.stderr
    damaged = tmp_path / "damaged"
    shutil.copytree(root / "alibi", damaged)
    with open(damaged / "model.onnx", "r+b") as f:
        f.seek(100)
        f.write(b"\x00\x01")
    res = quantize(damaged, "--out", tmp_path / "x", *LOOSE)
    assert res.returncode == 2 and "sha256" in res.stderr and not (tmp_path / "x").exists()


@pytest.mark.parametrize("method,bits", [("int4", 4), ("int8", 8)])
def test_block_wise_copy_uses_matmulnbits_and_tracks_fp32(tiny_artifacts, tmp_path, method, bits):
    """int4 / int8 weight-only copies: every projection is onnxruntime's MatMulNBits with the asked-for bits and
    blocks of 32, no fp32 MatMul on a constant weight is left, and the copy's logits stay close to fp32's (its
    error grows as the bits shrink, as quantizing should: a copy that ignored --method would not)."""
    root, _ = tiny_artifacts
    src = tmp_path / "rope"
    shutil.copytree(root / "rope", src)
    # a source with an fp32 fast graph beside its exact one, by the fuse command's entry point in this process (the
    # quantize command under test runs as a process)
    assert fuse([str(src)]) == 0
    assert (src / "fast.onnx").is_file()
    out = tmp_path / f"rope-{method}"
    res = quantize(src, "--out", out, "--method", method, *LOOSE)
    assert res.returncode == 0, res.stderr
    artifact.verify(out)
    # the fp32 fast graph is not carried into the copy (it would serve fp32 weights): the copy's own is quantized
    fast_ops = {n.op_type for n in onnx.load(str(out / "fast.onnx")).graph.node}
    assert "MatMulNBits" in fast_ops and json.loads((out / "model.json").read_text())["fast"]["source_sha256"] == \
        artifact.verify(out)["files"]["model.onnx"]["sha256"]
    q = json.loads((out / "model.json").read_text())["quantization"]
    assert q["method"] == method and q["ops"] == ["MatMulNBits"] and q["budget"]["passed"]
    graph = onnx.load(str(out / "model.onnx")).graph
    consts = {i.name for i in graph.initializer}
    nbits = [n for n in graph.node if n.op_type == "MatMulNBits"]
    assert nbits and all({a.name: a.i for a in n.attribute}["bits"] == bits for n in nbits)
    assert all({a.name: a.i for a in n.attribute}["block_size"] == 32 for n in nbits)
    assert not [n for n in graph.node if n.op_type == "MatMul" and n.input[1] in consts]
    meta = json.loads((out / "model.json").read_text())
    ref = ort.InferenceSession(str(root / "rope" / "model.onnx"), providers=["CPUExecutionProvider"])
    got = ort.InferenceSession(str(out / "model.onnx"), providers=["CPUExecutionProvider"])
    a, b = [], []
    for text in (b"the dog bites the man", b"The quick brown fox jumps over", b"0123456789 abcdefghij"):
        ids = np.array([list(text)], np.int64)
        feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids)}
        for spec in meta["inputs"][2:]:
            feeds[spec["name"]] = np.zeros([1 if d == "batch_size" else 0 if isinstance(d, str) else d
                                            for d in spec["shape"]], np.float32)
        a.append(ref.run(["logits"], feeds)[0].ravel())
        b.append(got.run(["logits"], feeds)[0].ravel())
    a, b = np.concatenate(a), np.concatenate(b)
    # the relative error of all the logits, in quantization steps: a b-bit symmetric block rounds each weight to
    # 1 / (2^(b-1) - 1) of its block's largest (int4 1/7, int8 1/127); through two layers' projections the logits
    # move by a few steps (int8 3.6, int4 1.7-2.6 on these prompts), never by less than half of one, so a copy that
    # ignored --method (int8 for int4, or the reverse) lands outside
    step = 1 / (2 ** (bits - 1) - 1)
    err = float(np.linalg.norm(a - b) / np.linalg.norm(a))
    assert 0.5 * step <= err <= 6 * step, (err, step)


def test_int4_budget_is_checked_and_a_miss_names_the_method(tiny_artifacts, tmp_path):
    root, _ = tiny_artifacts
    out = tmp_path / "rope-int4"
    res = quantize(root / "rope", "--out", out, "--method", "int4", "--max-nats-ratio", "1.0000001")
    assert res.returncode == 2 and "int4 copy of rope misses its budget" in res.stderr, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1 and not out.exists()
    assert not list(tmp_path.iterdir())


def test_budget_windows_are_capped_for_long_contexts(tiny_artifacts):
    """A model with a long context (an imported one's 2048 tokens) is scored on windows of at most max_length
    tokens, not on a 4x-context forward; the same graph against itself agrees everywhere."""
    root, _ = tiny_artifacts
    meta = json.loads((root / "rope" / "model.json").read_text())
    assert meta["trained_context"] > 8
    onnx_path = root / "rope" / "model.onnx"
    report = check_budget(onnx_path, onnx_path, meta, root / "rope", max_length=8)
    assert [r["length"] for r in report["rows"]] == [8] and report["passed"]
    assert report["rows"][0]["top1_agreement"] == 1.0 and report["rows"][0]["nats_ratio"] == 1.0
