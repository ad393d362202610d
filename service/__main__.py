"""python -m service --model-dir artifacts --port 50051: every flag has a POSENC_* environment default."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from pathlib import Path

from service.registry import Limits
from service.server import Server, Settings
from service.watch import Watcher

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


class Parser(argparse.ArgumentParser):
    """Bad settings, from flags or POSENC_* variables, end in one line on stderr and exit status 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


class SettingError(ValueError):
    """A flag or POSENC_* value that cannot work."""


def env(name: str, default):
    """POSENC_<name> converted like its flag, or `default`; a value that does not convert is an error naming it."""
    raw = os.environ.get(f"POSENC_{name}")
    if raw is None:
        return default
    try:
        return type(default)(raw)
    except ValueError:
        raise SettingError(f"POSENC_{name}={raw!r} is not a valid {type(default).__name__}") from None


# flag -> (lowest, highest) allowed; None = no bound on that side
RANGES = {"port": (0, 65535), "workers": (1, None), "threads": (1, None), "max_batch": (1, None),
          "max_wait_ms": (0, None), "max_queue": (1, None), "max_prompt_tokens": (1, None),
          "max_new_tokens": (1, None), "max_message_bytes": (1024, 2**31 - 1), "max_streams": (1, None),
          "max_request_seconds": (0, None), "http_port": (None, 65535), "metrics_port": (None, 65535),
          "grace_seconds": (0, None), "max_connection_age_seconds": (0, None), "memory_arena": (0, 1),
          "watch_seconds": (0, None), "concurrent_runs": (0, None), "shared_arena": (0, 1)}


def check(a: argparse.Namespace) -> None:
    """Settings that parse but cannot work: ranges, the log level, the model folder."""
    for name, (low, high) in RANGES.items():
        value = getattr(a, name, None)
        if value is None:
            continue
        if value != value or (low is not None and value < low) or (high is not None and value > high):
            bounds = f"between {low} and {high}" if low is not None and high is not None else (
                f">= {low}" if low is not None else f"<= {high}")
            raise SettingError(f"--{name.replace('_', '-')} must be {bounds}, got {value}")
    if a.log_level.upper() not in LOG_LEVELS:
        raise SettingError(f"--log-level {a.log_level!r} is not one of {', '.join(LOG_LEVELS)}")
    folder = Path(a.model_dir)
    if not folder.exists():
        raise SettingError(f"--model-dir {folder} does not exist")
    if not folder.is_dir():
        raise SettingError(f"--model-dir {folder} is not a directory")
    if bool(a.tls_cert) != bool(a.tls_key):
        raise SettingError("TLS needs both --tls-cert and --tls-key (POSENC_TLS_CERT / POSENC_TLS_KEY)")
    if a.tls_client_ca and not a.tls_cert:
        raise SettingError("--tls-client-ca (mutual TLS) needs --tls-cert and --tls-key")
    for flag in ("tls_cert", "tls_key", "tls_client_ca"):
        value = getattr(a, flag)
        if value and not Path(value).is_file():
            raise SettingError(f"--{flag.replace('_', '-')} {value} is not a readable file")


def parse(argv: list[str] | None) -> argparse.Namespace:
    d, lim = Settings(), Limits()
    p = Parser(prog="python -m service", description="posenc onnxruntime gRPC worker")
    try:
        p.add_argument("--model-dir", default=env("MODEL_DIR", str(d.model_dir)))
        p.add_argument("--host", default=env("HOST", d.host))
        p.add_argument("--port", type=int, default=env("PORT", d.port))
        p.add_argument("--workers", type=int, default=env("WORKERS", d.workers), help="gRPC worker threads")
        p.add_argument("--threads", type=int, default=env("THREADS", d.threads),
                       help="onnxruntime intra-op threads per model (they sleep between runs with --shared-arena 1)")
        p.add_argument("--memory-arena", type=int, choices=(0, 1), default=env("MEMORY_ARENA", 1),
                       help="onnxruntime's CPU memory arena: 1 = on (shared by every model with --shared-arena 1); "
                            "0 = buffers go back to malloc after each run")
        p.add_argument("--shared-arena", type=int, choices=(0, 1), default=env("SHARED_ARENA", int(d.shared_arena)),
                       help="1 = one onnxruntime CPU arena for every model and intra-op threads that sleep between "
                            "runs (flat memory); 0 = onnxruntime's defaults per session")
        p.add_argument("--concurrent-runs", type=int, default=env("CONCURRENT_RUNS", d.concurrent_runs),
                       help="onnxruntime runs at once across all models (bounds the shared arena's peak); 0 = no limit")
        p.add_argument("--max-batch", type=int, default=env("MAX_BATCH", d.max_batch))
        p.add_argument("--max-wait-ms", type=float, default=env("MAX_WAIT_MS", d.max_wait_ms))
        p.add_argument("--max-queue", type=int, default=env("MAX_QUEUE", d.max_queue))
        p.add_argument("--max-prompt-tokens", type=int, default=env("MAX_PROMPT_TOKENS", lim.max_prompt_tokens))
        p.add_argument("--max-new-tokens", type=int, default=env("MAX_NEW_TOKENS", lim.max_new_tokens))
        p.add_argument("--max-message-bytes", type=int, default=env("MAX_MESSAGE_BYTES", lim.max_message_bytes))
        p.add_argument("--max-streams", type=int, default=env("MAX_STREAMS", lim.max_streams),
                       help="Generate streams open at once")
        p.add_argument("--max-request-seconds", type=float, default=env("MAX_REQUEST_SECONDS", lim.max_request_s),
                       help="server-side cap on every request's deadline (0 = only the client's)")
        p.add_argument("--grace-seconds", type=float, default=env("GRACE_SECONDS", 10.0),
                       help="on SIGTERM, how long requests in flight may take to finish before they are cut off")
        p.add_argument("--provider", choices=("cpu", "cuda", "auto"), default=env("PROVIDER", "cpu"),
                       help="onnxruntime execution provider: cuda needs onnxruntime-gpu; auto picks cuda when present")
        p.add_argument("--max-connection-age-seconds", type=float, default=env("MAX_CONNECTION_AGE_SECONDS", 0.0),
                       help="ask gRPC clients to reconnect after this long, so they find replicas added since "
                            "(their calls in flight may finish); 0 = never")
        p.add_argument("--watch-seconds", type=float, default=env("WATCH_SECONDS", 0.0),
                       help="look at --model-dir every this many seconds and reload when artifact folders were "
                            "added, replaced or removed (and have stopped changing); 0 = only on SIGHUP")
        p.add_argument("--http-port", type=int, default=env("HTTP_PORT", 8000),
                       help="HTTP port: KServe v2 REST, OpenAI completions, posenc JSON, the viewer; negative = off")
        p.add_argument("--metrics-host", default=env("METRICS_HOST", d.metrics_host))
        p.add_argument("--metrics-port", type=int, default=env("METRICS_PORT", d.metrics_port),
                       help="Prometheus /metrics port; 0 = any free port, negative = off")
        p.add_argument("--tls-cert", default=os.environ.get("POSENC_TLS_CERT"), help="PEM certificate chain")
        p.add_argument("--tls-key", default=os.environ.get("POSENC_TLS_KEY"), help="PEM private key")
        p.add_argument("--tls-client-ca", default=os.environ.get("POSENC_TLS_CLIENT_CA"),
                       help="PEM CA bundle; clients must present a certificate it signed (mutual TLS)")
        p.add_argument("--instance", default=env("INSTANCE", d.instance),
                       help="this replica's name, sent as posenc-instance metadata (default: the host name)")
        p.add_argument("--log-level", default=env("LOG_LEVEL", "INFO"), help=", ".join(LOG_LEVELS))
        a = p.parse_args(argv)
        check(a)
    except SettingError as err:
        p.error(str(err))
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    logging.basicConfig(level=a.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    limits = Limits(max_prompt_tokens=a.max_prompt_tokens, max_new_tokens=a.max_new_tokens,
                    max_message_bytes=a.max_message_bytes, max_streams=a.max_streams,
                    max_request_s=a.max_request_seconds)
    def path(value):
        return Path(value) if value else None

    try:
        server = Server(Settings(Path(a.model_dir), a.host, a.port, a.workers, a.threads, a.max_batch, a.max_wait_ms,
                                 a.max_queue, limits, a.metrics_host, a.metrics_port, path(a.tls_cert),
                                 path(a.tls_key), path(a.tls_client_ca), bool(a.memory_arena), a.instance,
                                 http_port=a.http_port, max_connection_age_s=a.max_connection_age_seconds,
                                 provider=a.provider, shared_arena=bool(a.shared_arena),
                                 concurrent_runs=a.concurrent_runs)).start()
    except (ValueError, OSError, RuntimeError) as err:  # a port taken, a key that does not match its certificate
        print(f"python -m service: error: {err}", file=sys.stderr)
        return 2
    stopping = threading.Event()
    watcher = Watcher(server, Path(a.model_dir), a.watch_seconds).start() if a.watch_seconds > 0 else None

    def shut_down():
        if watcher is not None:
            watcher.stop()  # no reload may install a model into a registry that is closing
        server.stop(a.grace_seconds)

    def on_signal(signum, frame):
        if not stopping.is_set():
            stopping.set()
            logging.getLogger("service").info("signal %d: draining and stopping (%d Generate streams open; "
                                              "in-flight work gets up to %g s)", signum, server.registry.streams,
                                              a.grace_seconds)
            threading.Thread(target=shut_down, daemon=True).start()

    def on_hangup(signum, frame):  # reload the model folder: added, replaced and removed artifacts
        threading.Thread(target=server.reload, name="reload", daemon=True).start()

    signal.signal(signal.SIGHUP, on_hangup)
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    # Announced only once the handlers are in place: whoever waits for this line may signal at once.
    if watcher is not None:
        logging.getLogger("service").info("watching %s: reloading when it changes (every %g s)", a.model_dir,
                                          a.watch_seconds)
    print(f"posenc serving {', '.join(sorted(server.registry.models)) or 'no models'} on {a.host}:{server.port}",
          flush=True)
    server.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
