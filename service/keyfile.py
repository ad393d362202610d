"""The API key file (service.auth): its lines parsed into SHA-256 digests and per-key limits, and the per-key state
the door keeps.  Never quotes a key: an error names the file and the line number."""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

OPTIONS = {"requests_per_second": float, "max_concurrent": int}  # a key's own limits, after it on its line


class KeyFileError(ValueError):
    """A key file that cannot be used (at start the worker refuses to start: one line, exit 2; on reload the keys
    in force stay); never quotes a key."""


def digest_of(key: bytes) -> bytes:
    return hashlib.sha256(key).digest()


def parse_key_lines(text: str, where: str = "the key file") -> list[tuple[bytes, dict[str, Any]]]:
    """(SHA-256 digest, the key's own limits) for every key in a key file's text."""
    entries = []
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        first, *rest = line.split()
        if first.lower().startswith("sha256:"):
            hexed = first[7:]
            if len(hexed) != 64 or any(c not in "0123456789abcdefABCDEF" for c in hexed):
                raise KeyFileError(f"{where} line {n}: sha256: needs 64 hexadecimal digits")
            digest = bytes.fromhex(hexed)
        elif not all(33 <= ord(c) <= 126 for c in first):
            raise KeyFileError(f"{where} line {n}: a key is printable ASCII without spaces (it travels in a header)")
        else:
            digest = digest_of(first.encode())
        limits = {}
        for item in rest:
            name, _, value = item.partition("=")
            try:
                limits[name] = OPTIONS[name](value)
                ok = limits[name] >= 0 and limits[name] == limits[name]
            except (KeyError, ValueError):
                ok = False
            if not ok:
                raise KeyFileError(f"{where} line {n}: after the key only requests_per_second=R and "
                                   "max_concurrent=N (numbers >= 0) may follow")
        entries.append((digest, limits))
    if not entries:
        raise KeyFileError(f"{where} holds no key (one per line, or sha256:<hex>)")
    return entries


def parse_keys(text: str, where: str = "the key file") -> list[bytes]:
    """SHA-256 digests of the keys in a key file's text."""
    return [digest for digest, _ in parse_key_lines(text, where)]


def read_key_file(path: Path) -> list[tuple[bytes, dict[str, Any]]]:
    """parse_key_lines of the file at `path`; KeyFileError when it cannot be read or parsed."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise KeyFileError(f"cannot read the API key file {path}: {getattr(err, 'strerror', None) or err}") \
            from None
    return parse_key_lines(text, f"API key file {path}")


class Key:
    """One accepted key: its digest, its limits, its token bucket and its units in flight.  A call holds the Key it
    came in with, so a reload that drops the key never disturbs the calls it has in flight; a key kept by a reload
    keeps this object (its bucket and its calls in flight), with the limits its line now gives."""

    __slots__ = ("digest", "rate", "concurrent", "burst", "tokens", "refilled", "inflight")

    def __init__(self, digest: bytes, rate: float, concurrent: int, now: float):
        self.digest, self.inflight, self.refilled = digest, 0, now
        self.limit(rate, concurrent)
        self.tokens = self.burst

    def limit(self, rate: float, concurrent: int) -> None:
        self.rate, self.concurrent, self.burst = rate, concurrent, max(1.0, rate)
        self.tokens = min(getattr(self, "tokens", self.burst), self.burst)


class OneAtATime:
    """Runs of a piece of work (a reload), never two at once, the last always after the last asked for: a run asked
    for while one is under way returns at once (None) and that one runs the work again when it is done."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._asked = self._running = False

    def run(self, work: Callable[[], bool]) -> bool | None:
        """Whether any of the runs this call made returned True; None when the run under way takes it over."""
        with self._lock:
            self._asked = True
            if self._running:
                return None
            self._running = True
        done = False
        while self._again():
            try:
                done = work() or done
            except BaseException:
                with self._lock:
                    self._running = False
                raise
        return done

    def _again(self) -> bool:
        """Whether the work runs (again): a run was asked for since it last started; if not, the runs are over."""
        with self._lock:
            again, self._asked = self._asked, False
            self._running = again
            return again
