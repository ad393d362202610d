"""glibc malloc settings for a process that moves large messages (attention maps, KServe tensors).

With glibc's defaults a block over the mmap threshold (128 KiB, adjusted upward only after such a block is
freed) is mapped and unmapped on every request, and the heap top over the trim threshold is handed back to the
kernel after every free; protobuf's arenas then fault in fresh pages for each large message.  Measured on the
2-CPU VM (bench/results, section 2): serialising a 0.5 MiB PredictResponse of 16 attention maps took 2.9 ms and
parsing it 2.5 ms; with both thresholds raised, 0.2 ms each.

Raising the mmap threshold alone makes it worse (the heap top is then trimmed on every free), so both are set.
The cost is that up to `trim` bytes of freed heap stay resident per malloc arena, and glibc gives every thread
its own arena up to 8 per core (16 here; gRPC's workers and onnxruntime's callers each got one): the arenas are
capped at 2 (M_ARENA_MAX).  In `make soak` runs of 4000 requests (service.ortenv's shared onnxruntime arena in
both) that took the peak resident memory from ~430 MB to ~360 MB; a 2-CPU worker's threads rarely contend.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_ARENA_MAX = -1, -3, -8  # <malloc.h>
MMAP_THRESHOLD = 32 << 20  # glibc's ceiling for the dynamic threshold on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX)
TRIM_THRESHOLD = 64 << 20
ARENAS = 2
OPERATOR = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_ARENA_MAX", "GLIBC_TUNABLES")

_tuned: bool | None = None


def tune(mmap_threshold: int = MMAP_THRESHOLD, trim_threshold: int = TRIM_THRESHOLD, arenas: int = ARENAS) -> bool:
    """Raise glibc's mmap and trim thresholds and cap its arenas for this process (once; early, before many
    threads have allocated: glibc fixes its arena limit when the ninth arena is made).  False where the C library
    is not glibc, or where the operator set any of OPERATOR themselves (theirs win)."""
    global _tuned
    if _tuned is not None:
        return _tuned
    _tuned = False
    if any(k in os.environ for k in OPERATOR):
        log.info("malloc thresholds left to the environment")
        return False
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl or another C library: nothing to tune
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    _tuned = all([mallopt(M_MMAP_THRESHOLD, mmap_threshold), mallopt(M_TRIM_THRESHOLD, trim_threshold),
                  mallopt(M_ARENA_MAX, arenas)])
    return _tuned
