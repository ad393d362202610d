"""The client CLI against a real server."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def client(server, *args, module="client", cwd=ROOT, pre=""):
    """`python -m client ARGS` (module="lab": `posenc ARGS`); `pre` runs first (python -c), in `cwd`."""
    run = [sys.executable, "-c", f"{pre}import runpy; runpy.run_module({module!r}, run_name='__main__')"]
    return subprocess.run([*run, "--target", f"127.0.0.1:{server.port}", *args],
                          capture_output=True, text=True, cwd=cwd, timeout=60)


def test_list_and_predict_tables(server):
    res = client(server, "list")
    assert res.returncode == 0 and "learned" in res.stdout and "unbounded" in res.stdout
    rows = res.stdout.splitlines()[1:]  # random tiny weights: no held-out figure, so '–' and never 0.000
    assert rows and all(row.split()[-2] == "–" for row in rows) and "0.000" not in res.stdout
    assert all(row.split()[-1] == "–" for row in rows)  # trained here, not imported: no proof at import
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
    res = client(server, "predict", "--model", "alibi", "dog bites man", "--attention-png", str(out), module="lab")
    assert res.returncode == 0, res.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    pixels = matplotlib.image.imread(str(out))
    assert pixels.shape[0] > 300 and pixels.shape[1] > 300
    assert pixels[..., :3].std() > 0.05  # not a blank canvas
    assert "written to" in res.stderr


def test_the_client_image_has_no_lab_and_says_where_its_commands_are(server, tmp_path):
    """A copy of what docker/Dockerfile's client target copies (no lab/), with lab made unimportable (the editable
    install would find it): the client's commands work, the lab's are one line and exit 2."""
    image = tmp_path / "app"
    for line in (ROOT / "docker" / "Dockerfile").read_text().splitlines():
        if line.startswith("COPY ") and "--from" not in line and "/app/" in line:
            *paths, dest = line.split()[1:]
            for path in paths:
                target = image / dest.removeprefix("/app/") / (Path(path).name if not path.endswith("/") else "")
                target.parent.mkdir(parents=True, exist_ok=True)
                (shutil.copytree if path.endswith("/") else shutil.copy)(ROOT / path, target)
    assert (image / "client" / "cli.py").exists() and not (image / "lab").exists()
    no_lab = "import sys; sys.modules['lab'] = None; "
    res = client(server, "list", cwd=image, pre=no_lab)
    assert res.returncode == 0 and "learned" in res.stdout, res.stderr
    for args in (["compare", "dog bites man", "--model", "rope"], ["report", "--out", "r.html"],
                 ["predict", "--model", "alibi", "x", "--attention-png", "a.png"]):
        res = client(server, *args, cwd=image, pre=no_lab)
        assert res.returncode == 2 and res.stdout == "" and len(res.stderr.splitlines()) == 1, res.stderr
        assert "lab" in res.stderr and "posenc " in res.stderr and "Traceback" not in res.stderr
    assert not list(image.rglob("r.html")) and not list(image.rglob("a.png"))
