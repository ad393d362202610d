"""onnxruntime settings of the worker's sessions: one CPU memory arena shared by every session of the process
instead of one each, intra-op threads that sleep instead of spinning when a run ends, and a limit on how many
sessions run at once.

Measured with `make soak` on the 2-CPU VM (every default model: 14 artifacts, each with an encoding graph; 64
callers; docs/reliability.md): with an arena per session the worker's resident memory climbed with every
rare coincidence of big batches on several models (each arena keeps its own peak), and 14 pools of spinning
threads fought over 2 cores.  One arena, at most two runs at once (the shared arena's peak is then that of two
big batches, not fourteen), two glibc malloc arenas (service.malloc) and threads that do not spin kept the memory
flat and more than doubled the requests per second.  onnxruntime's global thread pool did as well for speed, but
once set up it refuses every per-session pool in the process (tests, benchmarks and the exporter make those).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import threading
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import onnxruntime as ort

_lock = threading.Lock()
_registered = False


def shared_arena() -> None:
    """Register, once per process, the CPU arena that sessions opting in (session.use_env_allocators) share."""
    global _registered
    with _lock:
        if not _registered:
            info = ort.OrtMemoryInfo("Cpu", ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0, ort.OrtMemType.DEFAULT)
            ort.create_and_register_allocator(info, ort.OrtArenaCfg({}))  # onnxruntime's defaults: grow by 2x
            _registered = True


def session_options(threads: int, arena: bool = True, shared: bool = True, spin: bool = False) -> ort.SessionOptions:
    """Options of every worker session: `threads` intra-op threads; with `shared`, the process's arena (when
    `arena`) and threads that sleep between runs unless `spin`; otherwise onnxruntime's defaults (an arena of the
    session's own, spinning threads).

    `spin` keeps the threads spinning between operators, as onnxruntime's default does: a large model's step has
    hundreds of parallel operators, each of which otherwise wakes sleeping threads.  On a 2-core machine shared
    with other work it made the peer model's step slower, not faster (python -m bench.peers_profile, table
    step_graphs: spinning threads take the cores the other processes need), so it stays off unless asked for.
    Spinning threads stop when a run returns (session.force_spinning_stop) instead of spinning on after it: between
    two decode steps the worker's own threads (the engine handing out tokens, the fronts writing them) need the
    cores, and a pool still spinning there took them (bench/results/trees_spin.json)."""
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    opts.intra_op_num_threads = threads
    opts.enable_cpu_mem_arena = arena  # off: buffers go back to malloc after each run
    if shared:
        opts.add_session_config_entry("session.intra_op.allow_spinning", "1" if spin else "0")
        opts.add_session_config_entry("session.force_spinning_stop", "1")
        if arena:
            shared_arena()
            opts.add_session_config_entry("session.use_env_allocators", "1")
    return opts


_libc: ctypes.CDLL | None | bool = False


def release_heap() -> bool:
    """Hand the C heap's free pages back to the kernel (glibc's malloc_trim); False where the C library has none.

    Loading a session parses the whole graph, weights included, and builds the prepacked weights from copies; what
    it frees stays resident in glibc's heap.  Measured on the 135M-parameter peer model (fast graph, the worker's
    options): 1008 MB resident after the load, 720 MB after the trim, the same weights served."""
    global _libc
    if _libc is False:
        name = ctypes.util.find_library("c")
        try:
            _libc = ctypes.CDLL(name) if name else None
            if _libc is not None and not hasattr(_libc, "malloc_trim"):
                _libc = None
        except OSError:
            _libc = None
    if not isinstance(_libc, ctypes.CDLL):
        return False
    _libc.malloc_trim(0)
    return True


class Session(ort.InferenceSession):
    """An InferenceSession whose run() and run_with_iobinding() first wait for a slot of `gate` (one gate for every
    model of a server: --concurrent-runs)."""

    gate: threading.Semaphore | None = None

    def _slot(self) -> AbstractContextManager[Any]:
        return self.gate if self.gate is not None else nullcontext()

    def run(self, output_names: list[str] | None, input_feed: dict[str, Any],
            run_options: ort.RunOptions | None = None) -> list[Any]:
        with self._slot():
            out: list[Any] = super().run(output_names, input_feed, run_options)
            return out

    def run_with_iobinding(self, iobinding: Any, run_options: ort.RunOptions | None = None) -> None:
        with self._slot():
            super().run_with_iobinding(iobinding, run_options)
