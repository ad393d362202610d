"""Training CLI, checkpoints and their failure modes, on the tiny preset with a few steps."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from model import checkpoint
from model.errors import CheckpointError
from model.train import main
from model.variants import VARIANT_NAMES
from tests.model.helpers import tiny_model

# one torch thread: make test's two xdist workers share the two cores (two threads each spin against each other)
TINY = ["--preset", "tiny", "--steps", "3", "--batch-size", "2", "--quiet", "--threads", "1"]


def run_cli(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "model.train", *args], capture_output=True, text=True,
                          cwd=cwd or Path(__file__).resolve().parents[2], timeout=300)


def run_main(capsys, *args):
    """The CLI's own main() in this process, argv as a shell passes it: (exit status, stderr).  The error paths need
    no interpreter of their own; the tests above and test_custom_corpus_and_progress_bar run the real process."""
    try:
        code = main(list(args))
    except SystemExit as exit_:
        code = exit_.code
    return code, capsys.readouterr().err


def test_train_one_writes_checkpoint_and_reloads(tmp_path):
    assert main(["--variant", "alibi", "--out", str(tmp_path), *TINY]) == 0
    ck = tmp_path / "alibi"
    assert sorted(p.name for p in ck.iterdir()) == ["checkpoint.json", "model.safetensors"]
    meta = json.loads((ck / "checkpoint.json").read_text())
    s = meta["training"]
    assert s["steps"] == 3 and s["loss_unit"] == "nats per byte" and s["heldout_loss"] > 0
    assert {"seconds", "train_loss", "heldout_loss", "corpus"} <= set(s)
    model, _ = checkpoint.load(ck)
    assert model.cfg.variant == "alibi" and model.cfg.d_model == 32
    assert not list(tmp_path.glob(".*tmp*"))  # no temporary folder left behind


def test_training_is_deterministic_for_a_seed(tmp_path):
    for out, seed in (("a", 7), ("b", 7), ("c", 8)):
        assert main(["--variant", "fire", "--out", str(tmp_path / out), "--seed", str(seed), *TINY]) == 0
    digest = {o: checkpoint.sha256_file(tmp_path / o / "fire" / "model.safetensors") for o in "abc"}
    assert digest["a"] == digest["b"]
    assert digest["a"] != digest["c"]


def test_train_all_prints_summary_table(tmp_path):
    res = run_cli("--variant", "all", "--out", str(tmp_path), *TINY, "--steps", "2")
    assert res.returncode == 0, res.stderr
    for name in VARIANT_NAMES:
        assert f"| {name} |" in res.stdout
        assert (tmp_path / name / "model.safetensors").is_file()
    assert "held-out loss" in res.stdout


def test_custom_corpus_and_progress_bar(tmp_path):
    corpus = tmp_path / "c.txt"
    corpus.write_text("位置编码 positional encodings. " * 40, encoding="utf-8")
    res = run_cli("--variant", "rope", "--out", str(tmp_path / "out"), "--corpus", str(corpus),
                  "--preset", "tiny", "--steps", "3", "--batch-size", "2", "--threads", "1")
    assert res.returncode == 0, res.stderr
    assert "3/3" in res.stderr  # the progress bar
    meta = checkpoint.read_meta(tmp_path / "out" / "rope")
    assert meta["training"]["corpus"] == str(corpus)


@pytest.mark.parametrize("setup, match", [
    ("missing", "does not exist"),
    ("empty", "is empty"),
    ("latin1", "not UTF-8"),
    ("tiny", "too small"),
])
def test_bad_corpus_is_one_clear_error_and_writes_nothing(tmp_path, capsys, setup, match):
    corpus = tmp_path / "corpus.txt"
    if setup == "empty":
        corpus.write_text("  \n")
    elif setup == "latin1":
        corpus.write_bytes("café".encode("latin-1") * 50)
    elif setup == "tiny":
        corpus.write_text("abc")
    code, err = run_main(capsys, "--variant", "rope", "--out", str(tmp_path / "out"), "--corpus", str(corpus), *TINY)
    assert code == 2
    assert match in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_unknown_variant_lists_known_and_writes_nothing(tmp_path, capsys):
    code, err = run_main(capsys, "--variant", "warp", "--out", str(tmp_path / "out"), *TINY)
    assert code == 2 and "Traceback" not in err
    assert "unknown variant 'warp'" in err
    assert all(name in err for name in VARIANT_NAMES)
    assert not (tmp_path / "out").exists()


@pytest.fixture
def saved(tmp_path):
    return checkpoint.save(tiny_model("t5"), tmp_path / "t5", {"steps": 0})


def test_checkpoint_roundtrip_is_exact(saved):
    model, meta = checkpoint.load(saved)
    ref = tiny_model("t5")
    ids = torch.randint(0, 256, (2, 9))
    assert torch.equal(model(ids).logits, ref(ids).logits)
    assert meta["training"] == {"steps": 0}


@pytest.mark.parametrize("damage, match", [
    ("rm-weights", "missing model.safetensors"),
    ("rm-meta", "missing checkpoint.json"),
    ("flip-byte", "sha256"),
    ("bad-json", "not valid JSON"),
    ("bad-config", "bad config"),
    ("not-a-dir", "does not exist"),
])
def test_damaged_checkpoint_is_a_clear_error(saved, damage, match):
    weights, meta = saved / "model.safetensors", saved / "checkpoint.json"
    target = saved
    if damage == "rm-weights":
        weights.unlink()
    elif damage == "rm-meta":
        meta.unlink()
    elif damage == "flip-byte":
        data = bytearray(weights.read_bytes())
        data[len(data) // 2] ^= 0x01
        weights.write_bytes(bytes(data))
    elif damage == "bad-json":
        meta.write_text("{not json")
    elif damage == "bad-config":
        m = json.loads(meta.read_text())
        m["config"]["n_heads"] = 5
        meta.write_text(json.dumps(m))
    elif damage == "not-a-dir":
        target = saved.parent / "nowhere"
    with pytest.raises(CheckpointError, match=match):
        checkpoint.load(target)


def test_failed_save_keeps_the_old_checkpoint(saved, monkeypatch):
    before = checkpoint.sha256_file(saved / "model.safetensors")

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(checkpoint, "save_file", boom)
    with pytest.raises(OSError, match="disk full"):
        checkpoint.save(tiny_model("t5", seed=3), saved)
    assert checkpoint.sha256_file(saved / "model.safetensors") == before
    assert checkpoint.load(saved)[0] is not None
    assert [p.name for p in saved.parent.iterdir()] == ["t5"]  # no temporary folder left


def test_skip_existing_keeps_complete_checkpoints(tmp_path):
    assert main(["--variant", "none", "--out", str(tmp_path), *TINY]) == 0
    stamp = os.stat(tmp_path / "none" / "model.safetensors").st_mtime_ns
    assert main(["--variant", "none", "--out", str(tmp_path), "--skip-existing", *TINY]) == 0
    assert os.stat(tmp_path / "none" / "model.safetensors").st_mtime_ns == stamp


def test_nothing_is_pickled():
    root = Path(__file__).resolve().parents[2] / "model"
    for path in root.rglob("*.py"):
        text = path.read_text()
        for banned in ("import pickle", "torch.load(", "torch.save("):
            assert banned not in text, f"{path} uses {banned}"
