"""The prefix cache (service/prefix.py) on real onnxruntime sessions: a prompt that starts on a recent prompt's cached
blocks answers what the same prompt answers on a worker without the cache (Predict's last logits, Score, greedy
Generate, OpenAI's echo with top candidates), within 1e-5; the byte bound holds with the least recently used blocks
evicted; a reloaded model never reads the blocks of the one it replaced; prompts sharing a prefix at once; the
Prometheus counters."""

from __future__ import annotations

import dataclasses
import os
import threading
import urllib.request

import numpy as np
import pytest

from service.artifacts import load_artifact
from service.operations import Operations
from service.prefix import BLOCK, reusable
from service.registry import Registry
from service.sampling import SamplingParams
from service.settings import Batching, Limits

TOL = 1e-5
rng = np.random.default_rng(5)
SHARED = rng.integers(1, 256, 70).tolist()  # a context of 4 whole blocks and 6 tokens
ENDINGS = [rng.integers(1, 256, n).tolist() for n in (9, 23, 1, 40)]


def operations(folder, mb: float) -> Operations:
    model = load_artifact(folder, threads=1)
    return Operations(Registry({model.name: model}, Limits(), Batching(max_wait_ms=0, prefix_cache_mb=mb)))


def answers(ops: Operations, name: str, ids: list[int]) -> dict:
    """Everything a request reads from its prompt's run: Predict's last logits, Score, 6 greedy tokens, the echo's
    log-probabilities with 5 top candidates each."""
    predicted = ops.predict(name, None, ids)
    _, score, _ = ops.score(name, None, ids)
    greedy = [e.id for _, e in ops.generate(name, [(None, ids)], SamplingParams(max_new_tokens=6, ignore_eos=True))
              if not hasattr(e, "prompt")]
    echo = [g for _, g in ops.generate(name, [(None, ids)], SamplingParams(max_new_tokens=0, logprobs=5,
                                                                           prompt_logprobs=True),
                                       allow_zero_tokens=True)][0].prompt_logprobs
    return {"last": predicted.result.logits[-1], "score": score, "greedy": greedy, "echo": echo}


def same(a: dict, b: dict) -> None:
    assert np.allclose(a["last"], b["last"], atol=TOL, rtol=0)
    assert np.allclose(a["score"], b["score"], atol=TOL, rtol=0) and len(a["score"]) == len(b["score"])
    assert a["greedy"] == b["greedy"]
    assert len(a["echo"]) == len(b["echo"])
    for (lp, top), (lq, toq) in zip(a["echo"][1:], b["echo"][1:], strict=True):
        assert abs(lp - lq) <= TOL
        assert [i for i, _ in top] == [i for i, _ in toq]
        assert np.allclose([v for _, v in top], [v for _, v in toq], atol=TOL, rtol=0)


def folder_of(request, tiny_artifacts, fast_artifacts):
    kind = request.param
    return (fast_artifacts / kind.split("-")[0]) if kind.endswith("fast") else tiny_artifacts[0] / kind


@pytest.fixture(params=["rope-fast", "alibi-fast", "rope"])  # compact and padded fast graphs, an exact graph alone
def pair(request, tiny_artifacts, fast_artifacts):
    folder = folder_of(request, tiny_artifacts, fast_artifacts)
    warm, cold = operations(folder, 64), operations(folder, 0)
    yield warm, cold, folder.name
    warm.registry.close()
    cold.registry.close()


def test_prompts_on_cached_prefixes_answer_as_cold_runs(pair):
    warm, cold, name = pair
    stats = warm.registry.prefix.stats_of(name)
    for i, ending in enumerate(ENDINGS):
        ids = SHARED + ending
        got = answers(warm, name, ids)
        if i:  # every later prompt's requests start on the blocks the earlier ones left
            assert stats.hits >= 4 * i and stats.saved >= 4 * i * (4 * BLOCK - 1)
        same(got, answers(cold, name, ids))
    assert cold.registry.prefix.stats_of(name).hits == 0 and not cold.registry.prefix.blocks
    hits = stats.hits
    same(answers(warm, name, SHARED + ENDINGS[0]), answers(cold, name, SHARED + ENDINGS[0]))  # a prompt again: whole
    assert stats.hits == hits + 4


def test_a_prompt_longer_than_the_budget_starts_past_its_cached_pieces(tiny_artifacts):
    warm, cold = operations(tiny_artifacts[0] / "rope", 64), operations(tiny_artifacts[0] / "rope", 0)
    try:
        long = rng.integers(1, 256, 300).tolist()  # 2 pieces of the 256-token budget cold
        warm.score("rope", None, long + [5, 6])
        stats = warm.registry.engine("rope").stats
        pieces = stats.pieces
        _, lp, _ = warm.score("rope", None, long + [7, 8, 9])
        assert stats.pieces == pieces + 1  # one piece past the cached 287 tokens (18 blocks less one)
        assert np.allclose(lp, cold.score("rope", None, long + [7, 8, 9])[1], atol=TOL, rtol=0)
    finally:
        warm.registry.close()
        cold.registry.close()


def test_models_whose_blocks_would_differ_never_use_it(tiny_artifacts):
    cpe = load_artifact(tiny_artifacts[0] / "cpe", threads=1)
    assert not reusable(cpe)  # a fixed-size state of its own beside the keys and values
    ops = Operations(Registry({"cpe": cpe}, Limits(), Batching(max_wait_ms=0, prefix_cache_mb=64)))
    try:
        for ending in ENDINGS[:2]:
            ops.score("cpe", None, SHARED + ending)
        assert not ops.registry.prefix.blocks and ops.registry.prefix.stats_of("cpe").hits == 0
    finally:
        ops.registry.close()
    rope = load_artifact(tiny_artifacts[0] / "rope", threads=1)
    assert reusable(rope)
    whole = dataclasses.replace(rope, meta=dataclasses.replace(rope.meta, whole_prompts=True))  # dynamic scaling's
    assert not reusable(whole)


def test_the_byte_bound_evicts_the_least_recently_used(tiny_artifacts):
    model = load_artifact(tiny_artifacts[0] / "rope", threads=1)
    per_block = sum(BLOCK * model.kv_heads * model.head_dim * 4 for _ in model.meta.state) + BLOCK * 8
    ops = Operations(Registry({"rope": model}, Limits(), Batching(max_wait_ms=0)))
    ops.registry.prefix.max_bytes = 10 * per_block  # ten blocks
    cache, stats = ops.registry.prefix, ops.registry.prefix.stats_of("rope")
    try:
        prompts = [rng.integers(1, 256, 4 * BLOCK + 3).tolist() for _ in range(4)]  # 4 blocks each
        for p in prompts[:3]:
            ops.predict("rope", None, p)
            assert cache.nbytes <= cache.max_bytes
        assert stats.evictions == 2 and len(cache.blocks) == 10 and cache.nbytes == 10 * per_block
        ops.predict("rope", None, prompts[1])  # touched: now the most recent
        ops.predict("rope", None, prompts[3])  # 4 more blocks: prompt 0's remaining and prompt 2's last go
        hits = stats.hits
        ops.predict("rope", None, prompts[1])
        assert stats.hits == hits + 1 and stats.saved >= 4 * BLOCK
        misses = stats.misses
        ops.predict("rope", None, prompts[0][:BLOCK + 1])
        assert stats.misses == misses + 1
    finally:
        ops.registry.close()


def test_a_reloaded_model_never_reads_the_blocks_of_the_one_it_replaced(tiny_artifacts):
    old = dataclasses.replace(load_artifact(tiny_artifacts[0] / "rope", threads=1), name="m")
    ops = Operations(Registry({"m": old}, Limits(), Batching(max_wait_ms=0)))
    try:
        ids = SHARED + ENDINGS[0]
        ops.score("m", None, ids)
        engine = ops.registry.engine("m")
        root = engine.prompts.root
        assert ops.registry.prefix.held(root) > 0
        new = dataclasses.replace(load_artifact(tiny_artifacts[0] / "alibi", threads=1), name="m")  # another model,
        ops.registry.install(ops.registry.prepare(new))  # under the same name
        hits = ops.registry.prefix.stats_of("m").hits
        _, got, _ = ops.score("m", None, ids)
        assert ops.registry.prefix.stats_of("m").hits == hits  # a miss: its own root
        cold = operations(tiny_artifacts[0] / "alibi", 0)
        assert np.allclose(got, cold.score("alibi", None, ids)[1], atol=TOL, rtol=0)
        cold.registry.close()
        for _ in range(200):  # retired and closed: its blocks dropped
            if not engine.running and ops.registry.prefix.held(root) == 0:
                break
            threading.Event().wait(0.05)
        assert ops.registry.prefix.held(root) == 0
    finally:
        ops.registry.close()


def test_prompts_sharing_a_prefix_at_once(tiny_artifacts):
    warm, cold = operations(tiny_artifacts[0] / "rope", 64), operations(tiny_artifacts[0] / "rope", 0)
    try:
        prompts = [SHARED + rng.integers(1, 256, n).tolist() for n in range(3, 19)]
        got: dict[int, list[float]] = {}

        def one(i):
            got[i] = warm.score("rope", None, prompts[i])[1]

        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert sorted(got) == list(range(len(prompts)))
        for i, p in enumerate(prompts):
            assert np.allclose(got[i], cold.score("rope", None, p)[1], atol=TOL, rtol=0)
        stats = warm.registry.prefix.stats_of("rope")
        assert stats.hits + stats.misses == len(prompts) and stats.hits >= 1
    finally:
        warm.registry.close()
        cold.registry.close()


def test_metrics_count_hits_misses_tokens_bytes_and_evictions(tiny_artifacts):
    from service.server import Server
    from service.settings import Settings

    models = tiny_artifacts[0].parent / f"prefix-metrics-{os.getpid()}"
    models.mkdir(exist_ok=True)
    if not (models / "rope").exists():
        (models / "rope").mkdir()
        for f in (tiny_artifacts[0] / "rope").iterdir():
            os.link(f, models / "rope" / f.name)
    srv = Server(Settings(model_dir=models, port=0, threads=1, metrics_port=0, http_port=-1,
                          batching=Batching(prefix_cache_mb=1))).start()
    try:
        ops = srv.ops
        for ending in ENDINGS[:3]:
            ops.score("rope", None, SHARED + ending)
        srv.registry.prefix.max_bytes = srv.registry.prefix.nbytes  # what it holds: a new prompt's blocks evict
        ops.score("rope", None, ENDINGS[3] + SHARED)
        body = urllib.request.urlopen(f"http://127.0.0.1:{srv.metrics_port}/metrics", timeout=10).read().decode()
        stats, cache = srv.registry.prefix.stats_of("rope"), srv.registry.prefix
        held = cache.nbytes
    finally:
        srv.stop(grace=1)
    assert (stats.hits, stats.misses, stats.saved, stats.evictions) == (2, 2, 2 * (4 * BLOCK - 1), 6)
    assert f'posenc_prefix_cache_hits_total{{model="rope"}} {float(stats.hits)}' in body
    assert f'posenc_prefix_cache_misses_total{{model="rope"}} {float(stats.misses)}' in body
    assert f'posenc_prefix_cache_tokens_saved_total{{model="rope"}} {float(stats.saved)}' in body
    assert f'posenc_prefix_cache_evictions_total{{model="rope"}} {float(stats.evictions)}' in body
    assert f"posenc_prefix_cache_bytes {float(held)}" in body and 0 < held <= cache.max_bytes
    assert cache.nbytes == 0  # the server stopped: its models' blocks dropped
