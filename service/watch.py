"""Watching the model folder: the worker reloads by itself when artifact folders appear, change or go.

`python -m service --watch-seconds N` looks at the folder every N seconds.  What it compares is cheap: the name,
size, modification time and inode of every file in every visible artifact folder (no hashing).  When that picture
has changed and then stayed the same for one more look, it calls Server.reload(), which verifies each new or
changed folder against its manifest, loads and warms it up beside the old one and swaps it in.  Waiting for one
quiet look means a folder still being copied file by file (a sync tool, `cp -r`) is not tried half-written;
exporters that assemble a hidden folder and rename it into place (python -m export does) are picked up at the
next look but one.  A folder that fails to load is tried again only when its files change.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

Snapshot = tuple[tuple[str, tuple[tuple[str, int, int, int], ...]], ...]


def snapshot(model_dir: Path) -> Snapshot | None:
    """What the folder holds now, as comparable data; None when it cannot be listed (gone, unreadable)."""
    try:
        with os.scandir(model_dir) as entries:
            folders = [e for e in entries if not e.name.startswith(".") and e.is_dir()]
    except OSError:
        return None
    picture = []
    for folder in sorted(folders, key=lambda e: e.name):
        files = []
        try:
            with os.scandir(folder.path) as entries:
                for f in entries:
                    st = f.stat()
                    files.append((f.name, st.st_size, st.st_mtime_ns, st.st_ino))
        except OSError:  # removed or replaced while we looked: the next look sees the new state
            files.append(("?", -1, -1, -1))
        picture.append((folder.name, tuple(sorted(files))))
    return tuple(picture)


class Watcher:
    """A daemon thread that calls server.reload() when the model folder has changed and settled."""

    def __init__(self, server: Any, model_dir: Path, seconds: float):
        if seconds <= 0:
            raise ValueError("the watch interval must be positive")
        self.server, self.model_dir, self.seconds = server, Path(model_dir), seconds
        self._stop = threading.Event()
        self._loaded = snapshot(self.model_dir)  # what the server loaded at start
        self._thread = threading.Thread(target=self._run, name="watch", daemon=True)
        self.reloads = 0

    def start(self) -> Watcher:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=10)

    def look(self, previous: Snapshot | None) -> Snapshot | None:
        """One look: reload when the folder differs from what was loaded and equals the previous look."""
        now = snapshot(self.model_dir)
        if now is not None and now != self._loaded and now == previous:
            self.server.reload()
            self.reloads += 1
            self._loaded = now
        return now

    def _run(self) -> None:
        previous = self._loaded
        while not self._stop.wait(self.seconds):
            try:
                previous = self.look(previous)
            except Exception:  # never let the watcher die: the worker keeps serving what it has
                log.exception("watching %s", self.model_dir)
