"""The client side of scale: a list of targets spread round-robin, one retry of idempotent calls on UNAVAILABLE
(a draining replica), never a retried Generate, and replicas added behind a DNS name found once the worker ages
connections out."""

import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest

from client.api import Client
from client.channel import ChannelError, channel_for, instance_of, resolve
from protos.posenc.v1 import posenc_pb2 as pb
from service.server import Server, Settings
from tests.client.fakedns import FakeDNS
from tests.serving import start

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def replicas(tiny_artifacts):
    root, _ = tiny_artifacts
    servers = [start(root, instance=f"replica-{i}") for i in range(2)]
    yield servers
    for s in servers:
        s.stop(grace=1)


def targets(replicas, host="127.0.0.1"):
    return ",".join(f"{host}:{s.port}" for s in replicas)


def test_a_target_list_resolves_to_one_round_robin_target():
    assert resolve("127.0.0.1:1,localhost:2") == ("ipv4:127.0.0.1:1,127.0.0.1:2", "round_robin")
    assert resolve("dns:///posenc:50051") == ("dns:///posenc:50051", None)
    for bad in ("", "127.0.0.1:1,nohost", "127.0.0.1:1,host:port"):
        with pytest.raises(ChannelError):
            resolve(bad)


def test_calls_spread_over_every_target(replicas):
    with channel_for(targets(replicas, "localhost")) as ch:
        c = Client(channel=ch)
        seen = []
        for _ in range(40):
            _, call = c.stub.ListModels.with_call(pb.ListModelsRequest(), timeout=10)
            seen.append(instance_of(call))
            if len(set(seen)) == 2 and len(seen) >= 8:
                break
        assert set(seen) == {"replica-0", "replica-1"}


def test_idempotent_calls_retry_once_on_a_draining_replica_and_generate_never(replicas):
    draining = replicas[0]
    try:
        with channel_for(targets(replicas)) as ch:
            c = Client(channel=ch)
            # Both replicas connected first: round-robin picks only among ready connections, so on a busy machine
            # a retry in the channel's first moments could land on the draining replica again.
            seen = set()
            for _ in range(50):
                _, call = c.stub.Predict.with_call(pb.PredictRequest(model="rope", prompt=pb.Prompt(text="ab")),
                                                   timeout=10)
                seen.add(instance_of(call))
                if len(seen) == len(replicas):
                    break
            assert len(seen) == len(replicas), seen
            draining.registry.shutting_down = True  # answers UNAVAILABLE from the application, as while it drains
            for _ in range(6):  # round-robin lands on the draining replica every other call
                resp, call = c.stub.Predict.with_call(pb.PredictRequest(model="rope", prompt=pb.Prompt(text="ab")),
                                                      timeout=10)
                assert resp.top and instance_of(call) == "replica-1"
            codes = set()
            for _ in range(6):
                try:
                    list(c.generate("rope", "ab", max_new_tokens=2))
                    codes.add("OK")
                except grpc.RpcError as err:
                    codes.add(err.code().name)
            assert codes == {"OK", "UNAVAILABLE"}  # a stream is never replayed on another replica
        with channel_for(targets(replicas), retries=False) as ch:
            failures = 0
            for _ in range(6):
                try:
                    Client(channel=ch).predict("rope", "ab")
                except grpc.RpcError as err:
                    failures += err.code() == grpc.StatusCode.UNAVAILABLE
            assert failures > 0  # without the retry policy the draining replica's answer reaches the caller
    finally:
        draining.registry.shutting_down = False


def test_the_cli_takes_a_target_list(replicas):
    out = subprocess.run([sys.executable, "-m", "client", "--target", targets(replicas), "list"],
                         capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 0 and "rope" in out.stdout, out.stderr
    bad = subprocess.run([sys.executable, "-m", "client", "--target", "127.0.0.1:1,nohost", "list"],
                         capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1, bad.stderr


def _grow(root, age: float, seconds: float) -> tuple[dict[str, float], int, int]:
    """One replica on 127.0.0.1 behind a DNS name, a round-robin client channel (client.channel) calling it from
    four threads, then two more replicas on 127.0.0.2 and .3 (same port) added to the DNS answer: the first time
    each replica answered after that, in seconds (those within `seconds`), the calls that failed, and the calls."""
    first = start(root, instance="replica-1", max_connection_age_s=age)
    servers = [first]
    dns = FakeDNS(["127.0.0.1"])
    stop, lock = threading.Event(), threading.Lock()
    seen: dict[str, float] = {}
    counts = {"failed": 0, "calls": 0}
    t_added = [None]
    try:
        with channel_for(f"dns://127.0.0.1:{dns.port}/replicas.test:{first.port}", lb="round_robin") as ch:
            stub = Client(channel=ch).stub

            def caller():
                while not stop.is_set():
                    try:
                        _, call = stub.Predict.with_call(pb.PredictRequest(model="rope", prompt=pb.Prompt(text="ab")),
                                                         timeout=10)
                        who, failed = instance_of(call), 0
                    except grpc.RpcError:
                        who, failed = None, 1
                    with lock:
                        counts["failed"] += failed
                        counts["calls"] += 1
                        if who and t_added[0] is not None and who not in seen:
                            seen[who] = time.monotonic() - t_added[0]
                    time.sleep(0.005)

            threads = [threading.Thread(target=caller) for _ in range(4)]
            for t in threads:
                t.start()
            while counts["calls"] < 20:
                time.sleep(0.01)
            for i in (2, 3):
                servers.append(Server(Settings(model_dir=root, host=f"127.0.0.{i}", port=first.port, threads=1,
                                               metrics_port=-1, http_port=-1, instance=f"replica-{i}",
                                               max_connection_age_s=age)).start())
            with lock:
                t_added[0] = time.monotonic()
                dns.addresses = ["127.0.0.1", "127.0.0.2", "127.0.0.3"]
            deadline = time.monotonic() + seconds
            while len(seen) < 3 and time.monotonic() < deadline:
                time.sleep(0.05)
            stop.set()
            for t in threads:
                t.join(timeout=30)
    finally:
        stop.set()
        dns.close()
        for s in servers:
            s.stop(grace=1)
    return seen, counts["failed"], counts["calls"]


def test_a_client_spreads_over_replicas_added_behind_its_dns_name_once_connections_age(tiny_artifacts):
    """--max-connection-age-seconds sends GOAWAY; the client channel then re-resolves its dns:/// name and
    connects to every address (round_robin): replicas added after it connected get calls within a few ages, and
    no call fails while connections are recycled."""
    root, _ = tiny_artifacts
    seen, failed, calls = _grow(root, age=1.0, seconds=15)
    assert set(seen) == {"replica-1", "replica-2", "replica-3"}, (seen, calls)
    assert max(seen.values()) < 15 and failed == 0 and calls > 50, (seen, failed, calls)


def test_without_a_connection_age_the_client_keeps_its_first_replica(tiny_artifacts):
    """The control: nothing makes a healthy connection go, so the name is never resolved again."""
    root, _ = tiny_artifacts
    seen, failed, calls = _grow(root, age=0.0, seconds=3)
    assert set(seen) == {"replica-1"} and failed == 0 and calls > 50, (seen, failed, calls)
