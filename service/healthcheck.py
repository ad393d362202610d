"""python -m service.healthcheck [--target HOST:PORT] [--service NAME]: exit 0 when grpc.health.v1 says SERVING.

The container HEALTHCHECK and the compose healthcheck run this: it needs only grpcio and grpcio-health-checking,
imports nothing of the worker, and gives up after --timeout seconds so a wedged worker reads as unhealthy."""

from __future__ import annotations

import argparse
import os
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def check(target: str, service: str = "", timeout: float = 3.0) -> tuple[bool, str]:
    with grpc.insecure_channel(target) as channel:
        try:
            resp = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                             timeout=timeout)
        except grpc.RpcError as err:
            return False, f"{err.code().name}: {err.details()}"
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
    return resp.status == health_pb2.HealthCheckResponse.SERVING, status


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m service.healthcheck", description=__doc__.splitlines()[0])
    p.add_argument("--target", default=os.environ.get("POSENC_HEALTH_TARGET",
                                                      f"127.0.0.1:{os.environ.get('POSENC_PORT', '50051')}"))
    p.add_argument("--service", default="", help="a service name; empty = the whole server")
    p.add_argument("--timeout", type=float, default=3.0)
    a = p.parse_args(argv)
    ok, status = check(a.target, a.service, a.timeout)
    print(f"{a.target}: {status}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
