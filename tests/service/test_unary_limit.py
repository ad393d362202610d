"""--workers bounds the unary calls running at once; Generate streams, health checks and reflection do not wait for
those slots (a stream holds its thread until its last token, so the pool has room for --max-streams of them)."""

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos.posenc.v1 import posenc_pb2 as pb
from protos.posenc.v1 import posenc_pb2_grpc
from tests.serving import start


def test_unary_calls_beyond_workers_wait_while_streams_and_health_go_on(tiny_artifacts):
    root, _ = tiny_artifacts
    srv = start(root, workers=2)
    lock, inside, release = threading.Lock(), [0, 0], threading.Event()  # now, peak
    predict = srv.ops.predict

    def held(*args, **kwargs):
        with lock:
            inside[0] += 1
            inside[1] = max(inside[1], inside[0])
        try:
            release.wait(30)
            return predict(*args, **kwargs)
        finally:
            with lock:
                inside[0] -= 1

    srv.ops.predict = held
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
