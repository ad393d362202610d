"""Speculative decoding by prompt lookup (service/lookup.py, service/batch.py): a lone greedy stream's drafts checked
in one call give exactly transformers' greedy tokens, on the compact layout (drafts' positions given back by length)
and the padded one (by slicing), with drafts accepted where the text repeats; a stream joined mid-way by a second
goes on with the same tokens; a stop string inside an accepted run ends the stream where plain decoding does; an end of
sequence held back by min_new_tokens inside an accepted run is replaced there as transformers replaces it."""

from __future__ import annotations

import dataclasses
import os
import threading
import time

import numpy as np
import pytest
import torch

from export.fuse import add_to_artifact
from service.sampling import SamplingParams
from tests.serving import start

N = 40


@pytest.fixture(scope="module")
def served(hf_families, tmp_path_factory):
    """The tiny imported LLaMA twice: as imported (padded: its exact graph) and with its fast graph (compact)."""
    src = hf_families["llama"]["artifact"]
    models = tmp_path_factory.mktemp("speculative")
    for name in ("padded", "compact"):
        (models / name).mkdir()
        for p in src.iterdir():
            os.link(p, models / name / p.name)
    assert add_to_artifact(models / "compact")["layout"] == "compact"
    srv = start(models)
    yield srv, hf_families["llama"]["hf"]
    srv.stop(grace=1)


def tokens(srv, name, prompt, params):
    return [item for _, item in srv.ops.generate(name, [(None, prompt)], params) if hasattr(item, "id")]


def speculating(srv, name, k):
    """The model's engine with speculative steps of up to k drafts (0: plain steps); its stats."""
    engine = srv.registry.engine(name)
    engine.batch.speculate = k
    return engine.stats


def prompts(hf):
    """A prompt that repeats itself (the model's greedy answer falls into a loop: drafts are taken) and one that
    does not."""
    head = np.random.default_rng(2).integers(3, hf.config.vocab_size, 6).tolist()
    return {"repeats": head * 4, "random": np.random.default_rng(5).integers(3, hf.config.vocab_size, 24).tolist()}


@pytest.mark.parametrize("name", ["compact", "padded"])
def test_speculative_tokens_equal_transformers_greedy(served, name):
    srv, hf = served
    stats = speculating(srv, name, 6)
    assert srv.registry.engine(name).batch.speculate == 6  # the layout gives positions back
    for kind, prompt in prompts(hf).items():
        ids = torch.tensor([prompt])
        with torch.no_grad():
            want = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=N, do_sample=False)
        before = stats.accepted, stats.rejected
        got = tokens(srv, name, prompt, SamplingParams(max_new_tokens=N, ignore_eos=True))
        assert [t.id for t in got] == want[0, len(prompt):].tolist(), kind
        assert [t.reason for t in got] == [""] * (N - 1) + ["length"]
        if kind == "repeats":
            assert stats.accepted > before[0]  # drafts were taken: fewer calls than tokens
        assert stats.rejected >= before[1]
    sample = srv.registry.metrics.registry.get_sample_value  # what /metrics shows
    for result in ("accepted", "rejected"):
        assert sample("posenc_speculative_tokens_total", {"model": name, "result": result}) == getattr(stats, result)


def test_drafts_that_fail_are_proposed_less_and_the_tokens_stay_those_of_plain_decoding(served):
    """The prompt that does not repeat: the lone stream's drafts mostly fail, so with the back-off (service/batch.py's
    Guess) it proposes fewer of them than a stream proposing K at every step would, with the same tokens; on the
    prompt that repeats, the drafts keep being taken."""
    srv, hf = served
    stats = speculating(srv, "compact", 6)
    params = SamplingParams(max_new_tokens=N, ignore_eos=True)
    prompt = prompts(hf)["random"]

    def proposed():
        before = stats.accepted, stats.rejected
        got = [t.id for t in tokens(srv, "compact", prompt, params)]
        return got, stats.accepted - before[0], stats.rejected - before[1]

    guarded, taken, failed = proposed()
    srv.registry.engine("compact").batch.adapt = False  # K drafts at every step
    try:
        always, taken_always, failed_always = proposed()
    finally:
        srv.registry.engine("compact").batch.adapt = True
    assert guarded == always == [t.id for t in tokens(srv, "compact", prompt, SamplingParams(
        max_new_tokens=N, ignore_eos=True))]
    assert failed_always > 2 * taken_always  # the drafts here mostly fail
    assert failed < failed_always and taken + failed < taken_always + failed_always
    before = stats.accepted
    tokens(srv, "compact", prompts(hf)["repeats"], params)
    assert stats.accepted - before >= N // 2  # where the text repeats, most tokens come from drafts


def test_a_stream_joined_mid_way_goes_on_with_its_own_tokens(served):
    srv, hf = served
    stats = speculating(srv, "compact", 6)
    engine = srv.registry.engine("compact")
    prompt, other = prompts(hf)["repeats"], prompts(hf)["random"]
    params = SamplingParams(max_new_tokens=N, ignore_eos=True)
    alone = [t.id for t in tokens(srv, "compact", prompt, params)]
    rows, joined, steps = [], threading.Event(), stats.steps

    def on_step(n):  # the engine's thread, handing out a step: the first stream alone has at most 15 of its 40
        rows.append(n)
        if len(rows) == 2:  # a second stream arrives while the first runs alone; the step ends once it is queued
            threading.Thread(target=lambda: (tokens(srv, "compact", other, params), joined.set())).start()
            deadline = time.monotonic() + 60
            while not engine.queue and not joined.is_set() and time.monotonic() < deadline:
                time.sleep(0.001)

    stats.on_step = on_step
    try:
        got = [item.id for _, item in srv.ops.generate("compact", [(None, prompt)], params) if hasattr(item, "id")]
        assert joined.wait(60)
    finally:
        stats.on_step = None
    assert got == alone
    assert rows[:2] == [1, 1] and 2 in rows and stats.steps > steps  # the two streams shared steps of the batch


def test_a_stop_string_inside_an_accepted_run_ends_the_stream_as_plain_decoding_does(served):
    srv, hf = served
    prompt, plain = prompts(hf)["repeats"], SamplingParams(max_new_tokens=N, ignore_eos=True)
    stats = speculating(srv, "compact", 6)
    calls = []  # (tokens generated after a speculative step, drafts it took)
    items = srv.ops.generate("compact", [(None, prompt)], plain)
    stream = next(items)[1]
    stats.on_drafts = lambda accepted, rejected: calls.append((stream.generated, accepted))
    try:
        free = [item for _, item in items]
    finally:
        stats.on_drafts = None
    # a taken draft with a token after it from the same call, whose text ends the first occurrence of a stop string
    j = next(g - 2 for g, accepted in calls if accepted >= 2 and free[g - 2].delta)
    text = free[j].text
    stop = next(text[-n:] for n in range(1, len(text) + 1) if text[-n:] not in text[:-1])
    params = SamplingParams(max_new_tokens=N, ignore_eos=True, stop=(stop,))
    got = tokens(srv, "compact", prompt, params)
    speculating(srv, "compact", 0)
    want = tokens(srv, "compact", prompt, params)
    assert len(got) == j + 1 and got[-1].reason == "stop"  # the call's next token was never handed out
    assert [(t.id, t.text, t.reason, t.delta) for t in got] == [(t.id, t.text, t.reason, t.delta) for t in want]
    assert np.allclose([t.logprob for t in got], [t.logprob for t in want], atol=1e-4)


def test_min_new_tokens_inside_accepted_runs_gives_transformers_tokens(served):
    """A token the greedy answer repeats made the model's end of sequence: with min_new_tokens = m it is replaced
    by the next most likely token wherever it would come among the first m, and ends the stream at its first
    place after them, as transformers' generate(min_new_tokens=m) chooses, for every m: the boundary falls on a
    speculative step's first token and among its drafts (some drafts are taken)."""
    srv, hf = served
    prompt = prompts(hf)["repeats"]
    stats = speculating(srv, "compact", 6)
    free = [t.id for t in tokens(srv, "compact", prompt, SamplingParams(max_new_tokens=N, ignore_eos=True))]
    end = max(set(free[1:]), key=free.count)  # a token of the loop: it comes back inside accepted runs
    ids = torch.tensor([prompt])
    meta = srv.ops.model("compact").meta
    kept = meta.tokenizer
    object.__setattr__(meta, "tokenizer", dataclasses.replace(kept, eos_token_id=end, eos_token_ids=None))
    try:
        for least in range(N + 1):
            before = stats.accepted
            got = tokens(srv, "compact", prompt, SamplingParams(max_new_tokens=N, min_new_tokens=least))
            with torch.no_grad():
                want = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=N, min_new_tokens=least,
                                   eos_token_id=end, do_sample=False)[0, len(prompt):].tolist()
            assert [t.id for t in got] == want, least
            assert end not in want[:least] and (len(want) == N or want[-1] == end)
            if least == N:
                assert stats.accepted > before and len(want) == N
    finally:
        object.__setattr__(meta, "tokenizer", kept)
