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
                warmup: int = 3, pause_s: float = 0.02, block_warmup: int = 2) -> dict[str, dict[str, float]]:
    """Time several engines in alternating blocks so drift on a shared machine hits them all alike.

    The order rotates every round, so no engine always runs right after the same other one (a runtime whose
    threads still spin from the previous block slows the next); a pause of pause_s before each block lets
    those threads go to sleep, and block_warmup untimed calls wake the engine's own threads again (measured on
    the 2-CPU VM: without both, PyTorch ran ~2x slower for ~70 ms after an onnxruntime block).  Each engine's
    block medians are kept in round_ms: paired_ratio compares two engines round by round."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    names = list(fns)
    samples: dict[str, list[float]] = {k: [] for k in fns}
    rounds: dict[str, list[float]] = {k: [] for k in fns}
    done = 0
    while done < repeat:
        n = min(block, repeat - done)
        shift = len(rounds[names[0]]) % len(names)
        for name in names[shift:] + names[:shift]:
            fn, block_ms = fns[name], []
            time.sleep(pause_s)
            for _ in range(block_warmup):
                fn()
            for _ in range(n):
                start = time.perf_counter()
                fn()
                block_ms.append((time.perf_counter() - start) * 1000)
            samples[name] += block_ms
            rounds[name].append(statistics.median(block_ms))
        done += n
    out = {}
    for name, s in samples.items():
        s.sort()
        out[name] = {"median_ms": statistics.median(s), "p10_ms": s[int(0.1 * (len(s) - 1))],
                     "p90_ms": s[int(0.9 * (len(s) - 1))], "n": len(s), "round_ms": rounds[name]}
    return out


def paired_ratio(times: dict[str, dict], num: str, den: str) -> float:
    """Median over rounds of num's block median / den's block median: each ratio from blocks run back to back,
    so a machine that is slower for a minute moves both sides of it alike."""
    return statistics.median(a / b for a, b in zip(times[num]["round_ms"], times[den]["round_ms"], strict=True))
