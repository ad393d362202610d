"""--workers bounds the unary calls running at once and --max-queue those waiting for a slot (more are refused at
once); Generate streams, health checks and reflection do not wait for those slots, and no number of unary calls
takes their threads (a stream holds its thread until its last token, so the pool has room for --max-streams of
them beside the unary calls)."""

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos.posenc.v1 import posenc_pb2 as pb
from protos.posenc.v1 import posenc_pb2_grpc
from service.registry import Limits
from tests.serving import start


def hold_predicts(srv) -> tuple[list, threading.Event]:
    """Every Predict of the worker waits for the returned event (bounded) before it runs: ([calls inside now, peak],
    the event)."""
    lock, inside, release = threading.Lock(), [0, 0], threading.Event()
    predict = srv.ops.predict

    def held(*args, **kwargs):
        with lock:
            inside[0] += 1
            inside[1] = max(inside[1], inside[0])
        try:
            release.wait(60)
            return predict(*args, **kwargs)
        finally:
            with lock:
                inside[0] -= 1

    srv.ops.predict = held
    return inside, release


def test_unary_calls_beyond_workers_wait_while_streams_and_health_go_on(tiny_artifacts):
    root, _ = tiny_artifacts
    srv = start(root, workers=2)
    inside, release = hold_predicts(srv)  # inside: [now, peak]
    try:
        with grpc.insecure_channel(f"127.0.0.1:{srv.port}") as ch, ThreadPoolExecutor(6) as pool:
            stub = posenc_pb2_grpc.PosencStub(ch)
            calls = [pool.submit(stub.Predict, pb.PredictRequest(model="rope", prompt=pb.Prompt(text="ab")),
                                 timeout=60) for _ in range(6)]
            for _ in range(6000):  # both slots taken (bounded: 30 s on a busy machine)
                if inside[0] == 2:
                    break
                time.sleep(0.005)
            time.sleep(0.5)  # room for a third call to enter, were the limit not there
            assert inside == [2, 2]
            tokens = list(stub.Generate(pb.GenerateRequest(model="alibi", prompt=pb.Prompt(text="a"),
                                                           max_new_tokens=5), timeout=10))
            assert len(tokens) == 5 and tokens[-1].finish_reason == "length"
            status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10).status
            assert status == health_pb2.HealthCheckResponse.SERVING
            assert inside == [2, 2]  # the unary calls still wait
            release.set()
            assert all(c.result(timeout=60).top for c in calls)
        assert inside == [0, 2]
    finally:
        release.set()
        srv.stop(grace=1)


def test_surplus_unary_calls_are_refused_and_never_take_a_streams_thread(tiny_artifacts):
    """With --workers 2 running and --max-queue 2 waiting, 8 held Predicts leave 4 refused at once; a Generate
    stream then runs to its last token while all 4 accepted Predicts are still held."""
    root, _ = tiny_artifacts
    srv = start(root, workers=2, max_queue=2, limits=Limits(max_streams=2))
    inside, release = hold_predicts(srv)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{srv.port}") as ch, ThreadPoolExecutor(9) as pool:
            stub = posenc_pb2_grpc.PosencStub(ch)
            calls = [pool.submit(stub.Predict, pb.PredictRequest(model="rope", prompt=pb.Prompt(text="ab")),
                                 timeout=120) for _ in range(8)]
            refused = []
            for _ in range(6000):  # 2 running, and the calls past running and waiting answered (bounded: 60 s)
                refused = [c for c in calls if c.done()]
                if inside[0] == 2 and len(refused) == 4:
                    break
                time.sleep(0.01)
            assert inside[0] == 2 and len(refused) == 4, (inside, len(refused))
            for c in refused:
                assert c.exception().code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "busy" in c.exception().details()
            stream = pool.submit(lambda: list(stub.Generate(pb.GenerateRequest(
                model="alibi", prompt=pb.Prompt(text="a"), max_new_tokens=5), timeout=120)))
            tokens = stream.result(timeout=90)  # on a pool full of waiting unary calls it would wait for them
            assert len(tokens) == 5 and tokens[-1].finish_reason == "length"
            assert inside == [2, 2] and sum(not c.done() for c in calls) == 4  # the accepted calls are still held
            release.set()
            assert sum(c.exception() is None and bool(c.result(timeout=60).top) for c in calls) == 4
        assert srv.metrics.registry.get_sample_value("posenc_refusals_total",
                                                     {"transport": "grpc", "reason": "busy"}) == 4
    finally:
        release.set()
        srv.stop(grace=1)
