"""bench worker-memory splits a process's resident set by what holds it, from /proc/PID/smaps: a child process that
maps a weights file and a shared anonymous buffer (as service/compact.py's KV buffers are made) and touches known
amounts of each has them counted in their own parts, and its private heap apart."""

import subprocess
import sys

import numpy as np

from bench.worker_memory import PARTS, parts

CHILD = """
import mmap, sys, numpy as np
weights = np.memmap(sys.argv[1], np.uint8, mode="r")
_ = int(weights[::4096].sum())  # every page of the file read
kv = np.frombuffer(mmap.mmap(-1, 48 << 20), np.uint8)
kv[::4096] = 1  # every page of the buffer written
heap = np.ones(64 << 20, np.uint8)  # private
print("ready", flush=True)
sys.stdin.read()
"""


def test_the_parts_attribute_a_mapped_file_a_shared_buffer_and_private_memory(tmp_path):
    weights = tmp_path / "fast.onnx.data"
    np.random.default_rng(0).integers(0, 255, 32 << 20, dtype=np.uint8).tofile(weights)
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(weights)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        got = parts(child.pid, weights.resolve())
    finally:
        child.communicate("", timeout=60)
    assert set(got) <= set(PARTS)
    mb = 1.024  # a MiB (1024 KiB) in the parts' unit (1000 KiB)
    assert 32 * mb <= got["weights file"] <= 33 * mb
    assert 48 * mb <= got["KV cache"] <= 49 * mb
    assert got["private"] >= 64 * mb  # the heap array, the interpreter's own beside it
    assert got["libraries and other files"] > 0  # the interpreter and numpy's shared objects
