"""The client side of scale: a list of targets spread round-robin, one retry of idempotent calls on UNAVAILABLE
(a draining replica), never a retried Generate."""

import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from client.api import Client
from client.channel import ChannelError, channel_for, instance_of, resolve
from protos.posenc.v1 import posenc_pb2 as pb
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
