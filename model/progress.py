"""A small progress bar for the training CLI (stderr; redraws in place on a terminal, a line every 10 % else)."""

from __future__ import annotations

import sys
import time


class Progress:
    def __init__(self, total: int, label: str, stream=None, enabled: bool = True):
        self.total, self.label, self.enabled = max(total, 1), label, enabled
        self.stream = stream or sys.stderr
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.start = time.perf_counter()
        self.last_decile = -1

    def update(self, done: int, **fields: float) -> None:
        if not self.enabled:
            return
        decile = 10 * done // self.total
        if not self.tty and decile == self.last_decile and done != self.total:
            return
        self.last_decile = decile
        elapsed = time.perf_counter() - self.start
        eta = elapsed / done * (self.total - done) if done else 0.0
        width = 24
        filled = width * done // self.total
        extra = " ".join(f"{k} {v:.3f}" for k, v in fields.items())
        line = (f"{self.label:<11} [{'#' * filled}{'.' * (width - filled)}] {done}/{self.total} "
                f"{elapsed:5.1f}s eta {eta:5.1f}s {extra}")
        self.stream.write(("\r" + line) if self.tty else line + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled and self.tty:
            self.stream.write("\n")
            self.stream.flush()
