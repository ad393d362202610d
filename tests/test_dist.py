"""The distribution (make dist): PyPA's build makes the sdist and, from it, the wheel; the wheel carries every file of
the packages, and installed with its worker extra into a clean virtualenv (no site packages, no index: the wheels
of build/wheelhouse, which make test makes first) and used from outside the repository, its console scripts answer
and its worker serves the viewer and answers a Predict, through the installed client, as the repository's worker
does."""

import os
import shutil
import subprocess
import sys
import tarfile
import threading
import time
import urllib.request
import zipfile
from pathlib import Path

import pytest

from client.api import Client
from protos.posenc.v1 import posenc_pb2 as pb
from tests.serving import start

ROOT = Path(__file__).resolve().parents[1]
WHEELHOUSE = ROOT / "build" / "wheelhouse"
PACKAGES = ["model", "export", "service", "client", "lab", "protos"]
SCRIPTS = {"posenc": ["predict", "generate", "list"], "posenc-serve": ["--model-dir", "--port"]}
PROMPT = "dog bites man"

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("dist")]  # one worker builds the wheel and the virtualenv


def package_files() -> set[str]:
    """The packages' files the repository tracks (sources, generated stubs, .proto files, the viewer)."""
    out = subprocess.run(["git", "ls-files", "-z", "--", *PACKAGES], cwd=ROOT, capture_output=True, check=True)
    return {name for name in out.stdout.decode().split("\0") if name}


@pytest.fixture(scope="module")
def dist(tmp_path_factory):
    """(wheel, sdist), built as make dist builds them: the sdist first, then the wheel from the unpacked sdist."""
    out = tmp_path_factory.mktemp("dist")
    done = subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(ROOT)],
                          cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (wheel,), (sdist,) = out.glob("*.whl"), out.glob("*.tar.gz")
    return wheel, sdist


def clean_env(**extra) -> dict[str, str]:
    """No PYTHONPATH, no worker settings, no pip configuration of this machine (its indexes and find-links)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("POSENC_", "PIP_", "PYTHON", "VIRTUAL_ENV"))}
    return {**env, "PIP_CONFIG_FILE": os.devnull, "PIP_DISABLE_PIP_VERSION_CHECK": "1", **extra}


@pytest.fixture(scope="module")
def venv(dist, tmp_path_factory):
    """A virtualenv holding the wheel with its worker extra and nothing else, installed with --no-index from the
    wheelhouse at requirements/worker.txt's exact pins."""
    assert WHEELHOUSE.is_dir(), f"{WHEELHOUSE} is missing: make wheelhouse (a prerequisite of make test) makes it"
    home = tmp_path_factory.mktemp("venv")
    assert not home.is_relative_to(ROOT)
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(home)], check=True, timeout=60)
    # .venv's pip installs into it (ensurepip would add seconds); --no-compile: the worker compiles what it imports
    pip = [sys.executable, "-m", "pip", "--python", str(home / "bin" / "python"), "install", "--quiet", "--no-compile"]
    pins = ROOT / "requirements" / "worker.txt"
    done = subprocess.run([*pip, "--no-index", "--find-links", str(WHEELHOUSE), "-c", str(pins), f"{dist[0]}[worker]"],
                          capture_output=True, text=True, timeout=180, env=clean_env())
    assert done.returncode == 0, done.stderr[-3000:]
    return home


def run(venv, *argv, timeout=60):
    """A command of the virtualenv, from a folder outside the repository."""
    return subprocess.run([str(venv / "bin" / argv[0]), *argv[1:]], capture_output=True, text=True, timeout=timeout,
                          cwd=venv, env=clean_env())


def test_the_wheel_and_the_sdist_carry_every_file_of_the_packages(dist):
    wheel, sdist = dist
    tracked = package_files()
    assert {"protos/posenc/v1/posenc.proto", "protos/posenc/v1/posenc_pb2.py", "service/http/viewer/index.html",
            "service/http/viewer/viewer.js", "service/http/viewer/viewer.css"} <= tracked
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        info = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
        scripts = z.read(info).decode()
        metadata = z.read(info.replace("entry_points.txt", "METADATA")).decode()
    assert sorted(tracked - names) == [], "files of the packages missing from the wheel"
    others = {n.split("/")[0] for n in names} - set(PACKAGES)  # no tests/, bench/ or docs/: its .dist-info alone
    assert len(others) == 1 and others.pop().endswith(".dist-info"), sorted(names)
    for line in ["posenc = lab.cli:main", "posenc-serve = service.__main__:main",
                 "posenc-export = export.__main__:main"]:
        assert line in scripts, scripts
    assert "Provides-Extra: worker" in metadata and "Provides-Extra: build" in metadata, metadata
    with tarfile.open(sdist) as t:
        top = sdist.name.removesuffix(".tar.gz")
        members = {m.name.removeprefix(f"{top}/") for m in t.getmembers() if m.isfile()}
    assert sorted((tracked | {"pyproject.toml", "README.md", "requirements/worker.txt"}) - members) == []


def test_the_installed_worker_and_client_answer_from_the_virtualenv(venv, tiny_artifacts, tmp_path):
    # Imports come from the virtualenv, not the source tree, and the worker extra brings no torch and no onnx.
    where = run(venv, "python", "-c", "import importlib.util, client, lab, model, protos, service; "
                "print(*[importlib.util.find_spec(m) for m in ('torch', 'onnx')]); "
                "print('\\n'.join(m.__file__ for m in (client, lab, model, protos, service)))")
    assert where.returncode == 0, where.stderr
    absent, *files = where.stdout.splitlines()
    assert absent == "None None" and len(files) == 5, where.stdout
    assert all(Path(f).is_relative_to(venv / "lib") for f in files), where.stdout

    for script, words in SCRIPTS.items():
        done = run(venv, script, "--help")
        assert done.returncode == 0 and done.stdout.startswith("usage:"), done.stderr
        assert all(w in done.stdout for w in words), done.stdout
    # Exporting needs torch and onnx (the build extra), which the worker extra leaves out: the script says so.
    export = run(venv, "posenc-export", "--help")
    assert export.returncode == 2 and export.stdout == "", export
    assert export.stderr.strip().splitlines() == [
        "posenc-export: error: onnx is missing: exporting needs the build extra (pip install 'posenc[build]')"]

    models = tmp_path / "models"
    shutil.copytree(tiny_artifacts[0] / "rope", models / "rope")
    proc = subprocess.Popen([str(venv / "bin" / "posenc-serve"), "--model-dir", str(models), "--port", "0",
                             "--http-port", "0", "--metrics-port", "-1", "--threads", "1"],
                            cwd=venv, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    log, http = [], threading.Event()

    def read_log():  # read to the end, so the worker never blocks on a full pipe
        for text in proc.stderr:
            log.append(text)
            if "HTTP on http://" in text:
                http.port = int(text.rsplit(":", 1)[1])
                http.set()

    reader = threading.Thread(target=read_log, daemon=True)
    reader.start()
    reference = start(models)  # one onnxruntime thread, as the installed worker runs
    try:
        line = proc.stdout.readline()
        assert line.startswith("posenc serving rope on 127.0.0.1:"), line + "".join(log)
        port = int(line.rsplit(":", 1)[1])
        assert http.wait(30), "".join(log)
        health = None
        for _ in range(50):
            health = run(venv, "python", "-m", "service.healthcheck", "--target", f"127.0.0.1:{port}")
            if health.returncode == 0:
                break
            time.sleep(0.2)
        assert health.returncode == 0, health.stderr

        # The viewer's files come from the installed package.
        for path, name in [("/", "index.html"), ("/viewer/viewer.js", "viewer.js"), ("/viewer/viewer.css",
                                                                                       "viewer.css")]:
            with urllib.request.urlopen(f"http://127.0.0.1:{http.port}{path}", timeout=10) as resp:
                assert resp.read() == (ROOT / "service/http/viewer" / name).read_bytes(), path

        listed = run(venv, "posenc", "--target", f"127.0.0.1:{port}", "list")
        assert listed.returncode == 0 and "rope" in listed.stdout, listed.stderr

        ask = ("import sys; from client.api import Client\n"
               "with Client(sys.argv[1]) as c:\n"
               f"    r = c.predict('rope', {PROMPT!r}, top_k=5, attention='last')\n"
               "sys.stdout.buffer.write(r.SerializeToString())\n")
        done = subprocess.run([str(venv / "bin" / "python"), "-c", ask, f"127.0.0.1:{port}"], capture_output=True,
                              timeout=60, cwd=venv, env=clean_env())
        assert done.returncode == 0, done.stderr.decode()
        got = pb.PredictResponse.FromString(done.stdout)
        with Client(f"127.0.0.1:{reference.port}") as c:
            want = c.predict("rope", PROMPT, top_k=5, attention="last")
        assert len(got.top) == 5 and got.attention and got.tokens
        for r in (got, want):
            r.ClearField("timing")
        assert got == want
    finally:
        reference.stop(grace=0)
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    reader.join(10)
    assert proc.returncode == 0, "".join(log)  # SIGTERM: drained and stopped
