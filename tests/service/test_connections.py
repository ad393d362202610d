"""--max-connection-age-seconds: clients are asked to reconnect (and so re-resolve their target) while a call in
flight may finish."""

import threading
import time

import grpc

from protos.posenc.v1 import posenc_pb2 as pb
from protos.posenc.v1 import posenc_pb2_grpc
from tests.serving import slow_runs, start


def test_connections_are_recycled_after_their_age_and_calls_in_flight_finish(tiny_artifacts):
    root, _ = tiny_artifacts
    srv = start(root, max_connection_age_s=0.5)
    try:
        states = []
        with grpc.insecure_channel(f"127.0.0.1:{srv.port}") as ch:
            ch.subscribe(states.append, try_to_connect=True)
            stub = posenc_pb2_grpc.PosencStub(ch)
            slow_runs(srv.registry.engine("rope"), 0.05)
            # a stream that outlives the connection's age: the GOAWAY must not cut it
            msgs = list(stub.Generate(pb.GenerateRequest(model="rope", prompt=pb.Prompt(text="a"),
                                                         max_new_tokens=30), timeout=60))
            time.sleep(0.3)
            assert stub.ListModels(pb.ListModelsRequest(), timeout=10).models  # on a new connection
        first = states.index(grpc.ChannelConnectivity.READY)
        assert len(msgs) == 30 and msgs[-1].finish_reason == "length"
        # the connection was let go after its age (callbacks arrive asynchronously: the last READY may still be
        # on its way when the channel closes)
        assert any(s != grpc.ChannelConnectivity.READY for s in states[first:]), states
    finally:
        srv.stop(grace=1)


def test_no_recycling_by_default(tiny_artifacts):
    root, _ = tiny_artifacts
    srv = start(root)
    try:
        states, done = [], threading.Event()
        with grpc.insecure_channel(f"127.0.0.1:{srv.port}") as ch:
            ch.subscribe(states.append, try_to_connect=True)
            stub = posenc_pb2_grpc.PosencStub(ch)
            stub.ListModels(pb.ListModelsRequest(), timeout=10)
            time.sleep(1.0)
            stub.ListModels(pb.ListModelsRequest(), timeout=10)
            done.set()
        first = states.index(grpc.ChannelConnectivity.READY)
        assert all(s == grpc.ChannelConnectivity.READY for s in states[first:]), states
    finally:
        srv.stop(grace=1)
