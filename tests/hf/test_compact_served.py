"""A worker serving a compact fast graph (GroupQueryAttention, each row's cache from slot 0, the decode batch's
caches in shared buffers written in place): streams joining at different times, running past the buffers' first
capacity, a slow reader's row leaving and coming back, prompts run in pieces, Score and Predict — each answer
equal to transformers' forward of that sequence alone."""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest
import torch

from export.fuse import add_to_artifact
from service import compact
from service.sampling import SamplingParams
from service.scheduler import Job
from tests.serving import start

TOL = 1e-4


@pytest.fixture(scope="module")
def served(hf_families, tmp_path_factory):
    """The tiny imported LLaMA with its fast graph (compact: a RoPE model without windows), served alone."""
    src = hf_families["llama"]["artifact"]
    models = tmp_path_factory.mktemp("compact")
    folder = models / "llama"
    folder.mkdir()
    for p in src.iterdir():
        os.link(p, folder / p.name)
    entry = add_to_artifact(folder)
    assert entry["layout"] == "compact"
    srv = start(models)
    yield srv, hf_families["llama"]["hf"]
    srv.stop(grace=1)


def greedy(hf, ids: list[int], n: int) -> list[int]:
    """transformers' forward of the whole sequence at every step (no cache), its argmax appended."""
    ids = list(ids)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[-n:]


def test_streams_on_shared_buffers_equal_transformers_alone(served):
    srv, hf = served
    model = srv.registry.models["llama"]
    assert model.layout == "compact" and model.fast is not None
    decoder = model.scheduler.decoder
    rng = np.random.default_rng(11)
    prompts = [rng.integers(1, hf.config.vocab_size, n).tolist() for n in (3, 8, 13, 21)]
    n = compact.GROW + 6  # past the capacity the batch's buffers start with: they grow mid-stream
    seen = []  # (buffer address, capacity) at every step
    decoder.on_step = lambda rows: seen.append((decoder._shared.buffers[0].ctypes.data, decoder._shared.capacity))
    rebuilds, remade = decoder.rebuilds, decoder._shared.remade
    out = [None] * len(prompts)

    def run(i):
        time.sleep(0.01 * i)  # joins at different steps
        toks = []
        for _, item in srv.ops.generate("llama", [(None, prompts[i])], SamplingParams(max_new_tokens=n,
                                                                                      ignore_eos=True)):
            if hasattr(item, "id"):
                toks.append(item.id)
                if i == 0 and len(toks) % 10 == 0:
                    time.sleep(0.05)  # a slow reader: its row may run ahead, leave with its cache and come back
        out[i] = toks

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    decoder.on_step = None
    for i, p in enumerate(prompts):
        assert out[i] == greedy(hf, p, n), f"stream {i} differs from transformers"
    # the buffers are written in place: new buffers only where they were made anew (rows past their slots, the
    # longest row at their end), and streams joining and leaving within the slots move rows instead
    remade = decoder._shared.remade - remade
    assert len({addr for addr, _ in seen}) <= remade + 1 and remade < decoder.rebuilds - rebuilds < len(seen)
    assert max(cap for _, cap in seen) >= len(prompts[-1]) + n


def test_pieces_score_and_predict_on_the_compact_graph_equal_transformers(served):
    srv, hf = served
    model = srv.registry.models["llama"]
    rng = np.random.default_rng(12)
    ids = rng.integers(1, hf.config.vocab_size, 40).tolist()
    with torch.no_grad():
        want = torch.log_softmax(hf(torch.tensor([ids])).logits[0], -1).numpy()
    _, logprobs, _ = srv.ops.score("llama", None, ids)  # every position's logits
    assert np.abs(np.array(logprobs) - want[np.arange(39), ids[1:]]).max() <= TOL
    top = srv.ops.predict("llama", None, ids, top_k=3).top  # the last position's alone
    assert [t for t, _, _ in top] == list(np.argsort(-want[-1], kind="stable")[:3])
    sched, budget = model.scheduler, model.scheduler.max_tokens
    sched.max_tokens = 16  # a 40-token prompt in three pieces, each on the cache of the ones before
    try:
        pieces = sched.pieces
        result = sched.submit(Job(np.asarray(ids, np.int64), None, last_only=True)).result(60)
        assert sched.pieces - pieces >= 3
    finally:
        sched.max_tokens = budget
    assert result.logits.shape == (1, hf.config.vocab_size) and result.state[0].shape[1] == 40
    assert np.abs(torch.log_softmax(torch.tensor(result.logits[0]), -1).numpy() - want[-1]).max() <= TOL
