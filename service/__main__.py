"""python -m service --model-dir artifacts --port 50051: every flag has a POSENC_* environment default
(the settings and their checks are defined once, in service.settings)."""

from __future__ import annotations

import logging
import signal
import sys
import threading
from typing import TYPE_CHECKING

from model import cli
from service.server import Server
from service.settings import PREFIX, Settings, parser
from service.watch import Watcher

if TYPE_CHECKING:
    from collections.abc import Mapping
    from types import FrameType


def parse(argv: list[str] | None = None, environ: Mapping[str, str] | None = None) -> Settings:
    """Flags over POSENC_* variables over defaults (service.settings), checked; bad ones exit 2 with one line."""
    settings: Settings = cli.parse(parser(), Settings, PREFIX, argv, environ)
    return settings


def main(argv: list[str] | None = None) -> int:
    s = parse(argv)
    logging.basicConfig(level=s.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        server = Server(s).start()
    except (ValueError, OSError, RuntimeError) as err:  # a port taken, a key that does not match its certificate
        print(f"python -m service: error: {err}", file=sys.stderr)
        return 2
    stopping = threading.Event()
    watcher = Watcher(server, s.model_dir, s.watch_seconds).start() if s.watch_seconds > 0 else None

    def shut_down() -> None:
        if watcher is not None:
            watcher.stop()  # no reload may install a model into a registry that is closing
        server.stop(s.grace_seconds)

    def on_signal(signum: int, frame: FrameType | None) -> None:
        if not stopping.is_set():
            stopping.set()
            logging.getLogger("service").info("signal %d: draining and stopping (%d Generate streams open; "
                                              "in-flight work gets up to %g s)", signum, server.registry.streams,
                                              s.grace_seconds)
            threading.Thread(target=shut_down, daemon=True).start()

    def reload() -> None:
        server.reload_keys()  # the API key file, when there is one: swapped whole, or kept if it no longer parses
        server.reload()

    # SIGHUP: reload the API keys and the model folder (added, replaced, removed artifacts)
    def on_hangup(signum: int, frame: FrameType | None) -> None:
        threading.Thread(target=reload, name="reload", daemon=True).start()

    signal.signal(signal.SIGHUP, on_hangup)
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    # Announced only once the handlers are in place: whoever waits for this line may signal at once.
    if watcher is not None:
        logging.getLogger("service").info("watching %s: reloading when it changes (every %g s)", s.model_dir,
                                          s.watch_seconds)
    print(f"posenc serving {', '.join(sorted(server.registry.models)) or 'no models'} on {s.host}:{server.port}",
          flush=True)
    server.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
