"""Attention profiles (posenc.v1 Profile) of imported models, served by a real worker, against the profile computed
here from transformers' own eager attention weights and from the same posenc model's full maps (Predict): the mass
by distance in log-2 buckets, on the first position, the rows' entropy and, for gpt-oss, the learned sinks' mass;
every query row and the last N.  And a 2,048-token prompt's answer: its size grows with the length, not its square.
"""

from __future__ import annotations

import base64
import json
import shutil

import grpc
import numpy as np
import pytest
import torch

from protos.posenc.v1 import posenc_pb2 as pb
from protos.posenc.v1 import posenc_pb2_grpc
from tests.http.conftest import Http
from tests.serving import start

FAMILIES = ["gpt2", "llama", "gpt_oss"]  # learned positions; RoPE with grouped heads; sinks and a sliding window
LONG, LONG_NAME = 2048, "llama2k"
pytestmark = pytest.mark.xdist_group("long-llama")  # one worker imports the 2,048-position LLaMA once


def profile_of(maps: list[np.ndarray], rows: slice, sinks: bool) -> tuple[np.ndarray, int]:
    """The profile by its definition, from one prompt's (heads, queries, keys) maps, one per layer: for each layer and
    head, averaged over the query rows `rows`, the mass at distance d = 0, then at each b = 1, 2, ... with
    2^(b-1) <= d < 2^b (d's bit length is b), as far as the prompt reaches; the mass on key 0; the row's entropy in
    nats; and, with sinks, what the row's keys did not take.  ((layers, heads, columns) float64, the bucket count)."""
    T = maps[0].shape[-1]
    bucket = np.array([int(d).bit_length() for d in range(T)])  # d = 0 has bit length 0: bucket 0
    buckets = int(bucket.max()) + 1
    values = np.zeros((len(maps), maps[0].shape[0], buckets + 2 + sinks))
    queries = np.arange(T)[rows]
    for i, layer in enumerate(maps):
        for h, head in enumerate(layer.astype(np.float64)):
            for t in queries:
                row = head[t, :t + 1]  # keys 0 .. t
                values[i, h, :buckets] += np.bincount(bucket[t - np.arange(t + 1)], weights=row, minlength=buckets)
                values[i, h, buckets] += row[0]
                values[i, h, buckets + 1] -= sum(float(p) * np.log(p) for p in row if p > 0)
                if sinks:
                    values[i, h, buckets + 2] += 1.0 - row.sum()
    return values / len(queries), buckets


@pytest.fixture(scope="module")
def served(hf_families, hf_zoo, long_llama, tmp_path_factory):
    """Each family's tiny random transformers model as the session's fixtures imported it, and the session's LLaMA
    taking 2,048 positions (tests/conftest.py), served by a worker: (stub, {family: transformers model})."""
    root = tmp_path_factory.mktemp("profile")
    models = {}
    hf_families.prefetch([family for family in FAMILIES if family in hf_families.families])
    hf_zoo.prefetch([family for family in FAMILIES if family not in hf_families.families])
    for family in FAMILIES:
        entry = (hf_families if family in hf_families.families else hf_zoo)[family]
        models[family] = entry["hf"]
        shutil.copytree(entry["artifact"], root / "models" / family)
    shutil.copytree(long_llama[0], root / "models" / LONG_NAME)
    models[LONG_NAME] = long_llama[1]
    srv = start(root / "models", http_port=0)
    with grpc.insecure_channel(f"127.0.0.1:{srv.port}",
                               options=[("grpc.max_receive_message_length", 64 << 20)]) as channel:
        yield posenc_pb2_grpc.PosencStub(channel), models, Http(srv.http_port)
    srv.stop(grace=1)


def values(resp: pb.ProfileResponse) -> np.ndarray:
    return np.frombuffer(resp.values, "<f4").reshape(resp.shape)


def ask(stub, model: str, ids: list[int], last: int = 0) -> pb.ProfileResponse:
    return stub.Profile(pb.ProfileRequest(model=model, prompt=pb.Prompt(tokens=pb.TokenIds(ids=ids)), last=last),
                        timeout=120)


def eager_maps(hf, ids: list[int]) -> list[np.ndarray]:
    with torch.no_grad():
        return [a[0].numpy() for a in hf(torch.tensor([ids]), output_attentions=True).attentions]


@pytest.mark.parametrize("family", FAMILIES)
def test_profile_equals_transformers_and_the_full_maps(served, family):
    """Every query row, and the last 17: the served profile equals the one computed from transformers' eager
    attention weights and from the worker's own full maps (Predict), within 1e-5."""
    stub, models, _ = served
    ids = [int(i) for i in np.random.default_rng(1).integers(1, 300, 90)]
    sinks = family == "gpt_oss"
    theirs = eager_maps(models[family], ids)
    full = stub.Predict(pb.PredictRequest(model=family, prompt=pb.Prompt(tokens=pb.TokenIds(ids=ids)),
                                          attention=pb.ATTENTION_FULL), timeout=60)
    ours = [np.stack([np.frombuffer(m.data, "<f4").reshape(m.shape) for m in full.attention if m.layer == i])
            for i in range(len(theirs))]
    for last, rows in ((0, slice(0, None)), (17, slice(-17, None))):
        resp = ask(stub, family, ids, last)
        want, buckets = profile_of(theirs, rows, sinks)
        assert list(resp.columns) == ["0", "1", "2-3", "4-7", "8-15", "16-31", "32-63", "64-127", "first",
                                      "entropy"] + (["learned_sink"] if sinks else [])
        assert (resp.buckets, resp.query_start, resp.query_count) == (buckets, 90 - (last or 90), last or 90)
        np.testing.assert_allclose(values(resp), want, rtol=0, atol=1e-5)
        np.testing.assert_allclose(values(resp), profile_of(ours, rows, sinks)[0], rtol=0, atol=1e-5)
    if sinks:  # the sinks take a real share, which the distance buckets then lack
        assert values(resp)[..., -1].max() > 0.05
        np.testing.assert_allclose(values(resp)[..., :buckets].sum(-1) + values(resp)[..., -1], 1, atol=1e-5)


def test_a_2048_token_profile_is_small_and_exact(served):
    """A 2,048-token prompt: the answer holds layers x heads x columns floats (12 distance buckets up to 2,047, first,
    entropy) and its tokens, a few dozen kilobytes where the maps would be 2,048^2 floats per layer and head; its
    values equal transformers' over the last 300 rows."""
    stub, models, _ = served
    ids = [int(i) for i in np.random.default_rng(2).integers(1, 300, LONG)]
    resp = ask(stub, LONG_NAME, ids, last=300)
    assert list(resp.shape) == [2, 4, 14] and len(resp.values) == 4 * 2 * 4 * 14
    assert list(resp.columns[:12]) == ["0", "1", "2-3", "4-7", "8-15", "16-31", "32-63", "64-127", "128-255",
                                       "256-511", "512-1023", "1024-2047"]
    assert resp.ByteSize() < 16 * LONG + 4096  # linear in the tokens it lists; one map of one head is 16 MB
    want, _ = profile_of(eager_maps(models[LONG_NAME], ids), slice(-300, None), False)
    np.testing.assert_allclose(values(resp), want, rtol=0, atol=1e-5)


@pytest.mark.parametrize("last", [-1, 91])
def test_a_bad_row_count_is_refused(served, last):
    stub, _, _ = served
    with pytest.raises(grpc.RpcError) as err:
        ask(stub, "gpt2", list(range(1, 91)), last)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"last must be in [0, 90] for a 90-token prompt (0 = every query row), got {last}" in err.value.details()


def test_the_json_route_answers_as_grpc(served):
    """POST /v1/posenc/profile: the same columns and values (base64 float32, as over gRPC); a bad count is 400."""
    stub, _, http = served
    ids = list(range(1, 41))
    status, doc = http.json("POST", "/v1/posenc/profile", {"model": "llama", "prompt": {"tokens": {"ids": ids}},
                                                             "last": 8})
    want = ask(stub, "llama", ids, 8)
    assert status == 200 and doc["columns"] == list(want.columns) and doc["shape"] == list(want.shape)
    assert base64.b64decode(doc["values"]) == want.values
    status, doc = http.json("POST", "/v1/posenc/profile", {"model": "llama", "prompt": {"tokens": {"ids": ids}},
                                                             "last": 41})
    assert status == 400 and "last must be in [0, 40]" in json.dumps(doc)
