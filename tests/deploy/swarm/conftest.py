"""The Swarm stack under test: a single-node swarm on this machine, deploy/swarm/stack.yml on tiny artifacts.

These tests need a Docker engine and the worker image; `make swarm-test` (docker/swarm-test.sh) provides both and
sets POSENC_SWARM_TEST=1.  Under plain `make test` this folder is not collected.  The fixture initialises swarm
mode when the engine is not in a swarm already, and at the end removes the stack, its network and the artifacts and
leaves the swarm it started, whatever happened.  Figures go to bench/results/swarm.json.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import queue
import shutil
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
STACK_FILE = ROOT / "deploy" / "swarm" / "stack.yml"
LOAD = Path(__file__).with_name("load.py")
# A test run writes its figures under build/ (ignored); POSENC_SWARM_REPORT=bench/results/swarm.json (the
# results file the docs read) is for a run meant to record them.
REPORT = Path(os.environ.get("POSENC_SWARM_REPORT") or ROOT / "build" / "swarm-report.json")
MODELS = ("rope", "alibi")
REPLICAS = 3
CLIENT_IMAGE = os.environ.get("POSENC_CLIENT_IMAGE", "posenc-client:latest")
REMOVE_BOUND_S = 120.0  # docker stack rm: how long the stack's tasks and network may take to go

if not os.environ.get("POSENC_SWARM_TEST"):
    collect_ignore_glob = ["test_*.py"]


def docker(*args: str, check: bool = True, timeout: float = 120, env: dict | None = None) -> str:
    out = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout, env=env)
    if check and out.returncode != 0:
        raise AssertionError(f"docker {' '.join(args)} failed ({out.returncode}): {out.stderr.strip()}")
    return out.stdout.strip()


def detach_flag() -> list[str]:
    """`--detach=true` where the CLI has it (26 and later, whose default may become waiting); older CLIs, such as
    Debian's docker.io 20.10, always return at once and do not know the flag."""
    out = subprocess.run(["docker", "stack", "deploy", "--help"], capture_output=True, text=True, timeout=30)
    return ["--detach=true"] if "--detach" in out.stdout else []


DETACH = detach_flag() if os.environ.get("POSENC_SWARM_TEST") else []


@dataclass
class Swarm:
    name: str
    image: str
    artifacts: Path
    report: dict = field(default_factory=dict)

    @property
    def service(self) -> str:
        return f"{self.name}_worker"

    @property
    def network(self) -> str:
        return f"{self.name}_posenc"

    def deploy(self, image: str | None = None, **settings: str) -> None:
        """docker stack deploy of deploy/swarm/stack.yml; a second call updates the service in place."""
        env = {**os.environ, "POSENC_IMAGE": image or self.image, "POSENC_ARTIFACTS": str(self.artifacts),
               "POSENC_THREADS": "1", **settings}
        docker("stack", "deploy", "--resolve-image", "never", *DETACH, "-c", str(STACK_FILE), self.name, env=env)

    def containers(self, healthy: bool = False) -> list[str]:
        args = ["ps", "-q", "--filter", f"label=com.docker.swarm.service.name={self.service}"]
        return docker(*args, *(["--filter", "health=healthy"] if healthy else [])).split()

    def inspect(self, container: str) -> dict:
        return json.loads(docker("inspect", container))[0]

    def service_spec(self) -> dict:
        return json.loads(docker("service", "inspect", self.service))[0]

    def wait_healthy(self, count: int = REPLICAS, timeout: float = 180) -> float:
        """Seconds until exactly `count` worker containers run and all are healthy."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            running = self.containers()
            if len(running) == count and len(self.containers(healthy=True)) == count:
                return time.monotonic() - t0
            time.sleep(0.2)
        tasks = docker("service", "ps", "--no-trunc", self.service, check=False)
        raise AssertionError(f"{count} healthy replicas not reached in {timeout} s:\n{tasks}")

    def wait_update(self, timeout: float = 300) -> str:
        """The service's UpdateStatus.State once the update has ended (completed, rollback_completed, ...)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            state = self.service_spec().get("UpdateStatus", {}).get("State", "")
            if state in ("completed", "rollback_completed", "paused", "rollback_paused"):
                return state
            time.sleep(0.25)
        raise AssertionError(f"the update did not end in {timeout} s:\n{docker('service', 'ps', self.service)}")

    def load(self, **kwargs) -> LoadClient:
        return LoadClient(self, **kwargs)

    def leftovers(self) -> dict[str, list[str]]:
        label = f"label=com.docker.stack.namespace={self.name}"
        return {"services": docker("service", "ls", "-q", "--filter", label, check=False).split(),
                "containers": docker("ps", "-aq", "--filter", label).split(),
                "networks": docker("network", "ls", "-q", "--filter", label).split()}

    def remove(self, bound: float = REMOVE_BOUND_S) -> dict[str, list[str]]:
        """docker stack rm, then wait until the stack's services, containers and networks are gone, for at most
        `bound` seconds; returns what is left then (nothing, normally).  `docker stack rm` returns while the tasks
        are still stopping, and its network removal fails ("network ... is in use by task") when a task outlives
        it: the command is repeated, once a second, until the networks are gone too.  Nothing is forced away: a
        leftover after the bound is a failure of whoever calls this."""
        deadline = time.monotonic() + bound
        tries = 0
        while True:
            left = self.leftovers()
            if not any(left.values()) or time.monotonic() >= deadline:
                self.report.setdefault("stack_rm", []).append({"tries": tries, "left": left})
                return left
            if tries == 0 or left["services"] or (left["networks"] and not left["containers"]):
                docker("stack", "rm", self.name, check=False)
                tries += 1
            time.sleep(1.0)


class LoadClient:
    """tests/deploy/swarm/load.py in a container of the client image (client/ beside the worker's runtime, built
with it by docker/build-image.sh) on the stack's overlay network; its calls as they finish."""

    def __init__(self, swarm: Swarm, concurrency: int = 4, max_seconds: float = 300, pause_ms: float = 10):
        self.name = f"{swarm.name}-load-{time.monotonic_ns()}"
        cmd = ["docker", "run", "--rm", "-i", "--name", self.name, "--network", swarm.network,
               "-e", "PYTHONPATH=/app", "-v", f"{LOAD}:/drive/load.py:ro", "--entrypoint", "python", CLIENT_IMAGE,
               "/drive/load.py", "--target", f"dns:///{swarm.service}:50051", "--concurrency", str(concurrency),
               "--max-seconds", str(max_seconds), "--pause-ms", str(pause_ms)]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True)
        self.lines: queue.Queue = queue.Queue()
        self.calls: list[dict] = []
        self.ended = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()
        ready = self._next(timeout=120)
        assert ready.get("event") == "ready", ready

    def _read(self) -> None:
        for line in self.proc.stdout:
            record = json.loads(line)
            if record["event"] == "call":
                self.calls.append(record)
            else:
                self.lines.put(record)
        self.ended.set()
        self.lines.put({"event": "eof", "stderr": self.proc.stderr.read()[-3000:]})

    def _next(self, timeout: float) -> dict:
        try:
            return self.lines.get(timeout=timeout)
        except queue.Empty:
            self.proc.kill()
            raise AssertionError("the load client did not answer in time") from None

    def wait_calls(self, n: int, timeout: float = 60) -> None:
        """Until at least n calls have finished (the load is flowing)."""
        deadline = time.monotonic() + timeout
        while len(self.calls) < n:
            assert time.monotonic() < deadline and not self.ended.is_set(), "the load client stalled"
            time.sleep(0.1)

    def stop(self) -> list[dict]:
        self.proc.stdin.write("stop\n")
        self.proc.stdin.close()
        done = self._next(timeout=120)
        assert done.get("event") == "done", done
        self.proc.wait(timeout=60)
        return list(self.calls)


def summary(calls: list[dict]) -> dict:
    failed = [c for c in calls if c["code"] != "OK"]
    return {"requests": len(calls), "failed": len(failed),
            "failed_codes": sorted({c["code"] for c in failed}),
            "not_equal": sum(1 for c in calls if c["code"] == "OK" and not c["equal"]),
            "resent_after_refusal": sum(1 for c in calls if c["retried"]),
            "refusals": sorted({d for c in calls for d in c["retried"]}),
            "by_rpc": {rpc: sum(1 for c in calls if c["rpc"] == rpc) for rpc in ("Predict", "Generate")},
            "replicas_answering": len({c["instance"] for c in calls if c["instance"]})}


def build_artifacts(dest: Path) -> None:
    import torch

    from export.build import build_artifact
    from tests.model.helpers import tiny_model

    for variant in MODELS:
        build_artifact(tiny_model(variant), dest / variant, name=variant, opset=23,
                       source={"kind": "random", "preset": "tiny"}, training={}, force=False)
    torch.set_num_threads(2)


@pytest.fixture(scope="session")
def swarm():
    image = os.environ.get("POSENC_IMAGE", "posenc-worker:test")
    docker("image", "inspect", image)  # built by docker/swarm-test.sh
    t_start = time.monotonic()
    state = docker("info", "--format", "{{.Swarm.LocalNodeState}}")
    started_swarm = state == "inactive"
    if started_swarm:
        out = subprocess.run(["docker", "swarm", "init", "--advertise-addr", "127.0.0.1"], capture_output=True,
                             text=True, timeout=60)
        assert out.returncode == 0, f"swarm mode does not start on this machine: {out.stderr.strip()}"
    (ROOT / "build").mkdir(exist_ok=True)
    # The container runs as uid 10001: the artifacts live under build/ (not pytest's 0700 temp root).
    artifacts = Path(tempfile.mkdtemp(prefix="swarm-artifacts-", dir=ROOT / "build"))
    artifacts.chmod(0o755)
    s = Swarm(f"posencst{os.getpid()}", image, artifacts)
    s.report.update(machine={"platform": platform.platform(), "cpus": os.cpu_count()},
                    docker=docker("version", "--format", "{{.Server.Version}}"), image=image,
                    base_image=os.environ.get("POSENC_BASE_IMAGE", ""), replicas=REPLICAS, models=list(MODELS),
                    swarm_started_by_test=started_swarm)
    try:
        build_artifacts(artifacts)
        t0 = time.monotonic()
        s.deploy()
        s.report["deploy_to_healthy_s"] = round(time.monotonic() - t0 + s.wait_healthy(), 2)
        yield s
    finally:
        s.report["left_behind"] = s.remove()
        if started_swarm:
            docker("swarm", "leave", "--force", check=False, timeout=60)
        shutil.rmtree(artifacts, ignore_errors=True)
        s.report["total_s"] = round(time.monotonic() - t_start, 1)
        write_report(s.report)


STEPS = (("steady", "3 replicas, steady", None), ("rolling_update", "rolling update, start-first", "seconds"),
         ("failed_update_rolled_back", "update to a broken setting, until rolled back", "seconds"),
         ("replica_killed", "one replica SIGKILLed, until a replacement is healthy", "kill_to_replica_healthy_s"),
         ("scale_1_and_back", "scale to 1, then back to 3 healthy", "up_to_3_healthy_s"))


def write_report(report: dict) -> None:
    """The report in the results convention (meta, tables, then every figure), written atomically."""
    steps = [[label, report[key].get(time_key, "") if time_key else "", report[key]["requests"],
              report[key]["failed"], report[key]["resent_after_refusal"], report[key]["replicas_answering"]]
             for key, label, time_key in STEPS if key in report]
    meta = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "machine": f"{platform.platform()}, {os.cpu_count()} CPUs", "load": list(os.getloadavg()),
            "command": "POSENC_SWARM_REPORT=bench/results/swarm.json make swarm-test"}
    out = {"meta": meta, "tables": {"steps": {
        "columns": ["step", "seconds", "calls", "failed", "resent", "replicas answering"], "rows": steps}}}
    if "scale_1_and_back" in report:
        scale = report["scale_1_and_back"]
        out["tables"]["rebalance"] = {
            "columns": ["max connection age (s)", "scale-up to healthy (s)", "healthy to all 3 answering (s)",
                        "calls", "failed"],
            "rows": [[scale.get("max_connection_age_s"), scale.get("up_to_3_healthy_s"),
                      scale.get("healthy_to_all_answering_s"), scale.get("requests"), scale.get("failed")]]}
    if "calls_per_s_by_replicas" in report:
        out["tables"]["throughput"] = {"columns": ["replicas", "closed-loop calls/s"],
                                       "rows": [[int(n), r] for n, r in report["calls_per_s_by_replicas"].items()]}
    out.update(report)
    REPORT.parent.mkdir(parents=True, exist_ok=True)
    tmp = REPORT.with_suffix(".tmp")
    tmp.write_text(json.dumps(out, indent=2) + "\n")
    tmp.replace(REPORT)
    print(f"\nswarm report ({REPORT}): {json.dumps(report)}")
