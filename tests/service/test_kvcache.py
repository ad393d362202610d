"""The KV-cache contract (service/kvcache.py) that every layout registered in service/layouts.py keeps, run against
each one on a tiny artifact whose fast graph has it, with torch's forward over each row's whole sequence as the
reference: prompts in pieces batched with other rows' pieces, a batch that streams join and leave (with their
state, and back), grows past its room and shrinks when a long stream has gone; every row's logits at every step
are those of its sequence run alone."""

import json
import re
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from export import artifact
from service.artifacts import load_artifact
from service.compact import CompactCache, CompactCodec
from service.errors import ArtifactRejected
from service.executor import Executor
from service.jobs import Job
from service.kvcache import Layout
from service.layouts import LAYOUTS
from tests.model.helpers import tiny_model
from tests.service.conftest import ARTIFACT_OF

ATOL = 1e-4


def test_every_registered_layout_has_a_tiny_artifact_here():
    assert set(ARTIFACT_OF) == set(LAYOUTS)


def test_a_layout_is_added_in_one_place(fast_artifacts, tmp_path, monkeypatch):
    """A fast graph whose model.json names a layout the worker does not list is refused in one line naming it; one
    class registered in service/layouts.py is all it takes to serve it: the artifact check accepts its name and its
    inputs, and the model's record carries its codec and the decode batch's cache class (a toy layout here: the compact
    one renamed)."""
    copy = tmp_path / "toy"
    shutil.copytree(fast_artifacts / ARTIFACT_OF["compact"], copy)
    meta = json.loads((copy / "model.json").read_text())
    meta["fast"]["layout"] = "toy"
    (copy / "model.json").write_text(json.dumps(meta))
    artifact.write_manifest(copy, None)  # re-signed: the manifest vouches for the edit
    with pytest.raises(ArtifactRejected, match="^model.json's fast entry has layout 'toy'; this worker knows padded, "
                                               "compact$"):
        load_artifact(copy, threads=1)

    class ToyCodec(CompactCodec):
        name = "toy"

    class ToyCache(CompactCache):
        pass

    monkeypatch.setitem(LAYOUTS, ToyCodec.name, Layout(ToyCodec, ToyCache))
    model = load_artifact(copy, threads=1)
    assert model.layout == Layout(ToyCodec, ToyCache) and model.graph(maps=False).codec is ToyCodec
    assert type(model.layout.cache(model.kv)) is ToyCache


def test_the_registry_line_in_architecture_md_is_the_one_in_layouts_py():
    """ARCHITECTURE.md section 10's example registers a paged layout beside the two: without it, it is the line
    service/layouts.py has."""
    root = Path(__file__).resolve().parents[2]
    section = (root / "ARCHITECTURE.md").read_text().split("## 10. Adding a KV-cache layout")[1].split("\n## ")[0]
    (line,) = re.findall(r"```python\n(.*?)\n```", section, re.S)
    paged = ", Layout(PagedCodec, PagedCache)"
    assert paged in line
    assert line.replace(paged, "") in (root / "service" / "layouts.py").read_text()


class Row(SimpleNamespace):
    """A stream as the cache sees it (cached, room), with its tokens so far for the reference."""

    @property
    def cached(self):
        return len(self.tokens)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_a_batch_in_every_layout_gives_each_row_the_logits_of_its_sequence_alone(fast_artifacts, layout):
    variant = ARTIFACT_OF[layout]
    model = load_artifact(fast_artifacts / variant, threads=1)
    assert model.layout is LAYOUTS[layout]
    reference = tiny_model(variant)  # the weights the tiny artifact was exported from (tests/conftest.py)
    rng = np.random.default_rng(21)
    executor = Executor(model)

    def alone(tokens):
        with torch.no_grad():
            return reference(torch.tensor([tokens])).logits[0].numpy()

    # prompts: every row's first piece in one call, then the rest of each on its past, batched (a layout may split)
    rows = [Row(tokens=rng.integers(0, 256, n).tolist(), room=0) for n in (7, 12, 3)]
    first = executor.run([Job(np.asarray(r.tokens[:2]), None) for r in rows])
    rest = executor.run([Job(np.asarray(r.tokens[2:]), res.state) for r, res in zip(rows, first, strict=True)])
    for r, res in zip(rows, rest, strict=True):
        assert np.allclose(res.logits, alone(r.tokens)[2:], atol=ATOL)
        r.state, r.room = res.state, r.cached + 3  # rooms the steps below outgrow: the cache must grow

    cache, outside = model.layout.cache(model.kv), []

    def steps(batch, n):
        for _ in range(n):
            cache.grow(batch + outside)
            ids = rng.integers(0, 256, (len(batch), 1))
            logits = executor.step(ids, cache)
            for b, r in enumerate(batch):
                r.tokens.append(int(ids[b, 0]))
                assert np.allclose(logits[b], alone(r.tokens)[-1], atol=ATOL), (layout, b, r.cached)
            assert cache.lengths.tolist() == [r.cached for r in batch]

    def regroup(batch, keep, enter):
        order = cache.regroup(keep, [r.state for r in enter], [batch[b] for b in keep] + enter + outside)
        assert sorted(order) == sorted(keep)
        return [batch[b] for b in order] + enter

    batch = regroup([], [], rows[:2])  # two join an empty batch
    steps(batch, 4)
    for r in rows:  # from here on every stream may go 40 further: room to regroup in place
        r.room = r.cached + 40
    batch = regroup(batch, [0, 1], rows[2:])  # a third joins the running two
    steps(batch, 5)
    gone = batch[0]
    gone.state = cache.take(0)  # it leaves with its state (ahead of its reader) ...
    outside.append(gone)
    batch = regroup(batch, [1, 2], [])
    steps(batch, 3)
    outside.remove(gone)
    batch = regroup(batch, list(range(len(batch))), [gone])  # ... and comes back
    steps(batch, 3)
    long = Row(tokens=rng.integers(0, 256, 60).tolist(), room=200)
    long.state = executor.run([Job(np.asarray(long.tokens), None)])[0].state
    batch = regroup(batch, list(range(len(batch))), [long])
    steps(batch, 2)
    batch = regroup(batch, [b for b, r in enumerate(batch) if r is not long], [])  # the long stream finished
    if cache.oversized(batch):  # memory held for it is let go at a regroup
        batch = regroup(batch, list(range(len(batch))), [])
    assert not cache.oversized(batch)
    steps(batch, 3)
    batch = regroup(batch, [], [])  # every stream leaves at once
    assert cache.rows == 0
    again = Row(tokens=rng.integers(0, 256, 5).tolist(), room=20)
    again.state = executor.run([Job(np.asarray(again.tokens), None)])[0].state
    batch = regroup(batch, [], [again])  # and the empty batch takes a stream in
    steps(batch, 2)
    cache.clear()
    assert cache.rows == 0


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_a_regroup_that_makes_new_memory_never_holds_the_old_cache_whole(fast_artifacts, layout):
    """Eight long rows and a ninth joining: the cache is made again (padded: always; compact: past its row slots),
    tensor by tensor, each old tensor and each entering cache let go once copied, so the peak is what the batch holds
    afterwards plus two tensors of what it held before (the one being copied, and its kept rows gathered), not the
    old cache whole (numpy's allocations as tracemalloc counts them: the compact buffers, mappings of their own, are
    given np.empty as their allocator here)."""
    import tracemalloc

    model = load_artifact(fast_artifacts / ARTIFACT_OF[layout], threads=1)
    cache = CompactCache(model.kv, allocate=np.empty) if layout == "compact" else model.layout.cache(model.kv)
    rng, n = np.random.default_rng(5), 2000
    rows = [Row(tokens=[0] * n, room=n + 1) for _ in range(9)]

    def state():
        return [rng.random((model.kv_heads, n, model.head_dim), dtype=np.float32) for _ in model.kv.state]

    tracemalloc.start()
    try:
        start = tracemalloc.get_traced_memory()[0]
        cache.regroup([], [state() for _ in range(8)], rows[:8])
        entering = [state()]
        before = tracemalloc.get_traced_memory()[0] - start  # the eight rows' cache and the ninth row's own
        tracemalloc.reset_peak()
        cache.regroup(list(range(8)), entering, rows)
        after, peak = (m - start for m in tracemalloc.get_traced_memory())
    finally:
        tracemalloc.stop()
    assert cache.rows == 9 and after > 0.9 * before  # the ninth row is in, nothing was lost
    assert peak <= after + 2 * before / len(model.kv.state) + 2**16, (layout, before, after, peak)


def _resident_bytes(array: np.ndarray) -> int:
    """Bytes of the array's pages the kernel has mapped (mincore(2))."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    page = mmap.PAGESIZE
    start = array.ctypes.data // page * page
    length = array.ctypes.data + array.nbytes - start
    pages = (ctypes.c_ubyte * ((length + page - 1) // page))()
    assert libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(length), pages) == 0, ctypes.get_errno()
    return sum(p & 1 for p in pages) * page


def test_streams_whose_prompts_are_coming_get_row_slots_when_the_batch_is_made(fast_artifacts):
    """Prompts still being prefilled (`coming`) get their row slots when the batch is made: the rows that join later
    move in without new buffers, each row's cache intact, and the slots no row has used yet are not resident
    memory.  Without `coming` the buffers would be made again once the rows outgrow their first Tuning.rows."""
    model = load_artifact(fast_artifacts / ARTIFACT_OF["compact"], threads=1)
    cache, rng, n, count = CompactCache(model.kv), np.random.default_rng(6), 3000, 12
    assert count > cache.tuning.rows
    rows = [Row(tokens=[0] * n, room=n + 1) for _ in range(count)]
    states = [[rng.random((model.kv_heads, n, model.head_dim), dtype=np.float32) for _ in model.kv.state]
              for _ in range(count)]
    copies = [[t.copy() for t in s] for s in states]
    cache.regroup([], [states[0]], rows[:1], coming=count - 1)
    made, slots = cache.remade, cache.buffers[0].shape[0]
    assert slots >= count
    resident = sum(_resident_bytes(buf) for buf in cache.buffers)
    assert resident <= 2 * cache.nbytes / slots, (resident, cache.nbytes, slots)  # the one row written, not the slots
    order = cache.regroup([0], states[1:], rows)
    assert cache.remade == made and order == [0] and cache.rows == count
    for b in range(count):
        assert all(np.array_equal(t, c) for t, c in zip(cache.take(b), copies[b], strict=True)), b


def test_a_cache_buffer_the_kernel_cannot_map_is_a_memory_error(monkeypatch):
    """No address space for a compact buffer is MemoryError (the decode loop's RESOURCE_EXHAUSTED), not OSError."""
    import mmap

    from service import compact

    def refuse(*args, **kwargs):
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(mmap, "mmap", refuse)
    with pytest.raises(MemoryError, match="KV cache buffer"):
        compact.buffer((8, 2, 64, 16))
