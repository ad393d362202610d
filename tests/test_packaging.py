"""The project installs (`make install` runs `pip install -e .`): console scripts, and a client that needs no torch."""

import re
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


@pytest.mark.parametrize("script, words", [
    ("posenc", ["list", "predict", "generate", "score", "compare", "encoding", "extrapolate", "report"]),
    ("posenc-serve", ["--model-dir", "--port"]),
    ("posenc-export", ["--checkpoints", "--out"]),
])
def test_console_scripts_are_installed_and_answer_help(script, words):
    path = BIN / script
    assert path.exists(), f"{path} is missing: `pip install -e .` (make install) installs it"
    out = subprocess.run([str(path), "--help"], capture_output=True, text=True, timeout=120, cwd="/")
    assert out.returncode == 0, out.stderr
    assert all(w in out.stdout for w in words), out.stdout


def name_of(requirement: str) -> str:
    return re.split(r"[\s\[<>=!~;]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def closure(requirements: list[str]) -> set[str]:
    """Every distribution the requirements pull in, from the installed packages' own metadata (no extras of
    theirs, no requirements guarded by markers that do not apply here)."""
    seen, todo = set(), [r for r in requirements]
    while todo:
        req = todo.pop()
        marker = req.partition(";")[2]
        if "extra ==" in marker:
            continue
        name = name_of(req)
        if name in seen:
            continue
        seen.add(name)
        try:
            todo += metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            pass
    return seen


def test_the_client_install_pulls_neither_torch_nor_onnxruntime_nor_matplotlib():
    project = PYPROJECT["project"]
    client = closure(project["dependencies"] + project["optional-dependencies"]["client"])
    assert {"grpcio", "protobuf", "numpy"} <= client
    assert not client & {"torch", "onnxruntime", "matplotlib", "transformers"}, sorted(client)
    worker = closure(project["dependencies"] + project["optional-dependencies"]["worker"])
    assert "onnxruntime" in worker and not worker & {"torch", "transformers", "matplotlib"}, sorted(worker)


def test_the_worker_extra_names_every_worker_requirement():
    """requirements/worker.txt (the image's exact pins) and the worker extra name the same packages."""
    pinned = {name_of(line) for line in (ROOT / "requirements" / "worker.txt").read_text().splitlines()
              if line.strip() and not line.startswith(("#", "-"))}
    project = PYPROJECT["project"]
    declared = {name_of(r) for r in project["dependencies"] + project["optional-dependencies"]["worker"]}
    assert pinned == declared, f"only pinned: {sorted(pinned - declared)}; only declared: {sorted(declared - pinned)}"


def _ignored(path: str, patterns: list[str]) -> bool:
    """Docker's reading of .dockerignore for one context path: the last pattern that matches it or a folder above
    it decides, a leading ! including again."""
    from fnmatch import fnmatch

    parts = path.rstrip("/").split("/")
    ignored = False
    for pattern in patterns:
        keep = pattern.startswith("!")
        body = pattern.lstrip("!").rstrip("/")
        if any(fnmatch("/".join(parts[:n]), body) or fnmatch("/".join(parts[:n]), body.replace("**/", ""))
               for n in range(1, len(parts) + 1)):
            ignored = not keep
    return ignored


def test_every_file_the_worker_image_copies_is_in_its_build_context():
    """docker/Dockerfile's COPY sources (not those from another stage) exist and .dockerignore lets them in: a file
    added to the image's list but not to the context fails the build, which only the compose test would see."""
    text = (ROOT / "docker" / "Dockerfile").read_text().replace("\\\n", " ")
    patterns = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    sources = [src for line in text.splitlines() if line.startswith("COPY ") and "--from=" not in line
               for src in line.split()[1:-1]]
    assert "model/config.py" in sources and "service/" in sources
    for src in sources:
        assert src.startswith("build/") or (ROOT / src).exists(), src  # build/: made by make wheelhouse first
        assert not _ignored(src, patterns), f"{src} is copied into the image but .dockerignore leaves it out"
