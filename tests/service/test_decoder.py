"""Continuous batching for Generate: concurrent streams share decode steps and each gets exactly its solo tokens."""

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
from tests.serving import slow_runs


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
    decoder = server.registry.models[variant].scheduler.decoder
    sched = server.registry.models[variant].scheduler
    steps, rows = decoder.steps, sched.rows_run
    slow_runs(sched, 0.01)  # every step takes a while, so streams are active at the same time
    try:
        got = together([lambda p=p: generate(stub, variant, p, 12) for p in prompts]
                       + [lambda: generate(stub, variant, "seed me", 12, **sampled)])
    finally:
        del sched.run
    assert got == alone
    decode_rows = sum(len(r) - 1 for r in got)  # every token after the first comes from the decode loop
    assert decode_rows >= 40
    assert decoder.steps - steps < decode_rows / 2, "streams stepped on their own"
    assert sched.rows_run - rows >= decode_rows


def test_a_stream_joins_at_a_step_boundary_and_a_cancelled_one_leaves_without_stalling(server, stub):
    sched = server.registry.models["alibi"].scheduler
    long_alone = generate(stub, "alibi", "long", 40)
    short_alone = generate(stub, "alibi", "short", 10)
    slow_runs(sched, 0.02)
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
        del sched.run
    assert short == short_alone
    assert [(m.token.id, m.text, m.finish_reason) for m in first + rest] == long_alone
    for _ in range(100):  # the cancelled stream leaves the loop
        if sched.decoder.active == 0:
            break
        time.sleep(0.02)
    assert sched.decoder.active == 0


def test_deadline_mid_stream_ends_only_that_stream(server, stub):
    sched = server.registry.models["t5"].scheduler
    slow_runs(sched, 0.05)
    try:
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(pb.GenerateRequest(model="t5", prompt=pb.Prompt(text="a"), max_new_tokens=64),
                               timeout=0.6))
        ok = generate(stub, "t5", "b", 3)
    finally:
        del sched.run
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert len(ok) == 3 and ok[-1][2] == "length"


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 255), min_size=1, max_size=40))
def test_incremental_text_equals_decoding_everything(ids):
    push = ByteTokenizer().stream()
    for n, token in enumerate(ids, 1):
        assert push(token) == tokenizer.decode(ids[:n])


def test_incremental_text_across_multibyte_characters():
    ids = tokenizer.encode("é中🙂e\u0301")
    push = ByteTokenizer().stream()
    texts = [push(t) for t in ids]
    assert texts[-1] == "é中🙂e\u0301" and texts[0] == "\ufffd" and np.all([isinstance(t, str) for t in texts])
