"""What a request makes the worker hold, through a real worker on loopback: attention maps are refused by what the
call computes (every layer and head), not by the subset asked for; a long prompt's Score holds no T x V float64
log-probabilities.  Values are checked against onnxruntime run directly and torch's float64 log-softmax."""

import http.client
import json
import tracemalloc

import grpc
import numpy as np
import onnxruntime as ort
import pytest
import torch

from protos.posenc.v1 import posenc_pb2 as pb
from protos.posenc.v1 import posenc_pb2_grpc
from service.registry import Limits
from tests.serving import start

MESSAGE = 1 << 20  # the server's --max-message-bytes: maps may take 0.9 MiB
LAYERS, HEADS = 2, 4  # the tiny artifacts' sizes


@pytest.fixture(scope="module")
def server(tiny_artifacts):
    root, _ = tiny_artifacts
    srv = start(root, http_port=0, limits=Limits(max_prompt_tokens=4096, max_message_bytes=MESSAGE))
    yield srv
    srv.stop(grace=1)


@pytest.fixture(scope="module")
def stub(server):
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    grpc.channel_ready_future(channel).result(timeout=10)
    yield posenc_pb2_grpc.PosencStub(channel)
    channel.close()


def direct(root, variant, ids, outputs):
    """The artifact run straight through onnxruntime, no server, the whole prompt in one call."""
    sess = ort.InferenceSession(str(root / variant / "model.onnx"), providers=["CPUExecutionProvider"])
    feeds = {"input_ids": np.array([ids], np.int64), "attention_mask": np.ones((1, len(ids)), np.int64)}
    for i in sess.get_inputs()[2:]:
        feeds[i.name] = np.zeros((1, 4, 0, 8), np.float32)
    return sess.run(outputs, feeds)


def ids_of(n, seed=0):
    return np.random.default_rng(seed).integers(0, 256, n).tolist()


def predict(ids, attention, layers=(0,), heads=(0,)):
    return pb.PredictRequest(model="alibi", prompt=pb.Prompt(tokens=pb.TokenIds(ids=ids)), attention=attention,
                             layers=list(layers), heads=list(heads))


def post(server, path, body):
    conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=60)
    try:
        conn.request("POST", path, body=json.dumps(body).encode(), headers={"content-type": "application/json"})
        r = conn.getresponse()
        return r.status, json.loads(r.read())
    finally:
        conn.close()


def computed(rows, keys):
    """Bytes of the maps one call computes for one prompt: every layer and head, float32."""
    return 4 * LAYERS * HEADS * rows * keys


@pytest.fixture
def map_calls(server):
    """The attention maps every onnxruntime call of alibi's exact graph computes, as onnxruntime returns them."""
    model = server.registry.models["alibi"]
    seen, run = [], model.session.run

    def recording(names, feeds, *args, **kwargs):
        out = run(names, feeds, *args, **kwargs)
        seen.extend(o.shape for n, o in zip(names, out, strict=True) if n == "attentions")
        return out

    model.session.run = recording
    yield seen
    model.session.run = run


def test_maps_are_refused_by_what_the_call_computes(stub, server, map_calls):
    """layers=[0], heads=[0] of a 200-token prompt is 160 KB of answer, but the call would compute 1.28 MB of maps:
    refused before anything runs, suggesting the last row or a prompt short enough."""
    n = 200
    assert 4 * n * n < 0.9 * MESSAGE < computed(n, n)
    with pytest.raises(grpc.RpcError) as err:
        stub.Predict(predict(ids_of(n), pb.ATTENTION_FULL))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "every layer and head" in err.value.details() and "LAST_ROW" in err.value.details()
    status, body = post(server, "/v1/posenc/predict",
                        {"model": "alibi", "prompt": {"tokens": {"ids": ids_of(n)}}, "attention": "ATTENTION_FULL",
                         "layers": [0], "heads": [0]})
    assert status == 413 and "at most" in body["error"], body
    assert map_calls == []


def test_the_suggested_length_fits(stub, tiny_artifacts, map_calls):
    root, _ = tiny_artifacts
    with pytest.raises(grpc.RpcError) as err:
        stub.Predict(predict(ids_of(200), pb.ATTENTION_FULL))
    fits = int(err.value.details().split("at most ")[1].split()[0])
    assert computed(fits, fits) <= 0.9 * MESSAGE < computed(fits + 1, fits + 1)
    ids = ids_of(fits, seed=1)
    resp = stub.Predict(predict(ids, pb.ATTENTION_FULL, layers=(1,), heads=(2, 3)))
    (att,) = direct(root, "alibi", ids, ["attentions"])
    assert [(m.layer, m.head) for m in resp.attention] == [(1, 2), (1, 3)]
    for m in resp.attention:
        grid = np.frombuffer(m.data, "<f4").reshape(m.shape)
        assert grid.shape == (fits, fits) and np.allclose(grid, att[0, m.layer, m.head], atol=1e-5)
    assert [np.prod(s) * 4 for s in map_calls] == [computed(fits, fits)]


def test_the_last_row_computes_one_query_row(stub, tiny_artifacts, map_calls):
    """A 1,000-token prompt's last row: the call computes one query row of every layer and head (32 KB), not the
    last piece's rows (232 of them here, 7.4 MB, past the limit), and equals the whole prompt's last row run
    directly."""
    root, _ = tiny_artifacts
    ids = ids_of(1000, seed=3)
    resp = stub.Predict(predict(ids, pb.ATTENTION_LAST_ROW, layers=(0, 1), heads=(1,)))
    assert map_calls == [(1, LAYERS, HEADS, 1, 1000)]
    logits, att = direct(root, "alibi", ids, ["logits", "attentions"])
    for m in resp.attention:
        row = np.frombuffer(m.data, "<f4").reshape(m.shape)
        assert row.shape == (1, 1000) and np.allclose(row[0], att[0, m.layer, m.head, -1], atol=1e-5)
    assert resp.top[0].token.id == int(np.argmax(logits[0, -1]))


def test_long_score_equals_a_float64_log_softmax_without_holding_its_logits(stub, tiny_artifacts):
    """A 4,000-token Score: each token's log-probability equals torch's float64 log-softmax of onnxruntime's logits,
    and the worker's traced peak stays below the prompt's own float32 logits: the engine reduces each piece's
    rows to their log-probabilities as they come (Job.reduce), so the 4,000 x V logits are never held at once (a
    float64 log-softmax of them alone is 2x, with its temporaries 8x; holding them all, as one call gives them, 1x
    and more)."""
    root, _ = tiny_artifacts
    ids = ids_of(4000, seed=2)
    request = pb.ScoreRequest(model="rope", prompt=pb.Prompt(tokens=pb.TokenIds(ids=ids)))
    # warm: the sessions' first-run allocations are not the request's (another prompt, so the measured one runs
    # whole rather than on the prefix cache's copy of the warm one's keys and values)
    stub.Score(pb.ScoreRequest(model="rope", prompt=pb.Prompt(tokens=pb.TokenIds(ids=ids_of(4000, seed=5)))))
    tracemalloc.start()
    try:
        resp = stub.Score(request)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    (logits,) = direct(root, "rope", ids, ["logits"])
    want = torch.log_softmax(torch.from_numpy(logits[0, :-1]).double(), dim=-1).numpy()[np.arange(3999), ids[1:]]
    assert np.abs(np.array(resp.logprobs) - want).max() <= 1e-5
    assert peak / logits.nbytes < 1  # each piece reduced as it comes: never the whole prompt's logits (0.63)
