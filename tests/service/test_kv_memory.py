"""The compact layout's memory at a burst of streams (service/compact.py): a prompt call's present keys and values
are written into pages of their own and given back once the decode batch has copied them, and the batch's buffers
hold what the rows need and no more, on a tiny artifact whose fast graph is compact."""

import mmap
import weakref
from dataclasses import dataclass

import numpy as np

from service.artifacts import load_artifact
from service.compact import CompactCache
from service.executor import Executor
from service.jobs import Job
from tests.service.conftest import ARTIFACT_OF
from tests.service.test_kvcache import _resident_bytes


@dataclass
class Stream:
    cached: int
    room: int


def _mapping_owner(array: np.ndarray) -> np.ndarray:
    """The array at the end of a view's chain of bases: the one over the memory itself."""
    while isinstance(array.base, np.ndarray):
        array = array.base
    return array


def _prompts(count: int, tokens: int, seed: int) -> list[Job]:
    rng = np.random.default_rng(seed)
    return [Job(rng.integers(1, 60, tokens), None, want_state=True, last_only=True) for _ in range(count)]


def test_a_prompt_calls_keys_and_values_are_pages_of_their_own_let_go_once_the_batch_holds_them(fast_artifacts):
    """Each fetched present tensor lies in a mapping of its own (not onnxruntime's arena, which would keep its memory
    for as long as the worker runs); the rows' results are those onnxruntime gives the same feeds without them; and
    once the batch has copied the rows in, nothing holds those mappings any more (so the kernel has the pages back)."""
    model = load_artifact(fast_artifacts / ARTIFACT_OF["compact"], threads=1)
    spec, jobs = model.kv, _prompts(6, 9, seed=1)
    results = Executor(model).run(jobs)
    owners = {id(o): o for r in results for o in map(_mapping_owner, r.state)}
    assert len(owners) == len(spec.state)  # one array per present output, shared by the rows' views
    assert all(isinstance(o.base, memoryview) and isinstance(o.base.obj, mmap.mmap) for o in owners.values())

    _equal_to_a_plain_run(model, jobs, results, 9)
    gone = [weakref.ref(o) for o in owners.values()]
    del owners
    cache = CompactCache(spec)
    cache.regroup([], [r.state for r in results], [Stream(9, 20)] * len(jobs))
    assert all(ref() is None for ref in gone)
    assert all(r.state == [] for r in results)


def test_the_buffers_of_32_streams_prompts_hold_what_the_rows_need(fast_artifacts):
    """32 streams of 40-token prompts, each to generate up to 30 tokens, join at once: the buffers are 32 row slots
    of the 70 positions each stream may reach (the bytes counted here from the geometry, not from the cache), and
    right after the join only the pages of the 40 positions written are resident."""
    model = load_artifact(fast_artifacts / ARTIFACT_OF["compact"], threads=1)
    spec, rows, prompt, new = model.kv, 32, 40, 30
    results = Executor(model).run(_prompts(rows, prompt, seed=2))
    cache = CompactCache(spec)
    cache.regroup([], [r.state for r in results], [Stream(prompt, prompt + new)] * rows)
    item = np.dtype(spec.dtype).itemsize
    need = len(spec.state) * rows * spec.kv_heads * (prompt + new) * spec.head_dim * item
    assert cache.rows == rows and cache.nbytes == need, (cache.nbytes, need)
    segments = len(spec.state) * rows * spec.kv_heads  # one (capacity, Dh) run of memory per row and head
    written = segments * prompt * spec.head_dim * item
    resident = sum(_resident_bytes(buf) for buf in cache.buffers)
    assert resident <= written + 2 * mmap.PAGESIZE * segments, (resident, written)


def _equal_to_a_plain_run(model, jobs: list[Job], results: list, tokens: int) -> None:
    """Each row's logits and cache are those of onnxruntime's own outputs for the same feeds."""
    graph, spec = model.graph(maps=False), model.kv
    feeds, last = graph.codec.prompt_feeds(spec, jobs)
    feeds[graph.logits_positions] = last.astype(np.int64)[:, None]
    plain = dict(zip(["logits", *spec.outputs], graph.session.run(["logits", *spec.outputs], feeds), strict=True))
    for b, r in enumerate(results):
        assert np.array_equal(r.logits, plain["logits"][b, :1])
        for name, tensor in zip(spec.outputs, r.state, strict=True):
            assert np.array_equal(tensor, plain[name][b][:, :tokens])
