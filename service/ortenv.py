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

import threading

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


def session_options(threads: int, arena: bool = True, shared: bool = True) -> ort.SessionOptions:
    """Options of every worker session: `threads` intra-op threads; with `shared`, the process's arena (when
    `arena`) and threads that sleep between runs; otherwise onnxruntime's defaults (an arena of the session's own,
    spinning threads)."""
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    opts.intra_op_num_threads = threads
    opts.enable_cpu_mem_arena = arena  # off: buffers go back to malloc after each run
    if shared:
        opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
        if arena:
            shared_arena()
            opts.add_session_config_entry("session.use_env_allocators", "1")
    return opts


class Session(ort.InferenceSession):
    """An InferenceSession whose run() first waits for a slot of `gate` (one gate for every model of a server)."""

    gate: threading.Semaphore | None = None

    def run(self, output_names, input_feed, run_options=None):
        gate = self.gate
        if gate is None:
            return super().run(output_names, input_feed, run_options)
        with gate:
            return super().run(output_names, input_feed, run_options)
