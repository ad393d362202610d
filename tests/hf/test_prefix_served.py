"""The prefix cache on an imported LLaMA's compact fast graph, served: OpenAI completions with echo and logprobs (as
lm-evaluation-harness scores multiple-choice answers that share their context), Score and greedy Generate answer on
a worker with the cache what a worker without it answers (1e-5), and transformers' forward (1e-4)."""

from __future__ import annotations

import os
import urllib.request

import numpy as np
import openai
import pytest
import torch

from export.fuse import add_to_artifact
from service.server import Server
from service.settings import Batching, Settings

TOL = 1e-5


@pytest.fixture(scope="module")
def servers(hf_families, tmp_path_factory):
    """The tiny imported LLaMA with its fast graph served twice: with the prefix cache and without it."""
    src = hf_families["llama"]["artifact"]
    models = tmp_path_factory.mktemp("prefix")
    (models / "llama").mkdir()
    for p in src.iterdir():
        os.link(p, models / "llama" / p.name)
    assert add_to_artifact(models / "llama")["layout"] == "compact"
    out = []
    for mb in (64, 0):
        srv = Server(Settings(model_dir=models, port=0, threads=1, metrics_port=-1, http_port=0,
                              batching=Batching(prefix_cache_mb=mb))).start()
        out.append((srv, openai.OpenAI(base_url=f"http://127.0.0.1:{srv.http_port}/v1", api_key="x",
                                       max_retries=0, timeout=60)))
    yield out, hf_families["llama"]["hf"]
    for srv, client in out:
        client.close()
        srv.stop(grace=1)


def echo(client, ids):
    c = client.completions.create(model="llama", prompt=ids, max_tokens=0, echo=True, logprobs=5)
    lp = c.choices[0].logprobs
    return lp.token_logprobs, lp.top_logprobs


def test_choices_sharing_a_context_answer_as_without_the_cache(servers):
    pairs, hf = servers
    (warm, warm_client), (cold, cold_client) = pairs
    rng = np.random.default_rng(3)
    vocab = hf.config.vocab_size
    context = rng.integers(3, vocab, 53).tolist()
    choices = [rng.integers(3, vocab, n).tolist() for n in (2, 5, 1, 8)]
    stats = warm.registry.prefix.stats_of("llama")
    for i, choice in enumerate(choices):
        ids = context + choice
        (a, ta), (b, tb) = echo(warm_client, ids), echo(cold_client, ids)
        assert a[0] is None and b[0] is None
        assert np.allclose(a[1:], b[1:], atol=TOL, rtol=0)
        for x, y in zip(ta[1:], tb[1:], strict=True):
            assert list(x) == list(y) and np.allclose(list(x.values()), list(y.values()), atol=TOL, rtol=0)
        with torch.no_grad():
            ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0].double(), -1)
        want = ref[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].numpy()
        assert np.allclose(a[1:], want, atol=1e-4, rtol=0)
        assert stats.hits == i and stats.saved == i * (3 * 16 - 1)  # each later choice on the context's 3 blocks
    _, score_warm, _ = warm.ops.score("llama", None, context + choices[0])
    _, score_cold, _ = cold.ops.score("llama", None, context + choices[0])
    assert np.allclose(score_warm, score_cold, atol=TOL, rtol=0)
    params = dict(max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    for choice in choices[:2]:
        got = warm_client.completions.create(model="llama", prompt=context + choice, **params).choices[0].text
        assert got == cold_client.completions.create(model="llama", prompt=context + choice, **params).choices[0].text
    assert stats.hits == len(choices) - 1 + 2 and cold.registry.prefix.stats_of("llama").hits == 0


def owned(arrays) -> int:
    """Bytes the arrays keep alive: the memory of each one's owner (the array its buffer belongs to, found by
    following numpy's `base`), each owner counted once."""
    owners = {}
    for a in arrays:
        while isinstance(a.base, np.ndarray):
            a = a.base
        owners[id(a)] = a
    return sum(a.nbytes for a in owners.values())


def test_a_single_kv_head_models_blocks_keep_alive_what_the_gauge_reads(hf_zoo, tmp_path):
    """gpt_bigcode (multi-query: one key/value head) on its exact graph, whose rows come back as views of the call's
    whole present output: the cached blocks keep alive exactly the bytes the cache counts and its Prometheus gauge
    reads, with three prompts sharing one call (a block that kept a view would hold every row's every position)."""
    src = hf_zoo["gpt_bigcode"]["artifact"]
    (tmp_path / "gpt_bigcode").mkdir()
    for p in src.iterdir():
        os.link(p, tmp_path / "gpt_bigcode" / p.name)
    srv = Server(Settings(model_dir=tmp_path, port=0, threads=1, metrics_port=0, http_port=0,
                          batching=Batching(prefix_cache_mb=1))).start()
    try:
        assert srv.registry.models["gpt_bigcode"].meta.sizes.n_kv_heads == 1
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{srv.http_port}/v1", api_key="x", max_retries=0,
                               timeout=60)
        rng = np.random.default_rng(11)
        prompts = [rng.integers(3, 300, n).tolist() for n in (70, 90, 50)]
        assert len(client.completions.create(model="gpt_bigcode", prompt=prompts, max_tokens=1).choices) == 3
        client.close()
        cache = srv.registry.prefix
        blocks = list(cache.blocks.values())
        body = urllib.request.urlopen(f"http://127.0.0.1:{srv.metrics_port}/metrics", timeout=10).read().decode()
        gauge = float(body.split("\nposenc_prefix_cache_bytes ")[1].split()[0])
        kept = owned([t for b in blocks for t in b.kv] + [b.tokens for b in blocks])
    finally:
        srv.stop(grace=1)
    assert len(blocks) == 70 // 16 + 90 // 16 + 50 // 16 and all(t.shape[0] == 1 for b in blocks for t in b.kv)
    assert kept == gauge == sum(b.nbytes for b in blocks)
