"""Timing helpers shared by the benchmarks: warm up, repeat, report median and spread.  Never asserts."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def measure(fn: Callable[[], object], repeat: int, warmup: int = 3) -> dict[str, float]:
    """Milliseconds per call: median, p10, p90 and the number of timed calls."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1000)
    samples.sort()
    return {"median_ms": statistics.median(samples), "p10_ms": samples[int(0.1 * (len(samples) - 1))],
            "p90_ms": samples[int(0.9 * (len(samples) - 1))], "n": len(samples)}


def interleaved(fns: dict[str, Callable[[], object]], repeat: int, block: int = 10,
                warmup: int = 3) -> dict[str, dict[str, float]]:
    """Time several engines in alternating blocks so drift on a shared machine hits them all alike."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    samples: dict[str, list[float]] = {k: [] for k in fns}
    done = 0
    while done < repeat:
        n = min(block, repeat - done)
        for name, fn in fns.items():
            for _ in range(n):
                start = time.perf_counter()
                fn()
                samples[name].append((time.perf_counter() - start) * 1000)
        done += n
    out = {}
    for name, s in samples.items():
        s.sort()
        out[name] = {"median_ms": statistics.median(s), "p10_ms": s[int(0.1 * (len(s) - 1))],
                     "p90_ms": s[int(0.9 * (len(s) - 1))], "n": len(s)}
    return out
