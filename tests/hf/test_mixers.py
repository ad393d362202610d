"""A mixer layer's maps are its real computation: LFM2's short-convolution layers served by the worker, against
matrices built here from transformers' own intermediate tensors (hooks on Lfm2ShortConv's projections).

Per channel d the convolution layer computes y[t, d] = C[t, d] * sum_k w[d, k] * (B * x)[t - K + 1 + k, d]; the
matrix M_d[t, s] = C[t, d] * w[d, K - 1 - (t - s)] (0 <= t - s < K) is built here by loops over t and s, first
shown to reproduce transformers' y from its B * x (so it is the layer's computation), then held to the served maps,
each head h being the mean of M_d over the h-th group of channels (docs/mixers.md)."""

import shutil

import grpc
import numpy as np
import pytest
import torch
from tokenizers import Tokenizer

from protos.posenc.v1 import posenc_pb2 as pb
from protos.posenc.v1 import posenc_pb2_grpc
from service.artifacts import load_artifact
from service.intervention import Intervention, resolve, run
from tests.serving import start

FAMILY = "lfm2"
TEXT = "def window(x): return x[-7:]  # the short convolution sees three tokens"


@pytest.fixture(scope="module")
def served(hf_zoo, tmp_path_factory):
    models = tmp_path_factory.mktemp("mixers")
    shutil.copytree(hf_zoo[FAMILY]["artifact"], models / FAMILY)
    srv = start(models)
    ch = grpc.insecure_channel(f"127.0.0.1:{srv.port}")
    yield posenc_pb2_grpc.PosencStub(ch)
    ch.close()
    srv.stop(grace=1)


def prompt(ids: list[int]) -> pb.Prompt:
    return pb.Prompt(tokens=pb.TokenIds(ids=ids))


def conv_layers(hf) -> list[int]:
    return [i for i, t in enumerate(hf.config.layer_types) if t == "conv"]


def caught(hf, ids: list[int]) -> dict[int, dict[str, torch.Tensor]]:
    """Per conv layer, transformers' in_proj output (B, C, x) and out_proj input (y), from hooks."""
    seen: dict[int, dict[str, torch.Tensor]] = {}
    hooks = []
    for i in conv_layers(hf):
        conv = hf.model.layers[i].conv
        seen[i] = {}
        hooks += [conv.in_proj.register_forward_hook(lambda _m, _a, out, i=i: seen[i].update(bcx=out[0].clone())),
                  conv.out_proj.register_forward_pre_hook(lambda _m, a, i=i: seen[i].update(y=a[0][0].clone()))]
    try:
        with torch.no_grad():
            hf(input_ids=torch.tensor([ids]))
    finally:
        for h in hooks:
            h.remove()
    return seen


def channel_matrices(c: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """M (D, T, T) by its definition, one entry at a time: M[d, t, s] = C[t, d] * w[d, K - 1 - (t - s)]."""
    T, D = c.shape
    K = weight.shape[-1]
    m = torch.zeros(D, T, T, dtype=torch.float64)
    for t in range(T):
        for s in range(max(0, t - K + 1), t + 1):
            m[:, t, s] = c[t].double() * weight[:, 0, K - 1 - (t - s)].detach().double()
    return m


def test_served_maps_of_the_conv_layers_are_their_exact_matrices(served, hf_zoo):
    hf = hf_zoo[FAMILY]["hf"]
    tok = Tokenizer.from_file(str(hf_zoo[FAMILY]["folder"] / "tokenizer.json"))
    ids = tok.encode(TEXT).ids
    resp = served.Predict(pb.PredictRequest(model=FAMILY, prompt=prompt(ids), attention=pb.ATTENTION_FULL),
                          timeout=60)
    maps = {(m.layer, m.head): np.frombuffer(m.data, "<f4").reshape(m.shape) for m in resp.attention}
    H, D = hf.config.num_attention_heads, hf.config.hidden_size
    seen = caught(hf, ids)
    assert sorted(seen) == [0, 2]
    for i, parts in seen.items():
        b, c, x = parts["bcx"].chunk(3, dim=-1)  # (T, D) each, in_proj's order
        m = channel_matrices(c, hf.model.layers[i].conv.conv.weight)
        y = torch.einsum("dts,sd->td", m, (b * x).double())  # the matrices applied to the layer's value input
        assert torch.allclose(y, parts["y"].double(), atol=1e-5, rtol=0), (y - parts["y"]).abs().max()
        groups = m.unflatten(0, (H, D // H)).mean(1)  # (H, T, T): each head's channels averaged
        for h in range(H):
            assert np.allclose(maps[i, h], groups[h].numpy(), atol=3e-5, rtol=0), (i, h)
            assert np.count_nonzero(np.triu(maps[i, h], 1)) == 0  # causal
            assert np.count_nonzero(np.tril(maps[i, h], -hf.config.conv_L_cache)) == 0  # nothing K or more back


def test_conv_layers_profile_is_the_share_of_each_rows_weight_by_distance(served, hf_zoo):
    """The Profile RPC's columns for a conv layer: the buckets hold |m| / sum |m| by distance, computed here from the
    served maps; nothing past the kernel, and a finite entropy."""
    tok = Tokenizer.from_file(str(hf_zoo[FAMILY]["folder"] / "tokenizer.json"))
    ids = tok.encode(TEXT).ids
    prof = served.Profile(pb.ProfileRequest(model=FAMILY, prompt=prompt(ids)), timeout=60)
    values = np.frombuffer(prof.values, "<f4").reshape(prof.shape)
    resp = served.Predict(pb.PredictRequest(model=FAMILY, prompt=prompt(ids), attention=pb.ATTENTION_FULL),
                          timeout=60)
    cols = list(prof.columns)
    for m in resp.attention:
        if m.layer not in (0, 2):
            continue
        rows = np.abs(np.frombuffer(m.data, "<f4").reshape(m.shape).astype(np.float64))
        share = rows / rows.sum(-1, keepdims=True)
        t = np.arange(len(ids))
        dist = t[:, None] - t[None, :]
        want = {"0": (share * (dist == 0)).sum(-1).mean(), "1": (share * (dist == 1)).sum(-1).mean(),
                "2-3": (share * (dist >= 2) * (dist <= 3)).sum(-1).mean()}
        logs = np.where(share > 0, np.log(np.where(share > 0, share, 1.0)), 0.0)
        want["entropy"] = (-(share * logs).sum(-1)).mean()
        for name, value in want.items():
            assert abs(values[m.layer, m.head, cols.index(name)] - value) < 1e-4, (m.layer, m.head, name)
        assert values[m.layer, m.head, :prof.buckets].sum() == pytest.approx(1.0, abs=1e-5)
        assert values[m.layer, m.head, cols.index("4-7"):prof.buckets].sum() == 0.0


def test_a_conv_heads_ablation_equals_transformers_with_its_channels_zeroed(hf_zoo):
    """head_keep on a conv layer zeroes the head's group of channels before out_proj: transformers with a pre-hook
    zeroing the same channels gives the same logits."""
    hf, model = hf_zoo[FAMILY]["hf"], load_artifact(hf_zoo[FAMILY]["artifact"], threads=1)
    ids = torch.randint(0, 300, (11,), generator=torch.Generator().manual_seed(7)).tolist()
    layer, head = 2, 1
    H, D = hf.config.num_attention_heads, hf.config.hidden_size
    out = run(model, [resolve(model, Intervention(ablate_heads=((layer, head),)), ids, None)], maps=False)

    def zero(_m, args):
        y = args[0].clone()
        y[..., head * D // H:(head + 1) * D // H] = 0
        return (y,)

    hook = hf.model.layers[layer].conv.out_proj.register_forward_pre_hook(zero)
    try:
        with torch.no_grad():
            want = hf(input_ids=torch.tensor([ids])).logits[0]
    finally:
        hook.remove()
    got = torch.from_numpy(out["logits"][0])
    assert (got - want).abs().max() < 1e-4
    with torch.no_grad():  # and the ablation changed something
        assert (hf(input_ids=torch.tensor([ids])).logits[0] - want).abs().max() > 1e-3


def test_switching_a_conv_layers_positions_off_is_refused_naming_the_layer(served):
    with pytest.raises(grpc.RpcError) as err:
        served.Predict(pb.PredictRequest(model=FAMILY, prompt=prompt([5, 6, 7]),
                                         intervention=pb.Intervention(positional_off=[0])), timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "layer 0" in err.value.details() and "short_conv" in err.value.details()


def test_encoding_note_says_where_each_layers_order_comes_from(served):
    note = served.Encoding(pb.EncodingRequest(model=FAMILY, length=8), timeout=30).note
    assert "layers 0, 2: a gated causal convolution over 3 tokens" in note
    assert "layer 1: RoPE base 1e+06" in note
