"""Builds the gRPC server (posenc.v1, KServe v2, grpc.health.v1 and reflection on one port) and the HTTP front
(service.http) on another, over the same models."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from protos.inference import grpc_service_pb2
from protos.posenc.v1 import posenc_pb2
from service import malloc
from service.artifacts import fingerprint, load_all, load_artifact, model_folders, providers_for
from service.auth import KeyInterceptor, KeyStore, charge
from service.http.app import http_server
from service.kserve import KServeServicer
from service.metrics import Metrics
from service.operations import Operations
from service.registry import Registry
from service.rpc import add_servicer
from service.servicer import PosencServicer
from service.settings import Loading, Settings

if TYPE_CHECKING:
    import numpy as np

    from service.generation import Emitted, Generation

log = logging.getLogger(__name__)

SERVICES = (posenc_pb2.DESCRIPTOR.services_by_name["Posenc"].full_name,
            grpc_service_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"].full_name)


def connection_age(s: Settings) -> list[tuple[str, int]]:
    if s.max_connection_age_s <= 0:
        return []
    grace = s.limits.max_request_s if s.limits.max_request_s > 0 else 3600.0
    return [("grpc.max_connection_age_ms", int(s.max_connection_age_s * 1000)),
            ("grpc.max_connection_age_grace_ms", int(grace * 1000))]


def spin_threads(settings: Settings) -> bool:
    """--spin-threads: auto spins when the model folder holds a single model at start.  Measured on a 135M-parameter
    model alone on 2 quiet cores (docs/peers.md, step_graphs), spinning threads made a decode step about 0.7x as
    long; with many models, sessions' spinning pools take the cores from each other (make soak), so they sleep."""
    if settings.spin_threads != "auto":
        return settings.spin_threads == "on"
    # under openvino onnxruntime's pool runs the attention nodes between subgraphs OpenVINO runs on threads of its
    # own, which a spinning pool takes the cores from (docs/serving.md#openvino): it sleeps
    return settings.provider != "openvino" and len(model_folders(settings.model_dir)) == 1


class KeyedOperations(Operations):
    """The operations, each call charged to its caller's API key for what it carries (service.auth.charge): a
    completion of several prompts is that many streams, a ModelInfer of several rows that many prompts."""

    def generate(self, name: str, prompts: list[tuple[str | None, list[int] | None]], *args: Any,
                 **kwargs: Any) -> Iterator[tuple[int, Generation | Emitted]]:
        if 1 <= len(prompts) <= self.limits.max_prompts:  # else the operation says what is wrong with the count
            charge(len(prompts), "prompts", (kwargs.get("names") or {}).get("prompt", "prompt"))
        yield from super().generate(name, prompts, *args, **kwargs)

    def infer(self, name: str, ids: np.ndarray, *args: Any, **kwargs: Any) -> dict[str, np.ndarray]:
        charge(len(ids), "rows", "input_ids")
        return super().infer(name, ids, *args, **kwargs)


SPARE_THREADS = 8  # health checks and watches, reflection, calls refused at the door


class UnaryLimit(grpc.ServerInterceptor):
    """At most `running` unary calls of the posenc and KServe services run at once, and at most `waiting` more wait
    for a slot, each in a pool thread of its own (the server's pool has room for them beside the streams' threads);
    a call past both gets RESOURCE_EXHAUSTED at once instead of a thread, so unary calls never hold the threads
    Generate streams need.  Streams, health checks and reflection are not counted."""

    def __init__(self, running: int, waiting: int, metrics: Metrics | None = None):
        self.running, self.waiting, self.metrics = running, waiting, metrics
        self.slots = threading.BoundedSemaphore(running)
        self.admitted = threading.BoundedSemaphore(running + waiting)

    def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
                          details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        handler = continuation(details)
        if (handler is None or handler.unary_unary is None
                or details.method.startswith(("/grpc.health.", "/grpc.reflection."))):
            return handler
        inner, slots, admitted = handler.unary_unary, self.slots, self.admitted

        def run(request: object, context: grpc.ServicerContext) -> Any:
            if not admitted.acquire(blocking=False):
                if self.metrics is not None:
                    self.metrics.refused("grpc", "busy")
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                              f"the server is busy: {self.running} calls running and {self.waiting} waiting "
                              "(--workers, --max-queue); retry later")
            try:
                with slots:
                    return inner(request, context)
            finally:
                admitted.release()

        return grpc.unary_unary_rpc_method_handler(run, request_deserializer=handler.request_deserializer,
                                                   response_serializer=handler.response_serializer)


class Server:
    def __init__(self, settings: Settings):
        self.settings = settings
        # API keys and per-key limits (service.auth), read before any model loads: a bad file stops the start.
        self.auth = (KeyStore.from_file(settings.api_keys_file, rate=settings.key_requests_per_second,
                                        max_concurrent=settings.key_max_concurrent)
                     if settings.api_keys_file is not None else None)
        if settings.tune_malloc:
            malloc.tune()
        gate = threading.BoundedSemaphore(settings.concurrent_runs) if settings.concurrent_runs > 0 else None
        providers = providers_for(settings.provider)
        self.loading = Loading(threads=settings.threads, arena=settings.memory_arena,
                               providers=providers, shared=settings.shared_arena, gate=gate,
                               spin=spin_threads(settings),
                               half=settings.half == "on" or (settings.half == "auto" and
                                                              "CUDAExecutionProvider" in providers))
        models, self.rejected = load_all(settings.model_dir, **self.loading.arguments)
        self.metrics = Metrics()
        if self.auth is not None:
            self.auth.metrics = self.metrics
        self.registry = Registry(models, settings.limits, settings.batching, settings.tuning, self.metrics)
        self.ops = KeyedOperations(self.registry)
        size = settings.limits.max_message_bytes
        # a Generate stream holds its thread until its last token: streams get threads of their own (--max-streams)
        # beside the --workers that run unary calls and the --max-queue more that may wait for one (UnaryLimit
        # refuses the rest), so no number of unary calls takes a stream's thread, and 32 streams decode together
        # without 32 unary calls running at once (more only contend for the GIL and the sessions: make soak)
        pool = futures.ThreadPoolExecutor(max_workers=settings.workers + settings.batching.max_queue
                                          + settings.limits.max_streams + SPARE_THREADS)
        keys = [KeyInterceptor(self.auth)] if self.auth is not None else []  # the key first: a refusal takes no slot
        unary = UnaryLimit(settings.workers, settings.batching.max_queue, self.metrics)
        self.grpc = grpc.server(pool, options=[("grpc.max_send_message_length", size),
                                               ("grpc.max_receive_message_length", size), *connection_age(settings)],
                                interceptors=[*keys, unary])
        add_servicer(PosencServicer(self.ops, settings.instance), posenc_pb2.DESCRIPTOR.services_by_name["Posenc"],
                     self.grpc)
        self.serving = False
        self._stopping = False
        kserve = KServeServicer(self.ops, lambda: self.serving, settings.instance)
        add_servicer(kserve, grpc_service_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"], self.grpc)
        self.health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.grpc)
        reflection.enable_server_reflection((*SERVICES, health.SERVICE_NAME, reflection.SERVICE_NAME), self.grpc)
        self.port = self._add_port(settings)
        self.http = (http_server(self.ops, kserve, lambda: self.serving, settings, self.auth)
                     if settings.http_port >= 0 else None)
        self.http_port = self.http.port if self.http else None
        self.metrics_port: int | None = None
        self._reload_lock = threading.Lock()
        self.stopped = threading.Event()
        self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)

    def _add_port(self, s: Settings) -> int:
        address = f"{s.host}:{s.port}"
        if s.tls_cert is None and s.tls_key is None:
            if s.tls_client_ca is not None:
                raise ValueError("--tls-client-ca needs --tls-cert and --tls-key")
            insecure: int = self.grpc.add_insecure_port(address)
            return insecure
        if s.tls_cert is None or s.tls_key is None:
            raise ValueError("TLS needs both --tls-cert and --tls-key")
        ca = Path(s.tls_client_ca).read_bytes() if s.tls_client_ca else None
        creds = grpc.ssl_server_credentials([(Path(s.tls_key).read_bytes(), Path(s.tls_cert).read_bytes())],
                                            root_certificates=ca, require_client_auth=ca is not None)
        port: int = self.grpc.add_secure_port(address, creds)
        return port

    def _set_health(self, status: int) -> None:
        for name in ("", *SERVICES):
            self.health.set(name, status)

    def _update_readiness(self) -> None:
        """Ready (gRPC health SERVING, KServe ServerReady, HTTP /v2/health/ready) only while at least one model
        serves: a worker started on an empty folder (make serve's first minutes, an artifact sync still running)
        is live, not ready, until a reload brings a model in."""
        ready = bool(self.registry.models) and not self._stopping
        self._set_health(health_pb2.HealthCheckResponse.SERVING if ready else
                         health_pb2.HealthCheckResponse.NOT_SERVING)
        self.serving = ready

    def warm_up(self) -> None:
        """One request per model before SERVING; a model that cannot run is refused, the others serve."""
        for name, served in list(self.registry.served.items()):
            try:
                self.registry.warm_up(served)
            except Exception as err:  # onnxruntime's own errors: shapes that model.json lied about, etc.
                self.rejected[name] = f"warm-up failed: {err}"
                log.error("refused artifact %s: %s", name, self.rejected[name])
                self.registry.remove(name)

    def reload(self) -> dict[str, Any]:
        """Pick up artifact folders added, replaced or removed since start (SIGHUP).  A changed model is loaded and
        warmed up beside the old one, then swapped in; requests in flight finish on the old one.  A folder that
        fails to load leaves the model it would replace serving."""
        with self._reload_lock:
            report: dict[str, Any] = {"loaded": [], "replaced": [], "removed": [], "unchanged": [], "failed": {}}
            try:
                folders = model_folders(self.settings.model_dir)
            except OSError as err:
                report["failed"]["*"] = f"cannot list {self.settings.model_dir}: {err}"
                log.error("reload: %s", report["failed"]["*"])
                return report
            for name, folder in folders.items():
                current = self.registry.models.get(name)
                new = None
                try:
                    if current is not None and current.fingerprint == fingerprint(folder):
                        report["unchanged"].append(name)
                        continue
                    new = self.registry.prepare(load_artifact(folder, **self.loading.arguments))
                    self.registry.warm_up(new)
                except Exception as err:  # ArtifactRejected, OSError, onnxruntime errors at warm-up
                    if new is not None:
                        new.engine.close()
                    reason = err.strerror if isinstance(err, OSError) and err.strerror else str(err)
                    report["failed"][name] = reason
                    if current is None:
                        self.rejected[name] = reason
                    log.error("reload: refused %s (%s): %s", name,
                              "the old one keeps serving" if current else "not served", reason)
                    continue
                self.registry.install(new)
                self.rejected.pop(name, None)
                report["replaced" if current else "loaded"].append(name)
            for name in sorted(set(self.registry.models) - set(folders)):
                self.registry.remove(name)
                report["removed"].append(name)
            self._update_readiness()
            log.info("reload: %s", {k: v for k, v in report.items() if v})
            return report

    def reload_keys(self) -> bool | None:
        """Read the API key file again (SIGHUP) and swap the key set at once, for gRPC and HTTP together (one
        KeyStore): calls in flight go on, a removed key is refused from then on, an added one accepted; a file that
        no longer parses leaves the keys in force (the reason logged).  None when the worker has no key file
        (keys cannot be turned on or off without a restart)."""
        return self.auth.reload() if self.auth is not None else None

    def start(self) -> Server:
        if self.settings.metrics_port >= 0:
            self.metrics_port = self.metrics.serve(self.settings.metrics_host, self.settings.metrics_port)
        self.grpc.start()
        if self.http is not None:
            self.http.start()  # live at once; ready (200 on /v2/health/ready) with gRPC's SERVING
        self.warm_up()  # only then report SERVING (with at least one model)
        self._update_readiness()
        log.info("serving %d models on %s:%d (refused: %s)", len(self.registry.models), self.settings.host, self.port,
                 ", ".join(self.rejected) or "none")
        return self

    def stop(self, grace: float = 10.0) -> None:
        """NOT_SERVING first, refuse new work, let in-flight requests finish, then close the engines."""
        self._stopping = True  # a reload racing the stop never turns SERVING back on
        self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        self.serving = False
        # gRPC's stop() refuses new calls itself (clients see UNAVAILABLE before anything ran, which their channel
        # retries on another replica); marking the registry earlier would also refuse calls gRPC had already
        # accepted, with an application-level UNAVAILABLE no client retries for a stream.
        try:
            drain = threading.Thread(target=self.http.stop, args=(grace,), name="http-drain") if self.http else None
            if drain is not None:
                drain.start()
            self.grpc.stop(grace).wait()
            if drain is not None:
                drain.join()
            self.registry.close()
            self.metrics.close()
        finally:
            self.stopped.set()

    def wait(self) -> None:
        """Until stop() has finished: gRPC ends first; HTTP streams may still be draining (the process must not
        exit under them)."""
        self.grpc.wait_for_termination()
        self.stopped.wait()
