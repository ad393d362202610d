"""Every worker setting, defined once: type, default, range, help and POSENC_* variable per field.

`python -m service`'s flags, its environment variables, the checks (one line, exit 2), `--help` and the table in
docs/settings.md all come from these two dataclasses (model.cli does the generating).  Adding a setting is adding
one field here; the code that uses it reads `settings.<name>`.

    python -m service.settings --markdown     prints the table docs/settings.md carries
"""

from __future__ import annotations

import socket
import sys
import threading
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from model.cli import ClientTLS, Parser, SettingError, check, markdown, option

PREFIX = "POSENC_"
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def _directory(value: Path) -> str | None:
    path = Path(value)
    if not path.exists():
        return "does not exist"
    return None if path.is_dir() else "is not a directory"


def _file(value: Path) -> str | None:
    return None if Path(value).is_file() else "is not a readable file"


@dataclass(frozen=True)
class Limits:
    """What one request may ask for; operations check requests against these."""

    max_prompt_tokens: int = option(4096, low=1, help="longest prompt in tokens (a model's own max_positions may be "
                                                      "lower)")
    max_new_tokens: int = option(512, low=1, help="most tokens one Generate or completion may ask for")
    max_message_bytes: int = option(64 * 1024 * 1024, low=1024, high=2**31 - 1,
                                    help="largest gRPC message either way; bigger answers are RESOURCE_EXHAUSTED")
    max_top_k: int = option(256, low=1, help="largest top_k a request may ask for")
    max_streams: int = option(64, low=1, help="Generate streams open at once; more get RESOURCE_EXHAUSTED")
    max_request_s: float = option(300.0, low=0, flag="max-request-seconds",
                                  help="server-side cap on every request's deadline (0 = only the client's)")
    max_stop_strings: int = option(16, low=0, help="stop strings one Generate or completion may give (0 = none: "
                                                   "a request that gives one is refused)")
    max_prompts: int = option(32, low=1, help="prompts in one completion request (each is a stream of the decode "
                                              "loop); more get 400 naming prompt")
    long_context: bool = option(False, help="1 = imported models take prompts past their own "
                                            "length (max_position_embeddings, times the factor of a linear, "
                                            "dynamic or yarn RoPE scaling; up to --max-prompt-tokens); 0 = that "
                                            "is their limit")

    def __post_init__(self) -> None:
        check(self)


@dataclass(frozen=True)
class Batching:
    """How one model's calls are batched (the parts of service/engine.py read these)."""

    max_batch: int = option(32, low=1, help="most rows in one onnxruntime call (batches and decode steps): 32 "
                                            "streams decode in one step")
    max_wait_ms: float = option(2.0, low=0, help="how long a batch waits for more requests while the model is busy")
    max_queue: int = option(64, low=1, help="requests queued per model, and gRPC unary calls waiting for a "
                                          "--workers slot; more get RESOURCE_EXHAUSTED")
    batch_tokens: int = option(256, low=1, help="most new prompt tokens in one onnxruntime call (rows x padded "
                                                "length; a longer prompt runs in pieces between decode steps): "
                                                "more finishes a burst of prompts sooner, and costs the running "
                                                "streams' time between tokens and the call's memory (its logits "
                                                "where a request wants every position's)")
    prefix_cache_mb: float = option(128.0, low=0, help="memory for the prefix cache (every model together): a "
                                                       "prompt starts on the keys and values of a recent prompt's "
                                                       "leading tokens, 16-token blocks, least recently used "
                                                       "evicted; 0 = off")
    speculate: int = option(4, low=0, high=64, help="most draft tokens of a speculative step: a greedy stream that is "
                            "its model's only stream proposes up to this many next tokens by prompt lookup (what "
                            "followed its last tokens earlier in its prompt and output) and checks them in one call, "
                            "keeping those the model makes (its tokens are plain decoding's); fewer, and less often, "
                            "while its drafts fail; 0 = off")

    def __post_init__(self) -> None:
        check(self)


@dataclass(frozen=True)
class Tuning:
    """The engine's tuning values: constants, not flags (measured once, docs/serving.md), kept here so each has one
    value; Python callers (tests, benchmarks) may build the engine with others."""

    lookahead: int = 8  # tokens a stream may run ahead of its reader (readers a few tokens apart share the batch)
    rotate: int = 8  # steps a row keeps its place when more streams wait than max_batch rows allow
    gather: int = 4  # steps a new stream may wait to join a running batch while more prompts are being prefilled
    grow: int = 64  # compact layout: positions its buffers hold past the longest row, when a row may go that far
    rows: int = 8  # compact layout: its row slots come in multiples of this
    # compact layout: buffers holding more than this many times what the rows need are made again at what they
    # need (a factor, so a batch whose rows come and go does not remake its buffers back and forth)
    shrink: float = 2.0
    idle_s: float = 0.05  # while every stream is ahead of its reader, the engine looks at them this often (deadlines)


@dataclass(frozen=True)
class Loading:
    """How every model's sessions are made (service.artifacts.load_artifact's arguments): built once at start from
    the settings (threads, memory_arena, shared_arena) and what the server decides from them (providers, the gate of
    --concurrent-runs, whether threads spin)."""

    threads: int = 2
    arena: bool = True
    providers: list[str] | None = None
    shared: bool = True
    gate: threading.Semaphore | None = None
    spin: bool = False
    half: bool = False  # serve fast graphs' float16 copies (fast16.onnx) where artifacts have them

    @property
    def arguments(self) -> dict[str, Any]:
        """As load_artifact's keyword arguments."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True)
class Settings:
    """The worker: where the models are, the ports, batching, onnxruntime, TLS, and the limits above."""

    model_dir: Path = option(Path("artifacts"), check=_directory, help="folder of artifact folders to serve")
    host: str = option("127.0.0.1", help="address the gRPC port binds")
    port: int = option(50051, low=0, high=65535, help="gRPC port (posenc.v1, KServe v2, health, reflection); "
                                                      "0 = any free port")
    workers: int = option(16, low=1, help="gRPC unary calls (Predict, Score, ModelInfer, ...) running at once; "
                                          "up to --max-queue more wait for a slot, more get RESOURCE_EXHAUSTED; "
                                          "Generate streams get threads of their own, up to --max-streams")
    threads: int = option(2, low=1, help="onnxruntime intra-op threads per model (they sleep between runs with "
                                         "--shared-arena 1)")
    batching: Batching = option(default_factory=Batching, nested=True, help="batching")
    limits: Limits = option(default_factory=Limits, nested=True, help="per-request limits")
    metrics_host: str = option("127.0.0.1", help="address the Prometheus /metrics port binds")
    metrics_port: int = option(8002, high=65535, help="Prometheus /metrics port; 0 = any free port, negative = off")
    tls_cert: Path | None = option(None, check=_file,
                                   help="PEM certificate chain (with --tls-key: TLS on gRPC and HTTP)")
    tls_key: Path | None = option(None, check=_file, help="PEM private key of --tls-cert")
    tls_client_ca: Path | None = option(None, check=_file, help="PEM CA bundle; clients must present a certificate "
                                                                "it signed (mutual TLS)")
    memory_arena: bool = option(True, help="onnxruntime's CPU memory arena: 1 = on (shared by every model with "
                                           "--shared-arena 1); 0 = buffers go back to malloc after each run")
    instance: str = option(default_factory=socket.gethostname, shown="the host name",
                           help="this replica's name, sent as posenc-instance metadata")
    tune_malloc: bool = option(True, help="raise glibc's mmap/trim thresholds at start (large messages ~10x "
                                          "cheaper)")
    http_port: int = option(8000, high=65535, help="HTTP port: KServe v2 REST, OpenAI completions and chat, posenc "
                                                   "JSON, the viewer; 0 = any free port, negative = off")
    max_connection_age_s: float = option(0.0, low=0, flag="max-connection-age-seconds",
                                         help="ask gRPC clients to reconnect (GOAWAY) and close HTTP keep-alive "
                                              "connections after this long, so clients find replicas added since "
                                              "(their calls in flight may finish); 0 = never")
    api_keys_file: Path | None = option(None, check=_file, flag="api-keys-file", aliases=("api-keys",),
                                        help="file of accepted API keys (one per line, or sha256:<hex>), reread on "
                                             "SIGHUP; when set, every call but health, readiness and the viewer's "
                                             "static files needs authorization: Bearer KEY")
    studies_dir: Path | None = option(None, check=_directory, flag="studies-dir",
                                      help="folder of study and benchmark results (bench/results) that the viewer's "
                                           "Studies section and GET /v1/posenc/studies show; none = no results")
    key_requests_per_second: float = option(0.0, low=0, help="per API key: units a second, one per prompt or row "
                                                             "(token bucket, bursts of this many); more get "
                                                             "RESOURCE_EXHAUSTED / 429 with retry-after; 0 = no "
                                                             "limit")
    key_max_concurrent: int = option(0, low=0, help="per API key: units in flight at once, one per prompt or "
                                                    "row (a stream counts until its last token); more get "
                                                    "RESOURCE_EXHAUSTED / 429; 0 = no limit")
    provider: str = option("cpu", choices=("cpu", "cuda", "auto", "openvino"),
                           help="onnxruntime execution provider: cuda needs onnxruntime-gpu, openvino "
                                "onnxruntime-openvino (make openvino); auto picks cuda when present")
    half: str = option("auto", choices=("auto", "on", "off"),
                       help="serve a fast graph's float16 copy (fast16.onnx, export.fuse --half) where the artifact "
                            "has one: its attention on the GPU, a KV cache of half the bytes; auto = on with the cuda "
                            "provider")
    shared_arena: bool = option(True, help="1 = one onnxruntime CPU arena for every model and intra-op threads that "
                                           "sleep between runs (flat memory); 0 = onnxruntime's defaults per session")
    spin_threads: str = option("auto", choices=("auto", "on", "off"),
                               help="onnxruntime's intra-op threads spin between operators (until the run returns) "
                                    "instead of sleeping: faster steps for one model on cores of its own, contention "
                                    "among many; auto = on when --model-dir holds a single model at start")
    concurrent_runs: int = option(2, low=0, help="onnxruntime runs at once across all models (bounds the shared "
                                                 "arena's peak); 0 = no limit")
    grace_seconds: float = option(10.0, low=0, help="on SIGTERM, how long requests in flight may take to finish "
                                                    "before they are cut off")
    watch_seconds: float = option(0.0, low=0, help="look at --model-dir every this many seconds and reload when "
                                                   "artifact folders were added, replaced or removed (and have "
                                                   "stopped changing); 0 = only on SIGHUP")
    log_level: str = option("INFO", choices=LOG_LEVELS, ignore_case=True, help="log level")
    tuning: Tuning = field(default_factory=Tuning)  # not a flag: the engine's constants (above)

    def __post_init__(self) -> None:
        check(self)
        if (self.tls_cert is None) != (self.tls_key is None):
            raise SettingError("TLS needs both --tls-cert and --tls-key (POSENC_TLS_CERT / POSENC_TLS_KEY)")
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise SettingError("--tls-client-ca (mutual TLS) needs --tls-cert and --tls-key")


def parser(prog: str = "python -m service") -> Parser:
    return Parser(prog=prog, description="posenc worker: onnxruntime behind gRPC (posenc.v1, KServe v2) and HTTP "
                                      "(KServe REST, OpenAI completions, posenc JSON, the viewer). Every flag has "
                                      "a POSENC_* environment variable; the flag wins.")


BEGIN, END = "<!-- settings: python -m service.settings --markdown -->", "<!-- /settings -->"
CLIENT_BEGIN = "<!-- settings: client TLS (model.cli.ClientTLS) -->"  # the client CLI's and the healthcheck's


def filled(page: str) -> str:
    """`page` with the tables between its markers replaced by the ones generated from the definitions: the worker's
    settings (required) and the client-side TLS flags (where the page has their block)."""
    if BEGIN not in page or END not in page:
        raise SettingError(f"the page has no {BEGIN} ... {END} block")
    for begin, cls in ((BEGIN, Settings), (CLIENT_BEGIN, ClientTLS)):
        if begin in page:
            head, rest = page.split(begin, 1)
            page = f"{head}{begin}\n{markdown(cls, PREFIX)}{END}{rest.split(END, 1)[1]}"
    return page


def main(argv: list[str] | None = None) -> int:
    p = Parser(prog="python -m service.settings", description="the worker's settings as a markdown table")
    p.add_argument("--markdown", action="store_true", help="print the table of flags and environment variables")
    p.add_argument("--update", metavar="PAGE", help="rewrite the table block in this markdown page (docs/settings.md)")
    a = p.parse_args(argv)
    if a.update:
        page = Path(a.update)
        try:
            text = filled(page.read_text())
        except (OSError, SettingError) as err:
            p.error(str(err))
        tmp = page.with_name(f".{page.name}.tmp")
        tmp.write_text(text)
        tmp.replace(page)
    elif a.markdown:
        sys.stdout.write(markdown(Settings, PREFIX))
    else:
        p.error("say what to do: --markdown or --update PAGE")
    return 0


if __name__ == "__main__":
    sys.exit(main())
