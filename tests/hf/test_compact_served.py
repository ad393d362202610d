"""A worker serving a compact fast graph (GroupQueryAttention, each row's cache from slot 0, the decode batch's
caches in shared buffers written in place): streams joining at different times, running past the buffers' first
capacity, a slow reader's row leaving and coming back, the buffers shrinking once a long row has gone, prompts
run in pieces, Score and Predict — each answer equal to transformers' forward of that sequence alone."""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest
import torch

from export.fuse import add_to_artifact
from service.engine import engine_for
from service.jobs import Job
from service.sampling import SamplingParams
from service.settings import Batching, Limits, Tuning
from tests.serving import slow_runs, start

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
    srv = start(models, limits=Limits(long_context=True))  # prompts past max_position_embeddings (256) too
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
    assert model.layout.name == "compact" and model.fast is not None
    engine = srv.registry.engine("llama")
    batch, stats = engine.batch, engine.stats
    rng = np.random.default_rng(11)
    prompts = [rng.integers(1, hf.config.vocab_size, n).tolist() for n in (3, 8, 13, 21)]
    n = Tuning().grow + 6  # past the capacity the batch's buffers start with: they grow mid-stream
    seen = []  # (buffer address, capacity) at every step
    stats.on_step = lambda rows: seen.append((batch.cache.buffers[0].ctypes.data, batch.cache.capacity))
    rebuilds, remade = stats.rebuilds, batch.cache.remade
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
    stats.on_step = None
    for i, p in enumerate(prompts):
        assert out[i] == greedy(hf, p, n), f"stream {i} differs from transformers"
    # the buffers are written in place: new buffers only where they were made anew (rows past their slots, the
    # longest row at their end), and streams joining and leaving within the slots move rows instead
    remade = batch.cache.remade - remade
    assert len({addr for addr, _ in seen}) <= remade + 1 and remade < stats.rebuilds - rebuilds < len(seen)
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
    # an engine of its own on the same model: a budget of 16 tokens (a 40-token prompt in three pieces, each on the
    # cache of the ones before) and no prefix cache (every piece computed, none taken from the blocks the Score
    # above left)
    engine = engine_for(model, Batching(batch_tokens=16, prefix_cache_mb=0))
    try:
        result = engine.submit(Job(np.asarray(ids, np.int64), None, last_only=True)).result(60)
        assert engine.stats.pieces >= 3
    finally:
        engine.close()
    assert result.logits.shape == (1, hf.config.vocab_size) and result.state[0].shape[1] == 40
    assert np.abs(torch.log_softmax(torch.tensor(result.logits[0]), -1).numpy() - want[-1]).max() <= TOL


def wait_for(condition, seconds: float = 60.0) -> bool:
    """Poll until condition() holds (True) or `seconds` pass (False)."""
    until = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > until:
            return False
        time.sleep(0.002)
    return True


def test_buffers_shrink_once_a_long_row_has_gone(served):
    """One long row beside short ones grows the shared buffers to its length; while it steps aside (ahead of its
    slow reader) they keep their size, since it comes back; once it has finished they are made again at what the
    short rows need, and only grow after that (no back and forth).  Every stream's tokens equal transformers'."""
    srv, hf = served
    engine = srv.registry.engine("llama")
    batch, stats = engine.batch, engine.stats
    rng = np.random.default_rng(13)
    shorts = [rng.integers(1, hf.config.vocab_size, n).tolist() for n in (4, 6, 9)]
    long_prompt = rng.integers(1, hf.config.vocab_size, 1500).tolist()
    n_short, n_long = 150, 20
    seen = []  # (rows, capacity, bytes) after every step
    stats.on_step = lambda rows: seen.append((rows, batch.cache.capacity, batch.cache.nbytes))
    previous = slow_runs(engine, 0.005)  # calls 5 ms longer: the short streams run while the long prompt is prefilled
    out, errors = {}, []

    def run(key, prompt, n, aside=False):
        try:
            toks = []
            params = SamplingParams(max_new_tokens=n, ignore_eos=True)
            for _, item in srv.ops.generate("llama", [(None, prompt)], params):
                if hasattr(item, "id"):
                    toks.append(item.id)
                    if aside and len(toks) == 1:  # not read: its row runs ahead and steps aside with its cache
                        taken = stats.taken_out
                        assert wait_for(lambda t=taken: stats.taken_out > t), "the long row never stepped aside"
                        steps = stats.steps
                        assert wait_for(lambda s=steps: stats.steps >= s + 5)  # the short rows step without it
            out[key] = toks
        except Exception as err:  # noqa: BLE001 (reported below)
            errors.append(err)

    try:
        steps = stats.steps
        threads = [threading.Thread(target=run, args=(i, p, n_short)) for i, p in enumerate(shorts)]
        for t in threads:
            t.start()
        assert wait_for(lambda: stats.steps >= steps + 3)  # the short streams decode together
        threads.append(threading.Thread(target=run, args=("long", long_prompt, n_long, True)))
        threads[-1].start()
        for t in threads:
            t.join(timeout=300)
        assert not any(t.is_alive() for t in threads) and not errors, errors
    finally:
        engine.use(previous)
        stats.on_step = None
    for i, p in enumerate(shorts):
        assert out[i] == greedy(hf, p, n_short), f"short stream {i} differs from transformers"
    assert out["long"] == greedy(hf, long_prompt, n_long), "the long stream differs from transformers"
    with_long = [i for i, (rows, _, _) in enumerate(seen) if rows == 4]
    first, last = with_long[0], with_long[-1]
    assert any(seen[i][0] == 3 for i in range(first, last)), "the long row never stepped aside and came back"
    peak = max(b for _, _, b in seen)
    assert all(cap > len(long_prompt) for _, cap, _ in seen[first:last + 1])  # kept while it stepped aside
    after = seen[last + 1:]
    assert len(after) > 10 and after[0][0] == 3 and all(rows <= 3 for rows, _, _ in after)  # the short rows
    # made again at what the short rows need (at most their longest prompt + n_short positions), not the long
    # row's 1,520, and only grown after that
    room = max(map(len, shorts)) + n_short + 1
    caps = [cap for _, cap, _ in after]
    assert caps == sorted(caps) and caps[-1] <= room and after[0][2] * 8 <= peak, (caps, after[0], peak)


def test_a_rebuild_out_of_memory_ends_its_streams_and_the_loop_goes_on(served):
    """The shared buffers' allocation fails (MemoryError) half-way through the rebuild that takes a joining stream
    in: the running stream and the joining one both end with RESOURCE_EXHAUSTED (over gRPC, within a bounded
    wait), and a stream opened afterwards gets transformers' tokens from the same loop."""
    import grpc

    from protos.posenc.v1 import posenc_pb2 as pb
    from protos.posenc.v1 import posenc_pb2_grpc
    from service import compact
    from service.batch import DecodeBatch
    from service.engine import Engine, Parts, build
    from service.registry import Served

    srv, hf = served
    model, settings = srv.registry.models["llama"], srv.settings
    rng = np.random.default_rng(14)
    running = rng.integers(1, hf.config.vocab_size, 5).tolist()  # its buffers: 65 positions, all it will need
    joining = rng.integers(1, hf.config.vocab_size, 100).tolist()  # longer: the buffers are made again for it
    later = rng.integers(1, hf.config.vocab_size, 7).tolist()
    real_buffer, calls = compact.buffer, []

    def buffer(shape, dtype=np.float32):  # the second cache buffer of the joining stream's rebuild
        if armed.is_set() and len(shape) == 4 and shape[1:4:2] == (model.kv_heads, model.head_dim):
            calls.append(shape)
            if len(calls) == 2:
                raise MemoryError(f"cannot allocate {shape}")
        return real_buffer(shape, dtype)

    armed = threading.Event()
    # the model served by an engine whose decode batch's cache takes its buffers from `buffer` (a part given in)
    parts = build(model, settings.batching, settings.tuning, srv.registry.prefix)
    cache = compact.CompactCache(model.kv, settings.tuning, allocate=buffer)
    parts = Parts(parts.prompts, DecodeBatch(cache, model.name, settings.batching.max_batch, parts.stats),
                  parts.executor, parts.stats)
    engine = Engine(model.name, parts, settings.batching, settings.tuning)
    srv.registry.install(Served(model, engine))
    results = {}

    def call(key, ids, n):
        got = []
        try:
            for m in stub.Generate(pb.GenerateRequest(model="llama", prompt=pb.Prompt(tokens=pb.TokenIds(ids=ids)),
                                                      max_new_tokens=n, ignore_eos=True), timeout=60):
                got.append(m.token.id)
            results[key] = got
        except grpc.RpcError as err:
            results[key] = (err.code(), err.details(), len(got))

    previous = slow_runs(engine, 0.005)  # the running stream's 60 steps take a while: the joining one finds it running
    try:
        with grpc.insecure_channel(f"127.0.0.1:{srv.port}") as channel:
            stub = posenc_pb2_grpc.PosencStub(channel)
            steps = engine.stats.steps
            first = threading.Thread(target=call, args=("running", running, 60))
            first.start()
            assert wait_for(lambda: engine.stats.steps >= steps + 2)
            armed.set()
            second = threading.Thread(target=call, args=("joining", joining, 60))
            second.start()
            for t in (first, second):
                t.join(timeout=90)
            assert not first.is_alive() and not second.is_alive()
            assert len(calls) == 2, calls  # the failure happened, once
            for key in ("running", "joining"):
                code, details, _ = results[key]
                assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "out of memory" in details, results[key]
            call("later", later, 30)
    finally:
        engine.use(previous)
    assert results["later"] == greedy(hf, later, 30)
    assert engine.running and wait_for(lambda: engine.active == 0)
    srv.registry.install(srv.registry.prepare(model))  # the other tests' engine, its cache the default one


def test_buffers_shrink_when_a_long_stream_goes_away_while_stepped_aside(served):
    """A long row steps aside (its reader slow), then its client goes away: the batch itself does not change, but
    the next boundary makes the buffers again at what the short rows need, while all of them still run."""
    srv, hf = served
    engine = srv.registry.engine("llama")
    batch, stats = engine.batch, engine.stats
    rng = np.random.default_rng(15)
    shorts = [rng.integers(1, hf.config.vocab_size, n).tolist() for n in (5, 8, 3)]
    long_prompt = rng.integers(1, hf.config.vocab_size, 1200).tolist()
    n_short = 150
    seen = []  # (rows, capacity) after every step
    stats.on_step = lambda rows: seen.append((rows, batch.cache.capacity))
    previous = slow_runs(engine, 0.005)
    out, errors, gone = {}, [], []

    def short(i):
        try:
            params = SamplingParams(max_new_tokens=n_short, ignore_eos=True)
            out[i] = [item.id for _, item in srv.ops.generate("llama", [(None, shorts[i])], params)
                      if hasattr(item, "id")]
        except Exception as err:  # noqa: BLE001 (reported below)
            errors.append(err)

    def long():
        stream = srv.ops.generate("llama", [(None, long_prompt)], SamplingParams(max_new_tokens=100,
                                                                                  ignore_eos=True))
        for _, item in stream:
            if hasattr(item, "id"):  # its first token; then nobody reads, and the client goes away
                taken = stats.taken_out
                if wait_for(lambda t=taken: stats.taken_out > t):
                    gone.append(len(seen))
                stream.close()  # what a front does when its client leaves: the stream is cancelled
                return

    try:
        steps = stats.steps
        threads = [threading.Thread(target=short, args=(i,)) for i in range(len(shorts))]
        for t in threads:
            t.start()
        assert wait_for(lambda: stats.steps >= steps + 3)
        threads.append(threading.Thread(target=long))
        threads[-1].start()
        for t in threads:
            t.join(timeout=300)
        assert not any(t.is_alive() for t in threads) and not errors and gone, errors
    finally:
        engine.use(previous)
        stats.on_step = None
    for i, p in enumerate(shorts):
        assert out[i] == greedy(hf, p, n_short), f"short stream {i} differs from transformers"
    assert any(rows == 4 and cap > len(long_prompt) for rows, cap in seen[:gone[0]])  # it was in the batch
    room = max(map(len, shorts)) + n_short + 1
    # made small again while the three short rows still ran (not only once one of them finished)
    assert any(rows == 3 and cap <= room for rows, cap in seen[gone[0]:]), seen[gone[0]:gone[0] + 20]
