"""The client CLI against a real server."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def client(server, *args):
    return subprocess.run([sys.executable, "-m", "client", "--target", f"127.0.0.1:{server.port}", *args],
                          capture_output=True, text=True, cwd=ROOT, timeout=60)


def test_list_and_predict_tables(server):
    res = client(server, "list")
    assert res.returncode == 0 and "learned" in res.stdout and "unbounded" in res.stdout
    rows = res.stdout.splitlines()[1:]  # random tiny weights: no held-out figure, so '–' and never 0.000
    assert rows and all(row.split()[-1] == "–" for row in rows) and "0.000" not in res.stdout
    res = client(server, "predict", "--model", "rope", "dog bites man", "--attention", "last", "--layer", "1")
    assert res.returncode == 0, res.stderr
    assert "rank" in res.stdout and "attention layer 1 head 3" in res.stdout


def test_generate_streams_and_json(server):
    res = client(server, "generate", "--model", "alibi", "ab", "--max-new-tokens", "5")
    assert res.returncode == 0 and "[length]" in res.stdout
    res = client(server, "--json", "generate", "--model", "alibi", "ab", "--max-new-tokens", "3")
    lines = [json.loads(x) for x in res.stdout.splitlines()]
    assert len(lines) == 3 and lines[-1]["finishReason"] == "length"


def test_score_and_errors(server):
    res = client(server, "score", "--model", "t5", "hello world")
    assert res.returncode == 0 and "perplexity" in res.stdout
    res = client(server, "predict", "--model", "nope", "x")
    assert res.returncode == 2 and "NOT_FOUND" in res.stderr


def test_attention_png(server, tmp_path):
    import matplotlib.image

    out = tmp_path / "att.png"
    res = client(server, "predict", "--model", "alibi", "dog bites man", "--attention-png", str(out))
    assert res.returncode == 0, res.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    pixels = matplotlib.image.imread(str(out))
    assert pixels.shape[0] > 300 and pixels.shape[1] > 300
    assert pixels[..., :3].std() > 0.05  # not a blank canvas
    assert "written to" in res.stderr
