"""service.ortenv: the worker's sessions share one onnxruntime arena, and a gate bounds the runs at once; answers
stay those of a session with onnxruntime's defaults."""

import threading

import numpy as np
import pytest

from service.artifacts import load_artifact


def feeds_for(model, ids: np.ndarray) -> dict:
    out = {"input_ids": ids, "attention_mask": np.ones_like(ids)}
    for carried, tensor in zip(model.kv.state, model.kv.empty(len(ids)), strict=True):
        out[carried.input] = tensor
    return out


def test_shared_session_answers_like_its_own(tiny_artifacts):
    root, _ = tiny_artifacts
    ids = np.random.default_rng(0).integers(0, 256, (2, 24)).astype(np.int64)
    for variant in ("rope", "cpe", "t5"):
        shared = load_artifact(root / variant, threads=2, shared=True)
        own = load_artifact(root / variant, threads=2, shared=False, arena=False)
        f = feeds_for(shared, ids)
        assert shared.session.get_session_options().get_session_config_entry("session.use_env_allocators") == "1"
        for a, b in zip(shared.session.run(["logits", "attentions"], f), own.session.run(["logits", "attentions"], f),
                        strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("how", ["run", "iobinding"])  # a plain run, and a decode step's or compact prompt's
def test_gate_holds_runs_until_a_slot_frees(tiny_artifacts, how):
    root, _ = tiny_artifacts
    gate = threading.BoundedSemaphore(1)
    model = load_artifact(root / "rope", threads=2, gate=gate)
    f = feeds_for(model, np.arange(16, dtype=np.int64)[None])
    want = model.session.run(["logits"], f)[0]
    io = model.session.io_binding()
    for name, value in f.items():
        io.bind_cpu_input(name, value)
    io.bind_output("logits")
    got = []

    def call() -> None:
        if how == "run":
            got.append(model.session.run(["logits"], f)[0])
        else:
            model.session.run_with_iobinding(io)
            got.append(io.get_outputs()[0].numpy())
    gate.acquire()  # another run holds the only slot
    runner = threading.Thread(target=call)
    runner.start()
    runner.join(timeout=0.5)
    assert runner.is_alive() and not got  # waiting for the slot, not running
    gate.release()
    runner.join(timeout=60)
    assert not runner.is_alive() and np.array_equal(got[0], want)
    assert gate.acquire(blocking=False)  # the run gave its slot back
    gate.release()


def _resident_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def test_release_heap_returns_freed_heap_pages():
    """Blocks freed below a live one stay resident in glibc's heap until release_heap trims them."""
    import ctypes

    from service.ortenv import release_heap

    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    blocks = [libc.malloc(64 << 10) for _ in range(800)]  # 50 MB below the mmap threshold: heap pages
    for b in blocks:
        ctypes.memset(b, 1, 64 << 10)
    pin = blocks.pop()  # the last one stays: the heap top cannot shrink past it
    for b in blocks:
        libc.free(b)
    before = _resident_mb()
    assert release_heap()
    assert before - _resident_mb() > 25
    libc.free(pin)


def test_threads_sleep_unless_spinning_is_asked_for(tiny_artifacts):
    root, _ = tiny_artifacts
    key = "session.intra_op.allow_spinning"
    for spin, want in ((False, "0"), (True, "1")):
        model = load_artifact(root / "rope", threads=2, spin=spin)
        options = model.session.get_session_options()
        assert options.get_session_config_entry(key) == want
        # spinning lasts while a run does: the pool stops when it returns
        assert options.get_session_config_entry("session.force_spinning_stop") == "1"
