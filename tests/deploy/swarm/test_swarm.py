"""deploy/swarm/stack.yml on a real single-node swarm (make swarm-test), under a steady load of Predict and Generate.

Order matters: deploy and healthy (fixture), spread over the replicas, a rolling update to a new image tag, an
update to a broken setting that Swarm rolls back, a replica killed, scale to one and back.  During each step a
client on the stack's overlay network (tests/deploy/swarm/load.py) sends calls over every replica and compares
every answer with the answer to the same request before the step.  Times are measured and reported, never asserted.
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import time

from tests.deploy.swarm.conftest import MODELS, REPLICAS, ROOT, docker, summary


def died_at(info: dict) -> float:
    stamp = info["State"]["FinishedAt"]  # RFC 3339 with nanoseconds, UTC
    return datetime.datetime.fromisoformat(stamp[:26].rstrip("Z")).replace(tzinfo=datetime.UTC).timestamp()


def failures(calls: list[dict]) -> list[tuple]:
    return [(c["rpc"], c["code"], c.get("details"), c["retried"], c["t0"], c["t1"]) for c in calls
            if c["code"] != "OK"][:10]


def task_images(swarm) -> set[str]:
    return {swarm.inspect(c)["Config"]["Image"] for c in swarm.containers()}


def test_replicas_are_healthy_and_share_calls_over_dns_round_robin(swarm):
    spec = swarm.service_spec()["Spec"]
    assert spec["EndpointSpec"]["Mode"] == "dnsrr"
    assert spec["UpdateConfig"]["Order"] == "start-first" and spec["UpdateConfig"]["FailureAction"] == "rollback"
    containers = swarm.containers(healthy=True)
    assert len(containers) == REPLICAS
    for c in containers:
        info = swarm.inspect(c)
        assert info["HostConfig"]["ReadonlyRootfs"] is True
        assert {m["Destination"]: m["RW"] for m in info["Mounts"]}["/models"] is False
    load = swarm.load()
    load.wait_calls(60)
    calls = load.stop()
    s = summary(calls)
    hostnames = {swarm.inspect(c)["Config"]["Hostname"] for c in containers}
    assert s["failed"] == 0 and s["not_equal"] == 0, s
    assert {c["instance"] for c in calls} == hostnames  # every replica answers
    usage = docker("stats", "--no-stream", "--format", "{{.MemUsage}}", *containers).splitlines()
    swarm.report["steady"] = {**s, "replica_memory": [u.split(" / ")[0] for u in usage]}


def test_rolling_update_under_load_fails_no_call_and_changes_no_answer(swarm):
    new_image = f"{swarm.image.rsplit(':', 1)[0]}:swarm-rolled"
    docker("tag", swarm.image, new_image)
    before = {swarm.inspect(c)["Config"]["Hostname"] for c in swarm.containers()}
    load = swarm.load()
    load.wait_calls(40)
    t0 = time.monotonic()
    swarm.deploy(image=new_image)  # the same stack file with a new tag: Swarm rolls one task at a time
    state = swarm.wait_update()
    rolled_s = time.monotonic() - t0
    swarm.wait_healthy()
    load.wait_calls(len(load.calls) + 40)  # and the new replicas keep answering
    calls = load.stop()
    s = summary(calls)
    assert state == "completed", state
    assert task_images(swarm) == {new_image}
    after = {swarm.inspect(c)["Config"]["Hostname"] for c in swarm.containers()}
    assert not before & after and len(after) == REPLICAS
    assert s["failed"] == 0, failures(calls)
    assert s["not_equal"] == 0
    answered = {c["instance"] for c in calls}
    assert before & answered and after & answered  # the load really ran across the update
    swarm.report["rolling_update"] = {"seconds": round(rolled_s, 2), **s,
                                      "old_replicas_answering": len(before & answered),
                                      "new_replicas_answering": len(after & answered)}
    swarm.image = new_image


def test_an_update_whose_tasks_cannot_start_is_rolled_back_under_load(swarm):
    before = {swarm.inspect(c)["Config"]["Hostname"] for c in swarm.containers()}
    load = swarm.load()
    load.wait_calls(40)
    t0 = time.monotonic()
    # A certificate without a key: the worker refuses to start (exit 2), so no new task ever becomes healthy.
    swarm.deploy(POSENC_TLS_CERT="/models/missing.pem")
    state = swarm.wait_update()
    seconds = time.monotonic() - t0
    swarm.wait_healthy()
    calls = load.stop()
    s = summary(calls)
    assert state == "rollback_completed", state
    env = swarm.service_spec()["Spec"]["TaskTemplate"]["ContainerSpec"].get("Env", [])
    assert "POSENC_TLS_CERT=" in env  # the previous spec: no certificate
    assert {swarm.inspect(c)["Config"]["Hostname"] for c in swarm.containers()} == before  # start-first: untouched
    assert s["failed"] == 0 and s["not_equal"] == 0, failures(calls)
    swarm.report["failed_update_rolled_back"] = {"seconds": round(seconds, 2), **s}


def test_a_killed_replica_costs_at_most_its_in_flight_calls_and_comes_back(swarm):
    load = swarm.load()
    load.wait_calls(40)
    victim = swarm.containers()[0]
    hostname = swarm.inspect(victim)["Config"]["Hostname"]
    t_before = time.time()
    docker("kill", victim)  # SIGKILL: what the OOM killer or a crash does, no drain
    t0 = time.monotonic()
    swarm.wait_healthy()
    back_s = time.monotonic() - t0
    # The process died between t_before and the engine's record of its end (FinishedAt, a little later).
    t_kill = died_at(swarm.inspect(victim))
    load.wait_calls(len(load.calls) + 40)
    calls = load.stop()
    s = summary(calls)
    assert victim not in swarm.containers()  # a new task replaced it
    in_flight = [c for c in calls if c["t0"] <= t_kill and c["t1"] >= t_before]
    failed = [c for c in calls if c["code"] != "OK"]
    resent = [c for c in calls if c["retried"]]  # refused before any answer (the connection died) and sent again
    assert len(failed) <= len(in_flight) and all(c["t0"] <= t_kill for c in failed), (
        [(c["rpc"], c["code"], c.get("details"), c["t0"] - t_kill, c["t1"] - t_kill) for c in failed],
        len(in_flight), t_kill - t_before)
    assert s["not_equal"] == 0
    after = [c for c in calls if c["t0"] > t_kill]
    assert after and all(c["code"] == "OK" and c["instance"] != hostname for c in after)
    swarm.report["replica_killed"] = {
        **s, "in_flight_at_kill": len(in_flight), "kill_to_recorded_death_s": round(t_kill - t_before, 3),
        # How long after the death calls still went to the dead replica (and were sent again elsewhere).
        "failover_s": round(max([c["t0"] - t_kill for c in resent + failed] + [0.0]), 3),
        "kill_to_replica_healthy_s": round(back_s, 2)}


def connection_age(swarm) -> float:
    env = dict(e.split("=", 1) for e in swarm.service_spec()["Spec"]["TaskTemplate"]["ContainerSpec"].get("Env", []))
    return float(env.get("POSENC_MAX_CONNECTION_AGE_SECONDS") or 0)


def test_scale_to_one_and_back_to_three_under_load_rebalances(swarm):
    """After 3 -> 1 -> 3 the client's connections are all to the one replica left.  The stack's connection age
    (POSENC_MAX_CONNECTION_AGE_SECONDS) makes that replica send GOAWAY; the client channel re-resolves the name and
    spreads over all three: within two ages (+ margin) of the scale-up being healthy every replica answers, and no
    call fails while connections are recycled."""
    age = connection_age(swarm)
    assert age > 0, "the stack must age connections out, or a scale-up never gets traffic"
    bound = 2 * age + 20
    load = swarm.load(max_seconds=300 + bound)
    load.wait_calls(40)
    t0 = time.monotonic()
    docker("service", "scale", "--detach=true", f"{swarm.service}=1")
    swarm.wait_healthy(1)
    down_s = time.monotonic() - t0
    load.wait_calls(len(load.calls) + 40)
    t1 = time.monotonic()
    docker("service", "scale", "--detach=true", f"{swarm.service}={REPLICAS}")
    swarm.wait_healthy(REPLICAS)
    up_s = time.monotonic() - t1
    t_healthy = time.time()
    hostnames = {swarm.inspect(c)["Config"]["Hostname"] for c in swarm.containers()}

    def answering() -> dict[str, float]:
        first: dict[str, float] = {}
        for c in list(load.calls):
            if c["code"] == "OK" and c["t1"] >= t_healthy and c["instance"] not in first:
                first[c["instance"]] = c["t1"] - t_healthy
        return first

    deadline = time.monotonic() + bound
    while set(answering()) != hostnames and time.monotonic() < deadline and not load.ended.is_set():
        time.sleep(0.5)
    first = answering()
    load.wait_calls(len(load.calls) + 40)
    calls = load.stop()
    s = summary(calls)
    swarm.report["scale_1_and_back"] = {
        **s, "down_to_1_s": round(down_s, 2), "up_to_3_healthy_s": round(up_s, 2), "max_connection_age_s": age,
        "replicas_answering_after_scale_up": len(first),
        "healthy_to_all_answering_s": round(max(first.values()), 2) if set(first) == hostnames else None,
        "first_answer_after_healthy_s": {k: round(v, 2) for k, v in sorted(first.items())}}
    assert s["failed"] == 0 and s["not_equal"] == 0, failures(calls)
    assert set(first) == hostnames and len(hostnames) == REPLICAS, (first, hostnames, bound)


def test_calls_per_second_with_one_two_and_three_replicas(swarm):
    """What more replicas on this machine's cores buy: the same closed-loop load (8 callers, no pause) against 1, 2
    and 3 replicas, a fresh client each time so it resolves every replica.  Reported, not asserted."""
    rates = {}
    for n in (1, 2, REPLICAS):
        docker("service", "scale", "--detach=true", f"{swarm.service}={n}")
        swarm.wait_healthy(n)
        load = swarm.load(concurrency=8, pause_ms=0)
        load.wait_calls(50)
        time.sleep(8)
        calls = [c for c in load.stop() if c["code"] == "OK"]
        calls = calls[len(calls) // 10:]  # past the first connections
        seconds = max(c["t1"] for c in calls) - min(c["t0"] for c in calls)
        assert len({c["instance"] for c in calls}) == n
        rates[str(n)] = round(len(calls) / seconds, 1)
    swarm.report["calls_per_s_by_replicas"] = rates


VERIFY = """
import hashlib, json, pathlib
root = pathlib.Path("/models")
for manifest in sorted(root.glob("*/manifest.json")):
    for name, entry in json.loads(manifest.read_text())["files"].items():
        data = (manifest.parent / name).read_bytes()
        assert hashlib.sha256(data).hexdigest() == entry["sha256"], name
print(json.dumps(sorted(p.parent.name for p in root.glob("*/manifest.json"))))
"""


def test_the_artifacts_image_fills_a_volume_a_worker_serves_read_only(swarm):
    """deploy/k8s's init container on this engine: docker/build-artifacts-image.sh, the copy as uid 10001 with a
    read-only root file system into a fresh volume, then a worker serving that volume mounted read-only."""
    tag, volume = f"posenc-artifacts:{swarm.name}", f"{swarm.name}-models"
    out = subprocess.run([str(ROOT / "docker" / "build-artifacts-image.sh"), str(swarm.artifacts), tag],
                         capture_output=True, text=True, timeout=300, env={**os.environ, "POSENC_IMAGE": swarm.image})
    assert out.returncode == 0, out.stderr
    worker = None
    try:
        docker("run", "--rm", "--read-only", "--user", "10001:10001", "--network", "none", "-v",
               f"{volume}:/models", tag)
        listed = docker("run", "--rm", "--network", "none", "-v", f"{volume}:/models:ro", "--entrypoint", "python",
                        swarm.image, "-c", VERIFY)
        assert json.loads(listed) == sorted(MODELS)
        worker = docker("run", "-d", "--read-only", "--tmpfs", "/tmp", "--network", "none", "-v",
                        f"{volume}:/models:ro", swarm.image)
        deadline = time.monotonic() + 120
        while docker("inspect", "-f", "{{.State.Health.Status}}", worker) != "healthy":
            assert time.monotonic() < deadline, docker("logs", worker, check=False)
            time.sleep(0.5)
        logs = subprocess.run(["docker", "logs", worker], capture_output=True, text=True, timeout=30)
        assert "posenc serving alibi, rope" in logs.stdout + logs.stderr
    finally:
        if worker:
            docker("rm", "-f", worker, check=False)
        docker("volume", "rm", "-f", volume, check=False)
        docker("image", "rm", tag, check=False)


def test_stack_rm_leaves_nothing(swarm):
    """Within REMOVE_BOUND_S, the services, the containers and the overlay network are all gone (the removal is
    repeated while a stopping task still holds the network; nothing is forced)."""
    assert docker("service", "ls", "-q", "--filter", f"name={swarm.service}")  # there was something to remove
    t0 = time.monotonic()
    assert swarm.remove() == {"services": [], "containers": [], "networks": []}
    swarm.report["stack_rm_s"] = round(time.monotonic() - t0, 2)
    assert swarm.remove(bound=0) == {"services": [], "containers": [], "networks": []}  # and it stays so
