"""Export + validation of every variant, graph checks that can fail, artifact integrity, CLI errors."""

import io
import json
import re
import subprocess
import sys
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

from export import artifact
from export.errors import ArtifactError, ExportError
from export.graphcheck import check_graph
from export.triton import write_repository
from export.validate import lengths_for, session_for, validate_folder
from model.config import preset
from model.variants import REGISTRY
from model.variants.rope import Rope, apply_rope
from tests.model.helpers import tiny_model

ROOT = Path(__file__).resolve().parents[2]
VARIANTS = list(REGISTRY)


def cli(*args):
    return subprocess.run([sys.executable, "-m", "export", *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=600)


def run(*args):
    """`python -m export ARGS` in this process: the CLI's own main() with argv as a shell passes it, its exit status,
    stdout and stderr as `cli` returns them, without a new interpreter importing torch and onnx again (the tests
    named ..._cli run the real process)."""
    from export.__main__ import main

    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        try:
            code = main([str(a) for a in args])
        except SystemExit as exit_:  # argparse's own errors
            code = exit_.code
    return subprocess.CompletedProcess(["python", "-m", "export", *args], code, out.getvalue(), err.getvalue())


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_variant_exports_and_validates(tiny_artifacts, variant):
    root, reports = tiny_artifacts
    report = reports[variant]
    assert report.passed, report.format_table()
    cases = {c.case for c in report.checks}
    cfg = preset("tiny", variant)
    for n in lengths_for(cfg):
        assert f"B=1 T={n} past=0" in cases and f"B=3 T={n} past=0" in cases
    if variant != "learned":
        assert f"B=3 T={4 * cfg.context} past=0" in cases  # 4x the trained context
    assert any(c.startswith("left-padded") for c in cases)
    assert any(c.startswith("decode step 3") for c in cases)
    assert any(c.startswith("greedy") for c in cases)
    # the worker's batches: rows padded in the middle as it assembles them, alone and together, and decoding at
    # twice the context (where the variant's positions reach it), every check run (none "not run")
    assert sum("vs alone" in c.case for c in report.checks) == 6
    not_run = [c.case for c in report.checks if c.output == "not run"]
    if variant == "learned":  # its table ends at the context: the one check past it is said not run
        assert not_run == [f"decode at past={2 * cfg.context} (2x context)"]
    else:
        assert sum("2x context" in c.case for c in report.checks) == 2 * 3 and not not_run
    files = sorted(p.name for p in (root / variant).iterdir())
    # one model graph, its profile graph and its intervention graphs, no external .data; every variant with a
    # positional hook also gets its encoding graph
    assert files == sorted(["manifest.json", "model.json", "model.onnx", "profile.onnx", "intervene.onnx",
                            "intervene_profile.onnx"] + ([] if variant == "none" else ["encoding.onnx"]))
    assert any(c.case.startswith("encoding length") for c in report.checks) == (variant != "none")
    # Ordinary permissions (umask 022: 755 / 644), not mkdtemp's 0700 / mkstemp's 0600: a worker running as another
    # user (the container's uid 10001) must be able to read what the exporter wrote.
    from model.files import umask_mode

    assert (root / variant).stat().st_mode & 0o777 == umask_mode(0o777) != 0o700
    assert {(root / variant / f).stat().st_mode & 0o777 for f in files} == {umask_mode(0o666)}


@pytest.mark.parametrize("variant", VARIANTS)
def test_model_json_and_manifest(tiny_artifacts, variant):
    root, _ = tiny_artifacts
    meta = json.loads((root / variant / "model.json").read_text())
    assert meta["variant"] == variant and meta["trained_context"] == 16 and meta["opset"] == 23
    assert meta["attention"] == "onnx"  # the default
    assert meta["max_positions"] == (16 if variant == "learned" else None)
    assert meta["tokenizer"] == {"type": "bytes-utf8", "vocab_size": 256}
    assert [i["name"] for i in meta["inputs"]][:3] == ["input_ids", "attention_mask", "past_key_values.0.key"]
    manifest = artifact.verify(root / variant)
    assert set(manifest["files"]) == {"model.onnx", "model.json", "profile.onnx", "intervene.onnx",
                                      "intervene_profile.onnx"} | (
        {"encoding.onnx"} if variant != "none" else set())
    assert {"torch", "onnx", "onnxruntime"} <= set(manifest["tools"])
    assert manifest["validation"]["passed"] is True
    for name in manifest["files"]:  # no path of the machine it was exported on (the tracer's stack traces had them)
        data = (root / variant / name).read_bytes()
        assert str(ROOT).encode() not in data and b"site-packages" not in data, name
        if name.endswith(".onnx"):  # nor an address of the exporting process: a node's metadata is its namespace
            nodes = onnx.load(str(root / variant / name), load_external_data=False).graph.node
            assert {p.key for n in nodes for p in n.metadata_props} == {"namespace"}, name
            assert not re.search(rb" at 0x[0-9a-f]+", data), name


@pytest.mark.parametrize("variant", VARIANTS)
def test_graph_dims_are_symbolic(tiny_artifacts, variant):
    root, _ = tiny_artifacts
    proto = onnx.load(str(root / variant / "model.onnx"), load_external_data=False)
    dims = {v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]
            for v in list(proto.graph.input) + list(proto.graph.output)}
    assert dims["input_ids"] == ["batch_size", "sequence_length"]
    assert dims["attention_mask"] == ["batch_size", "total_sequence_length"]
    assert dims["past_key_values.0.key"] == ["batch_size", 4, "past_sequence_length", 8]
    assert dims["attentions"] == ["batch_size", 2, 4, "sequence_length", "total_sequence_length"]


def test_standalone_validate_cli(tiny_artifacts):
    root, _ = tiny_artifacts
    res = cli("validate", str(root / "alibi"))
    assert res.returncode == 0, res.stdout + res.stderr
    assert "PASSED" in res.stdout and "max abs diff" in res.stdout
    res = cli("validate", str(root / "rope"), "--json")
    data = json.loads(res.stdout)
    assert data["passed"] and data["max_abs_diff"]["logits"] < 1e-4


def test_flipped_byte_is_detected(tiny_artifacts, tmp_path):
    root, _ = tiny_artifacts
    import shutil
    copy = tmp_path / "t5"
    shutil.copytree(root / "t5", copy)
    data = bytearray((copy / "model.onnx").read_bytes())
    data[len(data) // 2] ^= 0x10
    (copy / "model.onnx").write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match="sha256"):
        artifact.verify(copy)
    res = run("validate", str(copy))
    assert res.returncode == 2 and "sha256" in res.stderr and "Traceback" not in res.stderr


class BakedRope(Rope):
    """The classic bug: a cos/sin table precomputed for the trained context and indexed by position."""

    def __init__(self, cfg):
        super().__init__(cfg)
        pos = torch.arange(cfg.context)
        k = torch.arange(0, cfg.head_dim, 2, dtype=torch.float32)
        ang = pos[:, None].float() * cfg.rope_base ** (-k / cfg.head_dim)
        ang = torch.cat((ang, ang), -1)
        self.register_buffer("cos_t", ang.cos(), persistent=False)
        self.register_buffer("sin_t", ang.sin(), persistent=False)

    def rotate(self, q, k, positions):
        c, s = self.cos_t[positions][:, None], self.sin_t[positions][:, None]
        return apply_rope(q, c, s), apply_rope(k, c, s)


def test_graph_check_catches_a_baked_table(tmp_path):
    from export.build import export_onnx

    model = tiny_model("rope")
    model.pos = BakedRope(model.cfg)
    export_onnx(model, tmp_path / "model.onnx", 23, attention="explicit")  # its rotate takes (B, H, T, Dh)
    proto = onnx.load(str(tmp_path / "model.onnx"))
    weights = {k: v.numpy() for k, v in model.state_dict().items()}
    findings = {f.check: f for f in check_graph(proto, 16, weights, {"input_ids": [0, 1]}, False)}
    assert not findings["no length-specific constants"].passed
    assert "[16, 8]" in findings["no length-specific constants"].detail
    # and the table really breaks the model beyond it: ORT fails at 4x the context
    sess = session_for(tmp_path / "model.onnx")
    feeds = {"input_ids": np.zeros((1, 64), np.int64), "attention_mask": np.ones((1, 64), np.int64)}
    feeds.update({i.name: np.zeros((1, 4, 0, 8), np.float32) for i in sess.get_inputs()[2:]})
    with pytest.raises(Exception):  # noqa: B017 - onnxruntime raises its own Fail/RuntimeException types
        sess.run(None, feeds)


def test_existing_output_needs_force(tiny_artifacts, tmp_path):
    out = tmp_path / "a"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    res = run("--init", "random", "--variant", "alibi", "--preset", "tiny", "--out", str(out))
    assert res.returncode == 2 and "--force" in res.stderr and "Traceback" not in res.stderr
    assert (out / "keep.txt").read_text() == "mine"


@pytest.mark.parametrize("args, match", [
    (["--init", "random", "--variant", "warp"], "unknown variant 'warp'"),
    (["--init", "random", "--variant", "rope", "--opset", "9"], "unsupported opset 9"),
    (["--checkpoint", "/nonexistent/ck"], "does not exist"),
    (["--checkpoints", "/nonexistent"], "no complete checkpoints"),
])
def test_bad_input_one_line_error_nothing_written(tmp_path, args, match):
    res = run(*args, "--out", str(tmp_path / "out"))
    assert res.returncode == 2, res.stderr
    assert match in res.stderr and "Traceback" not in res.stderr
    assert not (tmp_path / "out").exists()
    assert not list(tmp_path.glob(".*"))


def test_corrupted_checkpoint_is_refused(tmp_path):
    from model import checkpoint

    ck = checkpoint.save(tiny_model("none"), tmp_path / "ck")
    w = ck / "model.safetensors"
    w.write_bytes(w.read_bytes()[:-7] + b"garbage")
    res = run("--checkpoint", str(ck), "--out", str(tmp_path / "out"))
    assert res.returncode == 2 and "sha256" in res.stderr
    assert not (tmp_path / "out").exists()


def test_export_from_checkpoint_via_cli_and_skip_existing(tmp_path):
    from model import checkpoint

    checkpoint.save(tiny_model("alibi"), tmp_path / "cks" / "alibi", {"heldout_loss": 2.5})
    res = cli("--checkpoints", str(tmp_path / "cks"), "--out", str(tmp_path / "arts"), "--interventions", "off")
    assert res.returncode == 0, res.stderr
    assert "torchvision" not in res.stderr  # the exporter's notice about operators posenc never exports
    meta = json.loads((tmp_path / "arts" / "alibi" / "model.json").read_text())
    assert meta["heldout_loss"] == 2.5 and meta["source"]["kind"] == "checkpoint"
    res = cli("--checkpoints", str(tmp_path / "cks"), "--out", str(tmp_path / "arts"), "--skip-existing",
              "--interventions", "off")
    assert res.returncode == 0 and "up to date" in res.stdout


def test_triton_repository_parses_with_tritonclient_schema(tiny_artifacts, tmp_path):
    root, _ = tiny_artifacts
    names = write_repository(root, tmp_path / "repo")
    assert sorted(names) == sorted(VARIANTS)
    # tritonclient's model_config_pb2 in its own process (its protobuf names clash with posenc's stubs)
    res = subprocess.run([sys.executable, str(ROOT / "tests" / "tritonclient_checks.py"), "parse-configs",
                          str(tmp_path / "repo")], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    parsed = json.loads(res.stdout)
    assert sorted(parsed) == sorted(VARIANTS)
    for name, cfg in parsed.items():
        assert cfg["name"] == name and cfg["backend"] == "onnxruntime" and cfg["max_batch_size"] == 0
        assert cfg["inputs"]["input_ids"] == [[-1, -1], "TYPE_INT64"]
        assert cfg["inputs"]["past_key_values.1.value"] == [[-1, 4, -1, 8], "TYPE_FP32"]
        assert cfg["outputs"]["attentions"] == [[-1, 2, 4, -1, -1], "TYPE_FP32"]
        assert (tmp_path / "repo" / name / "1" / "model.onnx").read_bytes() == (root / name / "model.onnx").read_bytes()


def test_validate_detects_wrong_weights(tiny_artifacts):
    root, _ = tiny_artifacts
    other = tiny_model("alibi", seed=5)
    report = validate_folder(root / "alibi", reference=other)
    assert not report.passed
    assert any(c.output == "logits" and not c.passed for c in report.checks)


def test_validate_checks_the_encoding_graph_against_the_model(tiny_artifacts, tmp_path):
    import shutil

    root, _ = tiny_artifacts
    shutil.copytree(root / "t5", tmp_path / "t5")
    shutil.copy(root / "alibi" / "encoding.onnx", tmp_path / "t5" / "encoding.onnx")  # same outputs, other values
    artifact.write_manifest(tmp_path / "t5", None)
    report = validate_folder(tmp_path / "t5")
    failed = [c for c in report.checks if not c.passed]
    assert not report.passed and failed and all(c.case.startswith("encoding length") for c in failed)


@pytest.mark.parametrize("method", ["linear", "ntk", "yarn"])
def test_rope_scale_writes_a_validated_scaled_copy(tiny_artifacts, tmp_path, method):
    root, _ = tiny_artifacts
    out = tmp_path / f"rope-{method}4"
    graphs = "on" if method == "ntk" else "off"  # one scaled copy with its intervention graph, proven at export
    res = run("rope-scale", str(root / "rope"), "--method", method, "--factor", "4", "--out", str(out),
              "--interventions", graphs)
    assert res.returncode == 0, res.stderr
    assert (out / "intervene.onnx").exists() == (graphs == "on")
    manifest = artifact.verify(out)
    assert manifest["validation"]["passed"]
    meta = json.loads((out / "model.json").read_text())
    assert meta["config"]["rope_scaling"] == method and meta["config"]["rope_factor"] == 4.0
    assert meta["config"]["rope_original_context"] == 16 and meta["heldout_loss"] is None
    assert meta["source"]["kind"] == "rope-scaled" and meta["source"]["method"] == method
    cases = {c["case"] for c in manifest["validation"]["checks"]}
    assert "B=3 T=64 past=0" in cases  # validated at 4x the trained context like any artifact
    # The scaled graph differs from the original: same weights, other angles.
    base = session_for(root / "rope" / "model.onnx")
    scaled = session_for(out / "model.onnx")
    feeds = {"input_ids": np.arange(1, 33, dtype=np.int64)[None], "attention_mask": np.ones((1, 32), np.int64)}
    for s in (base, scaled):
        for i in s.get_inputs()[2:]:
            feeds[i.name] = np.zeros((1, 4, 0, 8), np.float32)
    a, b = (s.run(["logits"], feeds)[0] for s in (base, scaled))
    assert np.abs(a - b).max() > 1e-3
    again = run("rope-scale", str(root / "rope"), "--method", method, "--factor", "4", "--out", str(out),
                "--skip-existing", "--interventions", graphs)
    assert again.returncode == 0 and "up to date" in again.stdout
    if graphs == "on":  # a copy without the graph is not the one asked for: made again, without it
        other = run("rope-scale", str(root / "rope"), "--method", method, "--factor", "4", "--out", str(out),
                    "--skip-existing", "--interventions", "off")
        assert other.returncode == 0 and "up to date" not in other.stdout
        assert not (out / "intervene.onnx").exists()
    from tests.serving import start

    srv = start(tmp_path)  # served under its own name like any artifact
    try:
        assert sorted(srv.registry.models) == [out.name]
        assert srv.ops.predict(out.name, "dog bites man", None).top
    finally:
        srv.stop(grace=1)


@pytest.mark.parametrize("args, match", [
    (["alibi", "--method", "yarn", "--factor", "4"], "needs a rope one"),
    (["rope", "--method", "yarn", "--factor", "0.5"], "factor = 0.5 must be >= 1"),
    (["rope", "--method", "longrope", "--factor", "2"], "invalid choice"),  # its factor lists: --rope-scaling
])
def test_rope_scale_bad_input(tiny_artifacts, tmp_path, args, match):
    root, _ = tiny_artifacts
    res = run("rope-scale", str(root / args[0]), *args[1:], "--out", str(tmp_path / "x"))
    assert res.returncode == 2 and match in res.stderr
    assert not (tmp_path / "x").exists()


# One variant per way the attention reads its position: nothing (none; learned, sinusoidal and CPE change only the
# input), the rotation (RoPE), a query-free bias in the mask (ALiBi; T5 and FIRE take the same path), a bias from the
# queries and every key (Shaw; Transformer-XL alike) and a scaled content score with such a bias (DeBERTa).  Every
# variant's "onnx" graph is validated when the shared tiny artifacts are built.
EXPLICIT_KINDS = ["none", "rope", "alibi", "shaw", "deberta"]


@pytest.mark.parametrize("variant", EXPLICIT_KINDS)
def test_both_attention_kinds_validate_against_the_explicit_model(tiny_artifacts, tmp_path, variant):
    """The default ("onnx"): one Attention-23 node per layer (probabilities as its 4th output), RoPE's rotation as
    RotaryEmbedding-23.  "explicit" at opset 18: MatMul/Softmax nodes.  Both proven against the explicit PyTorch
    model by the same validation at every shape."""
    from export.build import build_artifact

    model = tiny_model(variant)
    report = build_artifact(model, tmp_path / variant, name=variant, opset=18, source={"kind": "random"},
                            training={}, force=False, attention="explicit", interventions=False)
    assert report.passed, report.format_table()
    assert not model.blocks[0].attn.onnx_ops and not model.pos.onnx_ops  # the reference stays explicit
    cases = {c.case for c in report.checks}
    assert any(c.startswith("left-padded") for c in cases) and any(c.startswith("decode step 3") for c in cases)
    for folder, kind, opset in ((tmp_path / variant, "explicit", 18), (tiny_artifacts[0] / variant, "onnx", 23)):
        proto = onnx.load(str(folder / "model.onnx"))
        ops = [n.op_type for n in proto.graph.node]
        attention = [n for n in proto.graph.node if n.op_type == "Attention"]
        meta = json.loads((folder / "model.json").read_text())
        assert meta["attention"] == kind and meta["opset"] == opset
        if kind == "explicit":
            assert not attention and ops.count("Softmax") == model.cfg.n_layers
            continue
        assert len(attention) == model.cfg.n_layers and "Softmax" not in ops
        assert all({a.name: a.i for a in n.attribute}["qk_matmul_output_mode"] == 3 for n in attention)
        assert ops.count("RotaryEmbedding") == (2 * model.cfg.n_layers if variant == "rope" else 0)


def test_onnx_attention_needs_opset_23(tmp_path):
    from export.build import export_onnx

    with pytest.raises(ExportError, match="needs opset 23"):
        export_onnx(tiny_model("rope"), tmp_path / "m.onnx", 18, attention="onnx")
    with pytest.raises(ExportError, match="unknown attention"):
        export_onnx(tiny_model("rope"), tmp_path / "m.onnx", 23, attention="fused")
    r = run("--init", "random", "--variant", "alibi", "--opset", "18", "--out", str(tmp_path / "a"))
    assert r.returncode == 2 and "needs opset 23" in r.stderr and not (tmp_path / "a").exists()
