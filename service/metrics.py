"""Prometheus metrics on their own port: requests by RPC and status, HTTP requests by route and status, latency,
batch sizes, queue depth, speculative steps' draft tokens accepted and rejected."""

from __future__ import annotations

import logging
from collections.abc import Callable
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

log = logging.getLogger(__name__)

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("posenc_requests", "RPCs answered, by method, model and status code",
                                ["rpc", "model", "code"], registry=self.registry)
        self.latency = Histogram("posenc_request_seconds", "RPC latency in seconds", ["rpc"],
                                 buckets=LATENCY_BUCKETS, registry=self.registry)
        self.batch_size = Histogram("posenc_batch_size", "rows per onnxruntime call", ["model"],
                                    buckets=(1, 2, 3, 4, 6, 8, 12, 16, 32, 64), registry=self.registry)
        self.queue_depth = Gauge("posenc_queue_depth", "requests waiting in a model's batching queue", ["model"],
                                 registry=self.registry)
        self.http_requests = Counter("posenc_http_requests", "HTTP requests answered, by route, method and status",
                                     ["route", "method", "status"], registry=self.registry)
        self.http_latency = Histogram("posenc_http_request_seconds",
                                      "HTTP request latency in seconds (streams: until the last byte)", ["route"],
                                      buckets=LATENCY_BUCKETS, registry=self.registry)
        self.refusals = Counter("posenc_refusals", "calls refused at the door, by transport and reason: missing or "
                                "invalid API key, a key over its rate or concurrency limit, or busy (gRPC unary "
                                "calls past --workers running and --max-queue waiting)",
                                ["transport", "reason"], registry=self.registry)
        self.speculative = Counter("posenc_speculative_tokens", "draft tokens of speculative steps (--speculate), by "
                                   "model and whether the model made them (accepted) or not (rejected)",
                                   ["model", "result"], registry=self.registry)
        self.server: WSGIServer | None = None

    def refused(self, transport: str, reason: str) -> None:
        self.refusals.labels(transport, reason).inc()

    def observe(self, rpc: str, model: str, code: str, seconds: float) -> None:
        self.requests.labels(rpc, model, code).inc()
        self.latency.labels(rpc).observe(seconds)

    def observe_http(self, route: str, method: str, status: int, seconds: float) -> None:
        self.http_requests.labels(route, method, str(status)).inc()
        self.http_latency.labels(route).observe(seconds)

    def drafts(self, model: str) -> Callable[[int, int], None]:
        """What a model's engine calls after each speculative step: its drafts accepted and rejected, counted."""
        accepted, rejected = self.speculative.labels(model, "accepted"), self.speculative.labels(model, "rejected")

        def count(taken: int, not_taken: int) -> None:
            accepted.inc(taken)
            rejected.inc(not_taken)
        return count

    def watch_queue(self, model: str, depth: Callable[[], float]) -> None:
        self.queue_depth.labels(model).set_function(depth)

    def serve(self, host: str, port: int) -> int:
        """Start the /metrics HTTP endpoint; returns the bound port."""
        server, _thread = start_http_server(port, addr=host, registry=self.registry)
        self.server = server
        bound: int = server.server_address[1]
        log.info("metrics on http://%s:%d/metrics", host, bound)
        return bound

    def close(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
