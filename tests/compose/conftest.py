"""The compose stack under test: tiny artifacts, `up -d`, healthy, and `down` whatever happens.

These tests need a Docker engine and the worker image; `make compose-test` (docker/compose-test.sh) provides both
and sets POSENC_COMPOSE_TEST=1.  Under plain `make test` this folder is not collected.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MODELS = ("rope", "alibi", "learned", "t5")
REPORT = ROOT / "build" / "compose-report.json"
DOWN_BOUND_S = 120.0  # compose down: how long the project's containers, network and volumes may take to go

if not os.environ.get("POSENC_COMPOSE_TEST"):
    collect_ignore_glob = ["test_*.py"]


def compose_command() -> list[str]:
    """docker compose v2 when the plugin is there, else Debian's docker-compose v1 (both read the same file)."""
    if os.environ.get("POSENC_COMPOSE"):
        return os.environ["POSENC_COMPOSE"].split()
    if subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0:
        return ["docker", "compose"]
    return ["docker-compose"]


def free_port_range(width: int) -> int:
    """A run of `width` free loopback ports (checked now; the stack binds them a moment later)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            first = s.getsockname()[1]
        if first + width > 65535:
            continue
        ok = True
        for port in range(first, first + width):
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    ok = False
                    break
        if ok:
            return first
    raise RuntimeError("no run of free loopback ports")


def docker(*args: str, check: bool = True, timeout: float = 120) -> str:
    out = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout)
    if check and out.returncode != 0:
        raise AssertionError(f"docker {' '.join(args)} failed ({out.returncode}): {out.stderr.strip()}")
    return out.stdout.strip()


@dataclass
class Stack:
    project: str
    image: str
    artifacts: Path
    env: dict[str, str]
    compose: list[str]
    report: dict = field(default_factory=dict)

    def run(self, *args: str, check: bool = True, timeout: float = 180) -> subprocess.CompletedProcess:
        cmd = [*self.compose, "-p", self.project, "-f", str(ROOT / "docker-compose.yml"), *args]
        out = subprocess.run(cmd, capture_output=True, text=True, env=self.env, cwd=ROOT, timeout=timeout)
        if check and out.returncode != 0:
            raise AssertionError(f"{' '.join(cmd)} failed ({out.returncode}):\n{out.stdout}\n{out.stderr}")
        return out

    def containers(self, service: str = "worker", all_: bool = False) -> list[str]:
        args = ["ps", "-q", "--filter", f"label=com.docker.compose.project={self.project}",
                "--filter", f"label=com.docker.compose.service={service}"]
        return docker(*args, *(["-a"] if all_ else [])).split()

    def inspect(self, container: str) -> dict:
        return json.loads(docker("inspect", container))[0]

    def health(self, container: str) -> str:
        return self.inspect(container)["State"].get("Health", {}).get("Status", "none")

    def wait_healthy(self, count: int = 1, timeout: float = 120) -> float:
        """Seconds until `count` worker containers report healthy."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            ids = self.containers()
            if len(ids) == count and all(self.health(c) == "healthy" for c in ids):
                return time.monotonic() - t0
            time.sleep(0.25)
        logs = self.run("logs", "--tail", "30", check=False).stdout
        raise AssertionError(f"{count} healthy worker(s) not reached in {timeout} s; logs:\n{logs}")

    def port(self, container: str, inside: str = "50051/tcp") -> int:
        bindings = self.inspect(container)["NetworkSettings"]["Ports"][inside]
        return int(bindings[0]["HostPort"])

    @property
    def network(self) -> str:
        return f"{self.project}_default"

    def leftovers(self) -> dict[str, list[str]]:
        label = f"label=com.docker.compose.project={self.project}"
        return {"containers": docker("ps", "-aq", "--filter", label).split(),
                "networks": docker("network", "ls", "-q", "--filter", label).split(),
                "volumes": docker("volume", "ls", "-q", "--filter", label).split()}


    def down(self, bound: float = DOWN_BOUND_S) -> dict[str, list[str]]:
        """`down -v --remove-orphans`, repeated once a second while a container, network or volume of the project
        is still there (a network a stopping container holds cannot go yet), for at most `bound` seconds; returns
        what is left then (nothing, normally).  Nothing is forced away: a leftover is the caller's failure."""
        deadline = time.monotonic() + bound
        tries = 0
        while True:
            self.run("down", "-v", "--remove-orphans", "--timeout", "30", check=False)
            tries += 1
            left = self.leftovers()
            if not any(left.values()) or time.monotonic() >= deadline:
                self.report.setdefault("down", []).append({"tries": tries, "left": left})
                return left
            time.sleep(1.0)


def build_artifacts(dest: Path) -> None:
    import torch

    from export.build import build_artifact
    from tests.model.helpers import tiny_model

    for variant in MODELS:
        build_artifact(tiny_model(variant), dest / variant, name=variant, opset=23,
                       source={"kind": "random", "preset": "tiny"}, training={}, force=False)
    torch.set_num_threads(2)


@pytest.fixture(scope="session")
def stack():
    image = os.environ.get("POSENC_IMAGE", "posenc-worker:test")
    docker("image", "inspect", image)  # built by docker/compose-test.sh
    # The container runs as uid 10001: the artifacts live under build/ (not pytest's 0700 temp root).
    (ROOT / "build").mkdir(exist_ok=True)
    artifacts = Path(tempfile.mkdtemp(prefix="compose-artifacts-", dir=ROOT / "build"))
    artifacts.chmod(0o755)
    build_artifacts(artifacts)
    first = free_port_range(8)  # gRPC on the first four, HTTP on the next four (replicas each take one)
    env = dict(os.environ, POSENC_IMAGE=image, POSENC_ARTIFACTS=str(artifacts),
               POSENC_PUBLISH=f"127.0.0.1:{first}-{first + 3}",
               POSENC_HTTP_PUBLISH=f"127.0.0.1:{first + 4}-{first + 7}", POSENC_THREADS="1",
               POSENC_MAX_NEW_TOKENS="4096")
    s = Stack(f"posencct{os.getpid()}", image, artifacts, env, compose_command())
    s.report.update(compose=" ".join(s.compose), image=image, base_image=os.environ.get("POSENC_BASE_IMAGE", ""))
    s.report["image_size_mb"] = round(json.loads(docker("image", "inspect", image))[0]["Size"] / 1e6, 1)
    try:
        t0 = time.monotonic()
        s.run("up", "-d", "--no-build")
        s.report["up_to_healthy_s"] = round(time.monotonic() - t0 + s.wait_healthy(), 2)
        yield s
    finally:
        s.report["left_behind"] = s.down()
        shutil.rmtree(artifacts, ignore_errors=True)
        REPORT.write_text(json.dumps(s.report, indent=2) + "\n")
        print(f"\ncompose report ({REPORT.relative_to(ROOT)}): {json.dumps(s.report)}")
