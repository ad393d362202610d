"""posenc.v1 against a real server on a loopback port, with real onnxruntime sessions on tiny artifacts."""

import math
import threading
import time

import grpc
import numpy as np
import onnxruntime as ort
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from client.api import joined
from model import tokenizer
from model.variants import REGISTRY
from protos.posenc.v1 import posenc_pb2 as pb
from protos.posenc.v1 import posenc_pb2_grpc
from service.settings import Limits
from tests.serving import slow_runs, start

VARIANTS = list(REGISTRY)


def prompt(text=None, ids=None):
    return pb.Prompt(text=text) if text is not None else pb.Prompt(tokens=pb.TokenIds(ids=ids))


def direct_logits(root, variant, ids):
    """The same artifact run straight through onnxruntime, no server."""
    sess = ort.InferenceSession(str(root / variant / "model.onnx"), providers=["CPUExecutionProvider"])
    feeds = {"input_ids": np.array([ids], np.int64), "attention_mask": np.ones((1, len(ids)), np.int64)}
    for i in sess.get_inputs()[2:]:  # KV of length 0; a variant's own state (cpe) starts as zeros of its shape
        feeds[i.name] = np.zeros((1, 4, 0, 8) if i.name.startswith("past_key_values") else (1, *i.shape[1:]),
                                 np.float32)
    return sess.run(["logits", "attentions"], feeds)


def log_softmax(x):
    x = x.astype(np.float64)
    return x - x.max() - np.log(np.exp(x - x.max()).sum())


def test_health_is_serving(channel):
    resp = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""))
    assert resp.status == health_pb2.HealthCheckResponse.SERVING
    resp = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service="posenc.v1.Posenc"))
    assert resp.status == health_pb2.HealthCheckResponse.SERVING


def test_list_models(stub):
    models = {m.name: m for m in stub.ListModels(pb.ListModelsRequest()).models}
    assert sorted(models) == sorted(VARIANTS)
    assert models["learned"].max_positions == 16 and models["rope"].max_positions == 0
    assert models["alibi"].variant == "alibi" and models["alibi"].n_layers == 2 and len(models["alibi"].sha256) == 64
    assert models["fire"].trained_context == 16


@pytest.mark.parametrize("variant", VARIANTS)
def test_predict_matches_direct_onnxruntime(stub, tiny_artifacts, variant):
    root, _ = tiny_artifacts
    text = "dog bites man"
    resp = stub.Predict(pb.PredictRequest(model=variant, prompt=prompt(text), top_k=5))
    assert [t.id for t in resp.tokens] == tokenizer.encode(text)
    assert [t.piece for t in resp.tokens][3] == "␠"
    logits, _ = direct_logits(root, variant, tokenizer.encode(text))
    ref = log_softmax(logits[0, -1])
    order = np.argsort(-ref, kind="stable")[:5]
    assert [c.token.id for c in resp.top] == order.tolist()
    for c in resp.top:
        assert abs(c.logprob - ref[c.token.id]) < 1e-5
        assert abs(c.probability - math.exp(c.logprob)) < 1e-9
    assert resp.timing.total_ms > 0 and resp.timing.batch_size >= 1


def test_predict_attention_modes_and_selection(stub, tiny_artifacts):
    root, _ = tiny_artifacts
    ids = tokenizer.encode("abcdefghij")
    _, att = direct_logits(root, "alibi", ids)
    full = stub.Predict(pb.PredictRequest(model="alibi", prompt=prompt(ids=ids), attention=pb.ATTENTION_FULL))
    assert len(full.attention) == 2 * 4
    for m in full.attention:
        grid = np.frombuffer(m.data, "<f4").reshape(m.shape)
        assert list(m.shape) == [10, 10]
        assert np.allclose(grid, att[0, m.layer, m.head], atol=1e-6)
        assert np.allclose(grid.sum(-1), 1, atol=1e-5) and (np.triu(grid, 1) == 0).all()
    last = stub.Predict(pb.PredictRequest(model="alibi", prompt=prompt(ids=ids), attention=pb.ATTENTION_LAST_ROW,
                                          layers=[1], heads=[0, 3]))
    assert [(m.layer, m.head) for m in last.attention] == [(1, 0), (1, 3)]
    row = np.frombuffer(last.attention[1].data, "<f4").reshape(last.attention[1].shape)
    assert row.shape == (1, 10) and np.allclose(row[0], att[0, 1, 3, -1], atol=1e-6)


@pytest.mark.parametrize("variant", ["rope", "alibi", "learned", "cpe", "xl", "deberta"])
def test_greedy_generate_equals_repeated_predict(stub, variant):
    text, n = "the cat", 6
    streamed = list(stub.Generate(pb.GenerateRequest(model=variant, prompt=prompt(text), max_new_tokens=n)))
    ids = tokenizer.encode(text)
    for msg in streamed:
        top = stub.Predict(pb.PredictRequest(model=variant, prompt=prompt(ids=ids), top_k=1)).top[0]
        assert msg.token.id == top.token.id
        assert abs(msg.logprob - top.logprob) < 1e-4
        ids.append(top.token.id)
    assert len(streamed) == n and streamed[-1].finish_reason == "length"
    assert streamed[-1].text == tokenizer.decode(ids[len(tokenizer.encode(text)):])


def test_sampling_is_reproducible_for_a_seed(stub):
    def run(seed):
        req = pb.GenerateRequest(model="t5", prompt=prompt("x"), max_new_tokens=20, temperature=1.0, top_k=50,
                                 top_p=0.95, seed=seed)
        return [m.token.id for m in stub.Generate(req)]

    assert run(3) == run(3)
    assert run(3) != run(4)


def test_learned_stops_at_the_end_of_its_table(stub):
    msgs = list(stub.Generate(pb.GenerateRequest(model="learned", prompt=prompt(ids=list(range(10))),
                                                 max_new_tokens=50)))
    assert len(msgs) == 6 and msgs[-1].finish_reason == "max_positions"


def greedy(stub, model, text, n, **kw):
    return list(joined(stub.Generate(pb.GenerateRequest(model=model, prompt=prompt(text), max_new_tokens=n, **kw),
                                     timeout=60)))


def test_stop_strings(stub):
    """The stop string comes from what the weights generate (never skipped): the stream ends at the first message
    whose text holds it, with exactly the tokens it had produced by then."""
    free = greedy(stub, "rope", "ab", 16)
    texts = [m.text for m in free]
    stop = texts[3][-2:]  # whatever the 4th token left at the end of the text
    first = next(j for j, t in enumerate(texts) if stop in t)
    assert first <= 3
    msgs = greedy(stub, "rope", "ab", 16, stop=[stop])
    assert [m.token.id for m in msgs] == [m.token.id for m in free[:first + 1]]
    assert msgs[-1].finish_reason == "stop" and msgs[-1].text == texts[first]
    assert all(not m.finish_reason for m in msgs[:-1])


# --- multi-byte UTF-8 over the wire --------------------------------------------------------------------------

MULTIBYTE = "中文 😀 e\u0301 👍🏽 ok"  # CJK (3 bytes), emoji (4), a combining accent (2), a skin-tone modifier


def expected_pieces(text: str) -> list[str]:
    """Written out from the UTF-8 layout, not from the tokenizer: '<E4 1/3 中>' ... for every byte of a character."""
    out = []
    for char in text:
        raw = char.encode("utf-8")
        if len(raw) == 1:
            out.append("␠" if char == " " else char)
        else:
            out += [f"<{b:02X} {k}/{len(raw)} {char}>" for k, b in enumerate(raw, 1)]
    return out


def test_multibyte_prompt_ids_and_pieces(stub):
    resp = stub.Predict(pb.PredictRequest(model="rope", prompt=prompt(MULTIBYTE), top_k=3), timeout=30)
    assert [t.id for t in resp.tokens] == list(MULTIBYTE.encode("utf-8"))
    assert [t.piece for t in resp.tokens] == expected_pieces(MULTIBYTE)
    by_ids = stub.Predict(pb.PredictRequest(model="rope", prompt=prompt(ids=list(MULTIBYTE.encode("utf-8"))),
                                            top_k=3), timeout=30)
    assert [c.token.id for c in by_ids.top] == [c.token.id for c in resp.top]
    score = stub.Score(pb.ScoreRequest(model="rope", prompt=prompt(MULTIBYTE)), timeout=30)
    assert len(score.logprobs) == len(MULTIBYTE.encode("utf-8")) - 1


def test_multibyte_generate_text_and_stop(stub):
    """Sampled streams hold whatever bytes the random weights pick; every message's text is the UTF-8 decode of the
    tokens so far less what may still change (U+FFFD of bytes that may yet end a character), the last message's
    the whole decode, and a multi-byte character works as a stop string."""
    found = None
    for seed in range(8):
        msgs = greedy(stub, "rope", MULTIBYTE, 64, temperature=3.0, seed=seed)
        ids = [m.token.id for m in msgs]
        for k, m in enumerate(msgs):
            want = bytes(ids[:k + 1]).decode("utf-8", errors="replace")
            assert want.startswith(m.text) and set(want[len(m.text):]) <= {"\ufffd"}, (seed, k)
            assert m.token.piece  # every byte has a display form, multi-byte or not
        assert msgs[-1].text == bytes(ids).decode("utf-8", errors="replace")
        wide = [c for c in msgs[-1].text if len(c.encode("utf-8")) > 1 and c != "\ufffd"]
        if wide and found is None:
            found = (seed, wide[0], msgs)
    assert found, "no sampled stream held a complete multi-byte character"
    seed, char, msgs = found
    end = next(k for k, m in enumerate(msgs) if char in m.text)
    stopped = greedy(stub, "rope", MULTIBYTE, 64, temperature=3.0, seed=seed, stop=[char])
    assert [m.token.id for m in stopped] == [m.token.id for m in msgs[:end + 1]]
    assert stopped[-1].finish_reason == "stop" and stopped[-1].text.endswith(char)
    assert len(char.encode("utf-8")) > 1 and len(stopped) >= len(char.encode("utf-8"))


def test_score_is_the_sum_of_next_token_logprobs(stub, tiny_artifacts):
    root, _ = tiny_artifacts
    ids = tokenizer.encode("a b c d e f g")
    resp = stub.Score(pb.ScoreRequest(model="fire", prompt=prompt(ids=ids)))
    logits, _ = direct_logits(root, "fire", ids)
    want = [log_softmax(logits[0, t])[ids[t + 1]] for t in range(len(ids) - 1)]
    assert np.allclose(resp.logprobs, want, atol=1e-5)
    assert abs(resp.total_logprob - sum(want)) < 1e-4
    assert abs(resp.perplexity - math.exp(-sum(want) / len(want))) < 1e-3


def test_score_beyond_trained_context(stub):
    resp = stub.Score(pb.ScoreRequest(model="alibi", prompt=prompt("z" * 64)))  # 4x the tiny context
    assert len(resp.logprobs) == 63 and all(np.isfinite(resp.logprobs))


def test_concurrent_requests_are_batched_and_equal_alone(server, stub):
    prompts = [("rope", "a" * n + "bc") for n in range(1, 13)]
    alone = {p: stub.Predict(pb.PredictRequest(model=p[0], prompt=prompt(p[1]), top_k=3)) for p in prompts}
    results, sizes = {}, []
    barrier = threading.Barrier(len(prompts))
    engine = server.registry.engine("rope")
    previous = slow_runs(engine, 0.1)  # the later arrivals queue behind the first

    def call(p):
        barrier.wait()
        r = stub.Predict(pb.PredictRequest(model=p[0], prompt=prompt(p[1]), top_k=3))
        results[p] = r
        sizes.append(r.timing.batch_size)

    threads = [threading.Thread(target=call, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    engine.use(previous)
    assert max(sizes) > 1, "concurrent requests were never batched"
    for p in prompts:
        a, b = alone[p], results[p]
        assert [c.token.id for c in a.top] == [c.token.id for c in b.top]
        assert np.allclose([c.logprob for c in a.top], [c.logprob for c in b.top], atol=1e-5)


def test_reflection_lists_the_services(channel):
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    resp = next(stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
    names = {s.name for s in resp.list_services_response.service}
    assert {"posenc.v1.Posenc", "grpc.health.v1.Health"} <= names


def test_cancelled_stream_stops_within_a_step(stub, server):
    engine = server.registry.engine("rope")
    previous = slow_runs(engine, 0.05)  # 64 steps take over 3 s: the stream cannot have finished when it is cancelled
    try:
        call = stub.Generate(pb.GenerateRequest(model="rope", prompt=prompt("a"), max_new_tokens=64), timeout=60)
        next(call)
        for _ in range(200):  # the stream has joined the decode loop
            if engine.active == 1:
                break
            time.sleep(0.01)
        assert engine.active == 1 and server.registry.streams == 1  # running, its slot held
        at_cancel = engine.stats.steps
        call.cancel()
        with pytest.raises(grpc.RpcError) as err:
            list(call)
        assert err.value.code() == grpc.StatusCode.CANCELLED
        for _ in range(200):  # the worker notices: the loop drops the stream, the slot is freed
            if engine.active == 0 and server.registry.streams == 0:
                break
            time.sleep(0.01)
        assert engine.active == 0 and server.registry.streams == 0
        assert engine.stats.steps - at_cancel <= 2  # at most the step in flight, never the remaining ~60
    finally:
        engine.use(previous)


def test_generate_stream_bytes_grow_linearly(tiny_artifacts):
    """Each message carries only its token's delta (the last one the whole text too), so a 1,024-token stream's
    bytes grow with its length, not its square; the joined deltas are the text."""
    srv = start(tiny_artifacts[0], limits=Limits(max_new_tokens=1024))
    try:
        with grpc.insecure_channel(f"127.0.0.1:{srv.port}") as ch:
            stub = posenc_pb2_grpc.PosencStub(ch)

            def wire(n):
                msgs = list(stub.Generate(pb.GenerateRequest(model="rope", prompt=prompt("ab"), max_new_tokens=n,
                                                             temperature=1.0, seed=5), timeout=120))
                assert len(msgs) == n and "".join(m.delta for m in msgs) == msgs[-1].text
                assert all(m.text == "" for m in msgs[:-1])
                return sum(m.ByteSize() for m in msgs), msgs

            short, _ = wire(256)
            long, msgs = wire(1024)
    finally:
        srv.stop(grace=1)
    assert long < 4.5 * short  # with its text so far in every message the stream would be ~16x (quadratic)
    assert max(m.ByteSize() for m in msgs[:-1]) < 64
