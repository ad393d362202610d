"""A model's engine batching prompt jobs on a real onnxruntime session: padding equivalence, deadlines, queue bound."""

import threading
import time

import numpy as np
import pytest

from model.variants import REGISTRY
from service.artifacts import load_artifact
from service.engine import engine_for
from service.errors import DeadlineExceeded, ResourceExhausted
from service.jobs import Job, MapRequest
from service.prompts import PromptRunner
from service.settings import Batching
from tests.serving import hook


@pytest.fixture(scope="module")
def model(tiny_artifacts):
    root, _ = tiny_artifacts
    return load_artifact(root / "fire", threads=1)


@pytest.mark.parametrize("variant", sorted(REGISTRY))  # every variant; cpe: a fixed-size state beside the KV
def test_mixed_rows_with_and_without_past_equal_each_row_alone(tiny_artifacts, variant):
    model = load_artifact(tiny_artifacts[0] / variant, threads=1)
    sched = engine_for(model, Batching(max_batch=8, max_wait_ms=1))
    try:
        rng = np.random.default_rng(0)
        prompts = [rng.integers(0, 256, n) for n in (3, 11, 6)]
        alone = [sched.executor.run([Job(p, None, MapRequest.FULL)])[0] for p in prompts]
        # decode steps on top of each row's own cache, batched with a fresh prompt
        jobs = [Job(np.array([7]), alone[0].state, MapRequest.FULL),
                Job(np.array([9, 4]), alone[1].state, MapRequest.FULL), Job(prompts[2], None, MapRequest.FULL)]
        batched = sched.executor.run(jobs)
        for job, got in zip(jobs, batched, strict=True):
            want = sched.executor.run([Job(job.ids, job.state, MapRequest.FULL)])[0]
            assert got.batch_size == 3 and want.batch_size == 1
            assert np.allclose(got.logits, want.logits, atol=1e-5)
            assert np.allclose(got.attentions, want.attentions, atol=1e-5)
            for a, b in zip(got.state, want.state, strict=True):
                assert a.shape == b.shape and np.allclose(a, b, atol=1e-5)
    finally:
        sched.close()


def test_expired_job_is_never_run(model):
    calls = []
    sched = engine_for(model, Batching(max_batch=4, max_wait_ms=1))
    hook(sched, lambda work: calls.append(len(work)))
    try:
        late = Job(np.array([1, 2, 3]), None, deadline=time.monotonic() - 1)
        with pytest.raises(DeadlineExceeded, match="not run"):
            sched.submit(late).result(timeout=10)
        fresh = sched.submit(Job(np.array([1, 2, 3]), None)).result(timeout=10)
        assert fresh.logits.shape == (3, 256)
        assert calls == [1]  # only the fresh job reached onnxruntime
    finally:
        sched.close()


def test_bounded_queue(model):
    sched = engine_for(model, Batching(max_batch=1, max_wait_ms=1, max_queue=2))
    try:
        # stop the loop from draining: hold the queue with a slow batch
        running = threading.Event()
        hook(sched, lambda work: (running.set(), time.sleep(0.5)))
        first = []  # a lone job runs in its caller's thread: submit it from another one
        runner = threading.Thread(target=lambda: first.append(sched.submit(Job(np.array([1]), None))))
        runner.start()
        assert running.wait(10)  # the first job is running (a thread merely started may lag); two more fill the queue
        futures = [sched.submit(Job(np.array([1]), None)) for _ in range(2)]
        with pytest.raises(ResourceExhausted, match="queue"):
            sched.submit(Job(np.array([1]), None))
        runner.join(timeout=10)
        assert all(f.result(timeout=10).logits.shape == (1, 256) for f in first + futures)
    finally:
        sched.close()


def test_buckets_group_similar_lengths_and_keep_every_job():
    jobs = [Job(np.zeros(n, np.int64), None) for n in (100, 3, 120, 5, 64, 70, 4)]
    groups = PromptRunner.buckets(jobs)
    assert sorted(j.length for g in groups for j in g) == sorted(j.length for j in jobs)
    assert [[j.length for j in g] for g in groups] == [[3, 4, 5], [64, 70], [100, 120]]
    for g in groups:
        assert max(j.length for j in g) <= 1.25 * min(j.length for j in g) + 8


def test_jobs_that_need_no_state_skip_fetching_it(model):
    sched = engine_for(model, Batching(max_batch=8, max_wait_ms=1))
    try:
        ids = np.arange(1, 12)
        with_state, without = sched.executor.run([Job(ids, None), Job(ids, None, want_state=False)])
        assert with_state.state is not None and len(with_state.state) == 2 * 2  # tiny: 2 layers x (key, value)
        assert without.state is None
        assert np.array_equal(with_state.logits, without.logits)
        (alone,) = sched.executor.run([Job(ids, None, want_state=False)])
        assert alone.state is None and np.allclose(alone.logits, with_state.logits, atol=1e-6)
    finally:
        sched.close()


def test_lone_job_runs_in_the_callers_thread_and_later_arrivals_batch(model):
    sched = engine_for(model, Batching(max_batch=8, max_wait_ms=5))
    ran = []  # (thread name, batch size) per onnxruntime call

    def slow_run(work):
        ran.append((threading.current_thread().name, len(work)))
        if len(ran) == 1:
            time.sleep(0.3)  # the first (inline) run holds the session while six more arrive

    hook(sched, slow_run)
    try:
        ids = np.array([5, 6, 7])
        results = [None] * 7

        def call(i):
            results[i] = sched.submit(Job(ids, None)).result(timeout=10)

        first = threading.Thread(target=call, args=(0,), name="caller-0")
        first.start()
        time.sleep(0.1)
        rest = [threading.Thread(target=call, args=(i,), name=f"caller-{i}") for i in range(1, 7)]
        for t in rest:
            t.start()
        for t in [first, *rest]:
            t.join(timeout=10)
        assert ran[0] == ("caller-0", 1)  # no hand-off to the batching thread
        later = ran[1:]
        assert all(name == f"engine-{model.name}" for name, _ in later)  # queued behind the inline run
        assert sum(n for _, n in later) == 6 and len(later) < 6  # and gathered into batches
        assert all(np.array_equal(r.logits, results[0].logits) for r in results)
        # with nothing queued or running again, the next job is inline once more
        sched.submit(Job(ids, None)).result(timeout=10)
        assert ran[-1] == (threading.current_thread().name, 1)
    finally:
        sched.close()


@pytest.mark.parametrize("variant", ["rope", "cpe"])  # cpe: its fixed-size state is carried from piece to piece
def test_a_prompt_past_the_token_budget_runs_in_pieces_equal_to_one_call(tiny_artifacts, variant):
    model = load_artifact(tiny_artifacts[0] / variant, threads=1)
    sched = engine_for(model, Batching(max_batch=8, max_wait_ms=1, batch_tokens=16))
    try:
        ids = np.random.default_rng(1).integers(0, 256, 40)
        (whole,) = sched.executor.run([Job(ids, None, MapRequest.LAST_ROW)])
        got = sched.submit(Job(ids, None, MapRequest.LAST_ROW)).result(timeout=30)
        assert sched.stats.pieces == 3  # 16 + 16 + 8 tokens, each piece on the cache of the ones before
        assert got.logits.shape == whole.logits.shape and np.allclose(got.logits, whole.logits, atol=1e-5)
        assert got.attentions.shape == whole.attentions.shape
        assert np.allclose(got.attentions, whole.attentions, atol=1e-5)
        for a, b in zip(got.state, whole.state, strict=True):
            assert a.shape == b.shape and np.allclose(a, b, atol=1e-5)
        # full attention maps need every query row over the same keys: such a job runs in one call
        full = sched.submit(Job(ids, None, MapRequest.FULL)).result(timeout=30)
        assert sched.stats.pieces == 3 and full.attentions.shape[-2:] == (40, 40)
    finally:
        sched.close()


def test_the_batch_tokens_flag_sets_every_models_budget(tiny_artifacts):
    """`--batch-tokens 16` on the worker's command line: a 40-token prompt sent over gRPC runs in three pieces, and
    its answer is the one the prompt gets in one call."""
    import grpc

    from protos.posenc.v1 import posenc_pb2 as pb
    from protos.posenc.v1 import posenc_pb2_grpc
    from service.__main__ import parse
    from service.server import Server

    root = tiny_artifacts[0]
    settings = parse(["--model-dir", str(root), "--port", "0", "--http-port", "-1", "--metrics-port", "-1",
                      "--threads", "1", "--prefix-cache-mb", "0", "--batch-tokens", "16"], environ={})
    server = Server(settings).start()
    try:
        sched = server.registry.engine("rope")
        assert sched.prompts.budget == 16
        ids = np.random.default_rng(3).integers(0, 256, 40)
        (whole,) = sched.executor.run([Job(ids, None, MapRequest.NONE)])  # one call: run() takes no budget
        with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            got = posenc_pb2_grpc.PosencStub(channel).Predict(pb.PredictRequest(
                model="rope", prompt=pb.Prompt(tokens=pb.TokenIds(ids=ids.tolist())), top_k=5), timeout=30)
        assert sched.stats.pieces == 3  # 16 + 16 + 8
        last = whole.logits[-1] - np.logaddexp.reduce(whole.logits[-1])
        want = np.argsort(-last)[:5]
        assert [c.token.id for c in got.top] == want.tolist()
        assert np.allclose([c.logprob for c in got.top], last[want], atol=1e-5)
    finally:
        server.stop(grace=1)


def test_calls_without_maps_run_the_fast_graph_and_maps_load_the_exact_one(tiny_artifacts, tmp_path):
    import os
    from types import SimpleNamespace

    from export.fuse import add_to_artifact
    from service import compact

    folder = tmp_path / "rope"
    folder.mkdir()
    for f in (tiny_artifacts[0] / "rope").iterdir():
        os.link(f, folder / f.name)
    add_to_artifact(folder)  # python -m export.fuse: fast.onnx beside model.onnx
    model = load_artifact(folder, threads=1)
    sched = engine_for(model, Batching(max_batch=8, max_wait_ms=1))
    try:
        ids = np.random.default_rng(4).integers(0, 256, 12)
        (plain,) = sched.executor.run([Job(ids, None)])
        # a decode step on that cache, as the decode loop sends it: rope's fast graph is compact (GroupQueryAttention
        # on shared buffers the step writes into)
        assert model.layout.name == "compact"
        shared = compact.CompactCache(model.kv)
        shared.regroup([], [list(plain.state)], [SimpleNamespace(cached=12, room=16)])  # buffers of 16 positions
        step_logits = sched.executor.step(np.array([[7]]), shared)
        assert not model.exact_loaded  # nothing so far needed the exact graph
        (mapped,) = sched.executor.run([Job(ids, None, MapRequest.LAST_ROW)])
        assert model.exact_loaded and mapped.attentions is not None and plain.attentions is None
        assert np.allclose(plain.logits, mapped.logits, atol=1e-5)
        (exact_step,) = sched.executor.run([Job(np.array([7]), mapped.state, MapRequest.LAST_ROW)])
        assert np.allclose(step_logits[0], exact_step.logits[-1], atol=1e-5)
        # the step wrote its key and value into slot 12 of the shared buffers, as the exact graph's present has them
        assert np.allclose(shared.buffers[0][0, :, :13], exact_step.state[0], atol=1e-5)
    finally:
        sched.close()


def test_a_job_wanting_maps_never_takes_its_batchmates_off_the_fast_graph(tiny_artifacts, tmp_path):
    """Queued together, a maps job and a plain job of the same length run in separate calls: the plain one on the
    fast graph with no maps computed for it, the maps one on the exact graph, each equal to its run alone."""
    import os

    from export.fuse import add_to_artifact

    folder = tmp_path / "rope"
    folder.mkdir()
    for f in (tiny_artifacts[0] / "rope").iterdir():
        os.link(f, folder / f.name)
    add_to_artifact(folder)
    model = load_artifact(folder, threads=1)
    sched = engine_for(model, Batching(max_batch=8, max_wait_ms=50))
    calls = []  # per prompt call: whether it computes maps (the exact graph) or not (the fast one)
    hook(sched, lambda work: calls.append(any(j.attention is not MapRequest.NONE for j in work)))
    try:
        ids = np.random.default_rng(5).integers(0, 256, 12)
        (alone,) = sched.executor.run([Job(ids, None)])
        (alone_maps,) = sched.executor.run([Job(ids, None, MapRequest.FULL)])
        calls.clear()
        with sched.session:  # both queue while the session is held, and the engine takes them together
            plain, mapped = Job(ids, None), Job(ids, None, MapRequest.FULL)
            futures = [sched.submit(plain), sched.submit(mapped)]
        got_plain, got_mapped = (f.result(timeout=60) for f in futures)
        assert sorted(calls) == [False, True]  # two calls: one without maps, one with
        assert got_plain.attentions is None and got_mapped.attentions is not None
        assert np.allclose(got_plain.logits, alone.logits, atol=1e-5)
        assert np.allclose(got_mapped.attentions, alone_maps.attentions, atol=1e-6)
    finally:
        sched.close()


@pytest.mark.parametrize("variant", ["alibi", "rope"])  # a padded fast graph, a compact one
def test_fast_graph_calls_compute_the_logits_each_job_asks_for(tiny_artifacts, tmp_path, variant):
    """Jobs wanting the last position's logits alone and jobs wanting every position, batched together, alone and in
    pieces: each gets its own rows, equal to the exact graph's (maps asked, so the exact graph runs)."""
    import os

    from export.fuse import add_to_artifact

    folder = tmp_path / variant
    folder.mkdir()
    for f in (tiny_artifacts[0] / variant).iterdir():
        os.link(f, folder / f.name)
    add_to_artifact(folder)
    model = load_artifact(folder, threads=1)
    assert model.layout.name == ("compact" if variant == "rope" else "padded") and model.logits_positions
    sched = engine_for(model, Batching(max_batch=8, max_wait_ms=50, batch_tokens=24))
    try:
        rng = np.random.default_rng(9)
        short, other, long = (rng.integers(0, 256, n) for n in (9, 6, 40))
        want = {len(x): sched.executor.run([Job(x, None, MapRequest.LAST_ROW)])[0].logits for x in (short, other, long)}
        with sched.session:  # both queue while the session is held, then run as one call (15 <= 24 tokens)
            futures = [sched.submit(Job(short, None, last_only=True)), sched.submit(Job(other, None))]
        a, b = (f.result(60) for f in futures)
        assert b.batch_size == 2 and a.logits.shape == (9, 256)  # the call computed every position for the other
        assert np.allclose(a.logits, want[9], atol=1e-5) and np.allclose(b.logits, want[6], atol=1e-5)
        alone = sched.submit(Job(short, None, last_only=True)).result(60)
        assert alone.logits.shape == (1, 256) and np.allclose(alone.logits[0], want[9][-1], atol=1e-5)
        pieces = sched.stats.pieces
        whole = sched.submit(Job(long, None)).result(60)  # 40 tokens in pieces of at most 24
        last = sched.submit(Job(long, None, last_only=True)).result(60)
        assert sched.stats.pieces - pieces >= 4 and whole.logits.shape == (40, 256) and last.logits.shape == (1, 256)
        assert np.allclose(whole.logits, want[40], atol=1e-5) and np.allclose(last.logits[0], want[40][-1], atol=1e-5)
    finally:
        sched.close()
