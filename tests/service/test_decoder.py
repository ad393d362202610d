"""Continuous batching for Generate: concurrent streams share decode steps and each gets exactly its solo tokens."""

import logging
import threading
import time

import grpc
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from model import tokenizer
from protos.posenc.v1 import posenc_pb2 as pb
from service.tokenizer import ByteTokenizer
from tests.serving import hook, slow_runs


def generate(stub, model, text, n, **kw):
    return [(m.token.id, m.text, m.finish_reason)
            for m in stub.Generate(pb.GenerateRequest(model=model, prompt=pb.Prompt(text=text), max_new_tokens=n,
                                                      **kw), timeout=60)]


def together(calls):
    """Run the calls at once (a barrier), return their results in order."""
    out = [None] * len(calls)
    barrier = threading.Barrier(len(calls))

    def run(i, fn):
        barrier.wait()
        out[i] = fn()

    threads = [threading.Thread(target=run, args=(i, fn)) for i, fn in enumerate(calls)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    return out


@pytest.mark.parametrize("variant", ["rope", "cpe", "learned", "deberta"])
def test_concurrent_streams_share_steps_and_equal_their_solo_tokens(server, stub, variant):
    prompts = [("ab" * n)[:n] + "x" for n in range(1, 9)]
    sampled = {"temperature": 0.9, "top_k": 20, "seed": 7}
    alone = [generate(stub, variant, p, 12) for p in prompts] + [generate(stub, variant, "seed me", 12, **sampled)]
    sched = server.registry.engine(variant)
    steps, rows = sched.stats.steps, sched.stats.rows_run
    previous = slow_runs(sched, 0.01)  # every step takes a while, so streams are active at the same time
    try:
        got = together([lambda p=p: generate(stub, variant, p, 12) for p in prompts]
                       + [lambda: generate(stub, variant, "seed me", 12, **sampled)])
    finally:
        sched.use(previous)
    assert got == alone
    decode_rows = sum(len(r) - 1 for r in got)  # every token after the first comes from the decode loop
    assert decode_rows >= 40
    assert sched.stats.steps - steps < decode_rows / 2, "streams stepped on their own"
    assert sched.stats.rows_run - rows >= decode_rows


def test_more_generate_streams_than_sixteen_are_in_the_loop_at_once_over_grpc(server, stub):
    """A gRPC stream holds a server thread until its last token: the default thread pool lets 24 run together."""
    sched = server.registry.engine("learned")
    peak, done = 0, threading.Event()
    previous = slow_runs(sched, 0.01)
    try:
        runner = threading.Thread(target=lambda: (together([lambda: generate(stub, "learned", "s", 30)] * 24),
                                                  done.set()))
        runner.start()
        while not done.wait(0.005):
            peak = max(peak, sched.active)
        runner.join()
    finally:
        sched.use(previous)
    assert peak > 16


def test_a_stream_joins_at_a_step_boundary_and_a_cancelled_one_leaves_without_stalling(server, stub):
    sched = server.registry.engine("alibi")
    long_alone = generate(stub, "alibi", "long", 40)
    short_alone = generate(stub, "alibi", "short", 10)
    previous = slow_runs(sched, 0.02)
    try:
        long_call = stub.Generate(pb.GenerateRequest(model="alibi", prompt=pb.Prompt(text="long"), max_new_tokens=40),
                                  timeout=60)
        first = [next(long_call) for _ in range(5)]  # running before the others arrive
        doomed = stub.Generate(pb.GenerateRequest(model="alibi", prompt=pb.Prompt(text="doomed"),
                                                  max_new_tokens=64), timeout=60)
        next(doomed)
        short = generate(stub, "alibi", "short", 10)
        doomed.cancel()
        rest = list(long_call)
    finally:
        sched.use(previous)
    assert short == short_alone
    assert [(m.token.id, m.text, m.finish_reason) for m in first + rest] == long_alone
    for _ in range(100):  # the cancelled stream leaves the loop
        if sched.active == 0:
            break
        time.sleep(0.02)
    assert sched.active == 0


def test_deadline_mid_stream_ends_only_that_stream(server, stub):
    sched = server.registry.engine("t5")
    previous = slow_runs(sched, 0.05)
    try:
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(pb.GenerateRequest(model="t5", prompt=pb.Prompt(text="a"), max_new_tokens=64),
                               timeout=0.6))
        ok = generate(stub, "t5", "b", 3)
    finally:
        sched.use(previous)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert len(ok) == 3 and ok[-1][2] == "length"


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 255), max_size=8), st.lists(st.integers(0, 255), min_size=1, max_size=40))
def test_incremental_text_adds_up_to_decoding_everything(prompt, ids):
    """Pushed one at a time after a prompt, the pieces add up to the whole decode minus the prompt's, and no piece
    is ever taken back: what has been sent is always a beginning of the final text (no half character)."""
    detok = ByteTokenizer().detokenizer(prompt)
    pieces = [detok.push(t)[0] for t in ids]
    want = tokenizer.decode(prompt + ids)[len(tokenizer.decode(prompt)):]  # a prompt ending mid-character too
    assert "".join(pieces) + detok.flush() == want
    assert all(want.startswith("".join(pieces[:n])) for n in range(len(pieces)))


def test_incremental_text_across_multibyte_characters():
    ids = tokenizer.encode("é中🙂e\u0301")
    detok = ByteTokenizer().detokenizer()
    texts = [detok.push(t)[0] for t in ids]
    assert texts == ["", "é", "", "", "中", "", "", "", "🙂", "e", "", "\u0301"]


# --- the loop itself, in process: joins, leaves, slow readers, rotation -------------------------------------

class Loop:
    """A model's engine without the RPC: opens streams as Operations.generate does.  Its batch's
    cache has the layout asked for: padded (the tiny artifact's exact graph), or compact (the same model with its
    fast graph)."""

    def __init__(self, roots, variant, max_rows=64, max_tokens=256, layout="padded"):
        from service.artifacts import load_artifact
        from service.engine import engine_for
        from service.settings import Batching

        self.model = load_artifact(roots[layout] / variant, threads=1)
        # plain steps: these tests count a step's rows as its tokens (speculation: tests/hf/test_speculative.py)
        self.sched = engine_for(self.model, Batching(max_batch=max_rows, max_wait_ms=1, batch_tokens=max_tokens,
                                                     speculate=0))
        assert self.model.layout.name == layout and isinstance(self.sched.batch.cache, self.model.layout.cache)

    def open(self, prompt, n, temperature=0.0, seed=None, top_k=0):
        from service.generation import Generation
        from service.jobs import Job
        from service.sampling import SamplingParams

        ids = tokenizer.encode(prompt)
        params = SamplingParams(max_new_tokens=n, temperature=temperature, top_k=top_k, seed=seed)
        s = Generation(ids, params, ByteTokenizer().detokenizer(ids), limit=self.model.max_positions)
        first = s.advance(self.sched.submit(Job(np.asarray(ids, np.int64), None)).result(timeout=30))
        if not first[3]:
            self.sched.add(s)
        return s, first

    def read(self, s, first, delay=0.0, stop_after=None):
        """The stream's tokens as its reader takes them (delay seconds per token; stop_after: cancel then)."""
        got, item = [first[0]], first
        while not item[3]:
            if stop_after is not None and len(got) >= stop_after:
                s.cancelled = True  # what Operations.generate's finally does when the client goes away
                return got
            item = s.out.get(timeout=30)
            assert not isinstance(item, BaseException), item
            self.sched.wake()
            got.append(item[0])
            time.sleep(delay)
        return got

    def alone(self, prompt, n, **kw):
        return self.read(*self.open(prompt, n, **kw))

    def close(self):
        self.sched.close()


@pytest.fixture(scope="module")
def roots(tiny_artifacts, fast_artifacts):
    """Where Loop finds a variant's artifact for each layout (compact: rope's fast graph)."""
    return {"padded": tiny_artifacts[0], "compact": fast_artifacts}


LAYOUTS = pytest.mark.parametrize("layout", ["padded", "compact"])  # the decode-loop suite runs against both caches


STREAMS = [("a", 30, {}), ("the cat", 22, {}), ("x" * 17, 26, {"temperature": 0.8, "seed": 3}),
           ("hello there, general", 18, {"temperature": 1.2, "top_k": 9, "seed": 11}), ("q", 9, {})]


@pytest.mark.parametrize(("variant", "layout"), [("rope", "padded"), ("rope", "compact"), ("cpe", "padded"),
                                               ("deberta", "padded"), ("t5", "padded")])  # cpe: a fixed-size state
def test_staggered_joins_slow_readers_and_a_cancel_leave_every_stream_its_solo_tokens(roots, variant, layout,
                                                                                     caplog):
    caplog.set_level(logging.ERROR, logger="service.batch")
    loop = Loop(roots, variant, layout=layout)
    try:
        alone = [loop.alone(p, n, **kw) for p, n, kw in STREAMS]
        steps, rows = loop.sched.stats.steps, loop.sched.stats.rows_run
        sizes = []  # rows in each decode step
        loop.sched.stats.on_step = sizes.append
        delays = [0.0, 0.004, 0.0, 0.02, 0.001]  # one reader far slower than the others: its row leaves and returns
        out = [None] * len(STREAMS)

        def run(i):
            time.sleep(0.003 * i)  # joins at different steps
            p, n, kw = STREAMS[i]
            out[i] = loop.read(*loop.open(p, n, **kw), delay=delays[i])

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(STREAMS))]
        doomed = threading.Thread(target=lambda: out.append(loop.read(*loop.open("bye", 60), stop_after=5)))
        for t in threads + [doomed]:
            t.start()
        for t in threads + [doomed]:
            t.join(timeout=120)
        assert out[:len(STREAMS)] == alone
        assert len(out[-1]) == 5  # cancelled after five tokens
        decode_rows = sum(len(a) - 1 for a in alone)
        # streams share steps: how many depends on the machine's speed (a lagging reader's row leaves and returns),
        # so what is asserted is that steps of several rows happen and every token came from a step's row
        assert len(sizes) == loop.sched.stats.steps - steps and max(sizes) >= 2, "streams stepped on their own"
        assert sum(sizes) >= decode_rows and loop.sched.stats.rows_run - rows >= decode_rows
        for _ in range(100):  # the cancelled stream leaves the loop too
            if loop.sched.active == 0:
                break
            time.sleep(0.02)
        assert loop.sched.active == 0
        assert not caplog.records, "the loop logged a failed step or regroup"  # (one ending its streams unseen)
    finally:
        loop.close()


@pytest.mark.parametrize(("variant", "layout"), [("alibi", "padded"), ("rope", "compact")])
def test_a_row_far_ahead_of_its_reader_leaves_with_its_state_and_comes_back(roots, variant, layout):
    loop = Loop(roots, variant, layout=layout)
    try:
        long_prompt = "a much longer prompt, read at once"
        want_slow, want_fast = loop.alone("slow", 40), loop.alone(long_prompt, 40)
        fast = loop.open(long_prompt, 40)
        slow = loop.open("slow", 40)  # shares the batch, its row left-padded to the longer one
        while True:  # nobody reads: both run ahead of their readers, then the loop stops stepping
            steps = loop.sched.stats.steps
            time.sleep(0.1)
            if loop.sched.stats.steps == steps:
                break
        assert slow[0].out.qsize() > 0 and fast[0].out.qsize() > 0
        assert loop.read(*fast) == want_fast  # its reader waits: the unread row steps aside, pads and all
        assert loop.sched.stats.taken_out >= 1
        assert loop.read(*slow) == want_slow  # back in the batch with its own cache: the same tokens
    finally:
        loop.close()


@LAYOUTS
def test_more_streams_than_rows_take_turns_and_each_gets_its_solo_tokens(roots, layout):
    loop = Loop(roots, "rope", max_rows=2, layout=layout)
    try:
        prompts = [f"turn {i}" + "." * i for i in range(5)]
        alone = [loop.alone(p, 30) for p in prompts]
        got = together([lambda p=p: loop.read(*loop.open(p, 30)) for p in prompts])
        assert got == alone
        assert loop.sched.stats.taken_out >= 1  # rows that ran their turn gave way with their state
    finally:
        loop.close()


@LAYOUTS
def test_prompts_prefilled_in_pieces_beside_running_streams_get_the_tokens_of_whole_prompts(roots, layout):
    """Prompts longer than the engine's token budget run in pieces between the running streams' steps; every
    stream's tokens equal those of a loop that runs each prompt whole and alone."""
    loop, whole = Loop(roots, "rope", max_tokens=8, layout=layout), Loop(roots, "rope", layout=layout)
    try:
        running = [("r", 40, {}), ("run on", 40, {"temperature": 0.9, "seed": 5})]
        late = [("a prompt longer than the budget" + "!" * i, 12, {}) for i in range(3)] + [
            ("sampled after a long prompt", 12, {"temperature": 1.1, "top_k": 7, "seed": 2})]
        alone = [whole.alone(p, n, **kw) for p, n, kw in running + late]
        assert whole.sched.stats.pieces == 0
        out = [None] * len(alone)

        def run(i, p, n, kw):
            out[i] = loop.read(*loop.open(p, n, **kw), delay=0.002)

        threads = [threading.Thread(target=run, args=(i, *r)) for i, r in enumerate(running)]
        for t in threads:
            t.start()
        for _ in range(60000):  # the first streams are decoding when the long prompts arrive (bounded: 60 s)
            if loop.sched.stats.steps >= 3:
                break
            time.sleep(0.001)
        assert loop.sched.stats.steps >= 3
        threads += [threading.Thread(target=run, args=(len(running) + i, *r)) for i, r in enumerate(late)]
        for t in threads[len(running):]:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert out == alone
        assert loop.sched.stats.pieces >= 3 * len(late)  # 30-odd tokens in pieces of 8
    finally:
        loop.close()
        whole.close()


@LAYOUTS
def test_a_failed_step_ends_its_streams_and_the_loop_goes_on(roots, layout):
    loop = Loop(roots, "rope", layout=layout)
    try:
        want = loop.alone("after", 6)
        s, first = loop.open("doomed", 20)
        previous = hook(loop.sched, lambda work: (_ for _ in ()).throw(RuntimeError("boom")))  # every call fails
        with pytest.raises(AssertionError, match="boom"):
            loop.read(s, first)
        loop.sched.use(previous)
        assert loop.alone("after", 6) == want
    finally:
        loop.close()


def test_a_rebuild_out_of_memory_ends_its_streams_and_the_loop_goes_on(roots, monkeypatch):
    """The padded batch's rebuild for a joining stream fails half-way (MemoryError on its second cache tensor): the
    running stream and the joining one are both told RESOURCE_EXHAUSTED, and a later stream gets its solo tokens
    (the compact layout's: tests/hf/test_compact_served.py)."""
    from service.errors import ResourceExhausted

    loop = Loop(roots, "rope")
    try:
        want = loop.alone("after", 6)
        m, real_zeros, calls, armed = loop.model, np.zeros, [], threading.Event()

        def zeros(shape, dtype=float, *args, **kwargs):  # the two-row batch's cache tensors
            if armed.is_set() and isinstance(shape, tuple) and len(shape) == 4 and shape[0] == 2 and shape[2] > 0 \
                    and (shape[1], shape[3]) == (m.kv_heads, m.head_dim):
                calls.append(shape)
                if len(calls) == 2:
                    raise MemoryError(f"cannot allocate {shape}")
            return real_zeros(shape, dtype, *args, **kwargs)

        monkeypatch.setattr(np, "zeros", zeros)
        results = {}

        def read(key, s, first):
            while True:
                item = s.out.get(timeout=30)
                loop.sched.wake()
                if isinstance(item, BaseException) or item[3]:
                    results[key] = item
                    return

        previous = slow_runs(loop.sched, 0.005)  # 40 slow steps: the joining stream finds it running
        steps = loop.sched.stats.steps
        threads = [threading.Thread(target=read, args=("running", *loop.open("running", 40)))]
        threads[0].start()
        for _ in range(6000):  # bounded: 60 s
            if loop.sched.stats.steps >= steps + 2:
                break
            time.sleep(0.01)
        armed.set()
        threads.append(threading.Thread(target=read, args=("joining", *loop.open("joining", 40))))
        threads[1].start()
        for t in threads:
            t.join(timeout=60)
        assert len(calls) == 2 and not any(t.is_alive() for t in threads), calls
        for key in ("running", "joining"):
            assert isinstance(results[key], ResourceExhausted) and "out of memory" in str(results[key]), results
        armed.clear()
        loop.sched.use(previous)
        assert loop.alone("after", 6) == want
    finally:
        loop.close()


def test_greedy_rows_equal_torch_log_softmax_at_the_argmax():
    """The decode loop's greedy rows skip the log-softmax: token and log-probability against torch's."""
    import torch

    from service.generation import greedy_rows

    logits = (np.random.default_rng(3).standard_normal((32, 4099)) * 6).astype(np.float32)
    logits[5, 17] = 80.0  # a row sure of its token
    tokens, logprobs = greedy_rows(logits)
    want = torch.log_softmax(torch.from_numpy(logits).double(), dim=-1)
    assert tokens.tolist() == want.argmax(dim=-1).tolist()
    assert np.allclose(logprobs, want.max(dim=-1).values.numpy(), atol=1e-6, rtol=0)


def test_a_held_row_takes_the_most_likely_other_token_with_its_own_log_probability():
    """min_new_tokens: a row whose argmax is a barred (end-of-sequence) id takes the most likely token outside the
    barred ids (torch's topk past them), its log-probability under the whole row (torch's log-softmax, nothing
    masked); a held row whose argmax is not barred, and every other row, is as before.  Generation.barred drops an
    id past the head, which a model's configuration may name."""
    import torch

    from service.generation import Generation, greedy_rows
    from service.sampling import SamplingParams

    logits = (np.random.default_rng(5).standard_normal((6, 256)) * 4).astype(np.float32)  # the byte tokenizer's
    top2 = torch.from_numpy(logits).topk(2, dim=-1).indices
    g = Generation([1, 2], SamplingParams(max_new_tokens=4, min_new_tokens=2), ByteTokenizer().detokenizer([1, 2]),
                   eos=frozenset({int(top2[1, 0]), int(top2[3, 0]), 7, 300}))
    assert g.holds() and g.holds(1) and not g.holds(2)
    barred = g.barred(logits.shape[1])
    assert sorted(barred.tolist()) == sorted({int(top2[1, 0]), int(top2[3, 0]), 7})
    tokens, logprobs = greedy_rows(logits, None, [(1, barred), (2, barred), (3, barred)])
    want = logits.argmax(axis=1)
    want[1], want[3] = top2[1, 1], top2[3, 1]
    assert tokens.tolist() == want.tolist()
    full = torch.log_softmax(torch.from_numpy(logits).double(), dim=-1)
    assert np.allclose(logprobs, full[np.arange(6), want].numpy(), atol=1e-6, rtol=0)
    emitted = g.take(full[1].numpy().astype(np.float32))  # the sampling path (its first token) bars the same ids
    assert emitted.id == int(top2[1, 1]) and emitted.logprob == pytest.approx(float(full[1, top2[1, 1]]), abs=1e-6)


def test_greedy_rows_compute_log_probabilities_only_where_wanted():
    """Rows whose reader does not read the token's log-probability get None and the same token; the others the
    value torch's log-softmax gives, whichever rows are left out."""
    import torch

    from service.generation import greedy_rows

    logits = (np.random.default_rng(4).standard_normal((9, 1031)) * 5).astype(np.float32)
    want = torch.log_softmax(torch.from_numpy(logits).double(), dim=-1).max(dim=-1).values.numpy()
    for wanted in (np.zeros(9, bool), np.arange(9) % 3 == 0, np.arange(9) != 4):
        tokens, logprobs = greedy_rows(logits, wanted)
        assert tokens.tolist() == logits.argmax(axis=1).tolist()
        assert [lp is None for lp in logprobs] == (~wanted).tolist()
        assert np.allclose([lp for lp in logprobs if lp is not None], want[wanted], atol=1e-6, rtol=0)


def test_a_lone_streams_speculation_backs_off_when_its_drafts_fail_and_grows_when_they_hold():
    """service/batch.py's Guess, step by step, against its rule written out by hand: two more drafts after a step
    that took them all (at most K), one fewer otherwise (at least 1); after a step that took none, 1, 2, 4, ... plain
    steps before the next proposal (at most BACKOFF_MAX), the count starting again after a step that took any."""
    from service.batch import BACKOFF_MAX, Guess

    g = Guess(object(), 4)
    sizes = []

    def step(taken=None):
        k = g.size()
        sizes.append(k)
        if k and taken is not None:
            g.taken(min(taken, k), k)

    step(4)  # all four taken: stays at K
    step(1)  # one of four: 3
    step(0)  # none of 3: 2, and one plain step
    step()
    step(0)  # none of 2: 1, and two plain steps
    step()
    step()
    step(0)  # none of 1: four plain steps
    for _ in range(4):
        step()
    step(1)  # one of one: all taken, 3; the misses start again
    step(0)  # none of 3: 2, one plain step
    step()
    step(2)  # two of two: 4
    assert sizes == [4, 4, 3, 0, 2, 0, 0, 1, 0, 0, 0, 0, 1, 3, 0, 2]
    assert g.size() == 4
    for _ in range(12):  # failures in a row: the wait doubles up to BACKOFF_MAX
        g.taken(0, 1)
        assert g.wait == min(BACKOFF_MAX, 2 ** (g.misses - 1))
    assert g.wait == BACKOFF_MAX == 32 and g.k == 1
