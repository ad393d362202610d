"""A mixer layer's maps are its real computation: LFM2's short-convolution layers and Granite 4.0-H's Mamba-2 layers
served by the worker, against matrices built here from transformers' own intermediate tensors (hooks).

- Short convolution: per channel d the layer computes y[t, d] = C[t, d] * sum_k w[d, k] * (B * x)[t - K + 1 + k, d];
  M_d[t, s] = C[t, d] * w[d, K - 1 - (t - s)] (0 <= t - s < K).
- Mamba-2: per head, y_i = sum_j M[i, j] x_j with M[i, j] = (C_i . B_j) exp(A (dt_{j+1} + ... + dt_i)) dt_j, plus
  D on the diagonal (Dao and Gu 2024, the SSD form), from the layer's in_proj output put through its convolution.

Each matrix is built here by loops over query and key, first shown to reproduce transformers' own output from its
value input (so it is the layer's computation), then held to what the worker serves: Predict's mixer_maps, every
channel's or head's own matrix (which, applied to that value input, reproduce the output themselves), and the
maps, each head being the mean of the matrices over its group of channels or heads (docs/mixers.md)."""

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
from service.settings import Limits
from tests.serving import start

FAMILY, MAMBA, BESIDE, DELTA = "lfm2", "granitemoehybrid", "falcon_h1", "qwen3_next"
TEXT = "def window(x): return x[-7:]  # the short convolution sees three tokens"


@pytest.fixture(scope="module")
def served(hf_zoo, tmp_path_factory):
    models = tmp_path_factory.mktemp("mixers")
    for family in (FAMILY, MAMBA, BESIDE, DELTA):
        shutil.copytree(hf_zoo[family]["artifact"], models / family)
    srv = start(models, limits=Limits(long_context=True))  # prompts past the tiny models' 256 positions
    ch = grpc.insecure_channel(f"127.0.0.1:{srv.port}", options=[("grpc.max_receive_message_length", 64 << 20)])
    yield posenc_pb2_grpc.PosencStub(ch)
    ch.close()
    srv.stop(grace=1)


def prompt(ids: list[int]) -> pb.Prompt:
    return pb.Prompt(tokens=pb.TokenIds(ids=ids))


def served_maps(stub, family: str, ids: list[int]) -> tuple[dict, dict]:
    """(maps, mixer matrices), each {(layer, head): array}, from one Predict asking for both."""
    resp = stub.Predict(pb.PredictRequest(model=family, prompt=prompt(ids), attention=pb.ATTENTION_FULL,
                                          mixer_maps=True), timeout=60)
    return tuple({(m.layer, m.head): np.frombuffer(m.data, "<f4").reshape(m.shape) for m in part}
                 for part in (resp.attention, resp.mixer_maps))


def served_stack(exact: dict, layer: int) -> torch.Tensor:
    """A layer's served matrices (heads, T, T), float64, by head."""
    heads = sorted(h for i, h in exact if i == layer)
    assert heads == list(range(len(heads)))
    return torch.from_numpy(np.stack([exact[layer, h] for h in heads])).double()


def conv_layers(hf) -> list[int]:
    return [i for i, t in enumerate(hf.config.layer_types) if t == "conv"]


def caught(hf, ids: list[int], layers: list[int], mixer: str, output: str) -> dict[int, dict[str, torch.Tensor]]:
    """Per layer, transformers' mixer's in_proj output ("p") and the input of its module `output` ("y"), from hooks
    during one forward of ids."""
    seen: dict[int, dict[str, torch.Tensor]] = {i: {} for i in layers}
    hooks = []
    for i in layers:
        part = getattr(hf.model.layers[i], mixer)
        hooks += [part.in_proj.register_forward_hook(lambda _m, _a, out, i=i: seen[i].update(p=out[0].clone())),
                  getattr(part, output).register_forward_pre_hook(lambda _m, a, i=i: seen[i].update(y=a[0][0].clone()))]
    hooked_forward(hf, ids, hooks)
    return seen


def hooked_forward(hf, ids: list[int], hooks: list) -> None:
    """One forward of ids through transformers' model with the registered `hooks` in place, removed after."""
    try:
        with torch.no_grad():
            hf(input_ids=torch.tensor([ids]))
    finally:
        for h in hooks:
            h.remove()


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
    maps, exact = served_maps(served, FAMILY, ids)
    H, D = hf.config.num_attention_heads, hf.config.hidden_size
    assert conv_layers(hf) == [0, 2] and {i for i, _ in exact} == {0, 2}
    seen = caught(hf, ids, [0, 2], "conv", "out_proj")
    for i, parts in seen.items():
        b, c, x = parts["p"].chunk(3, dim=-1)  # (T, D) each, in_proj's order
        m = channel_matrices(c, hf.model.layers[i].conv.conv.weight)
        y = torch.einsum("dts,sd->td", m, (b * x).double())  # the matrices applied to the layer's value input
        assert torch.allclose(y, parts["y"].double(), atol=1e-5, rtol=0), (y - parts["y"]).abs().max()
        ours = served_stack(exact, i)  # (D, T, T): one matrix per channel
        assert ours.shape == m.shape and torch.allclose(ours, m, atol=3e-5, rtol=0), (ours - m).abs().max()
        y = torch.einsum("dts,sd->td", ours, (b * x).double())  # the served matrices give the output themselves
        assert torch.allclose(y, parts["y"].double(), atol=1e-4, rtol=0), (y - parts["y"]).abs().max()
        groups = m.unflatten(0, (H, D // H)).mean(1)  # (H, T, T): each head's channels averaged
        for h in range(H):
            assert np.allclose(maps[i, h], groups[h].numpy(), atol=3e-5, rtol=0), (i, h)
            assert np.count_nonzero(np.triu(maps[i, h], 1)) == 0  # causal
            assert np.count_nonzero(np.tril(maps[i, h], -hf.config.conv_L_cache)) == 0  # nothing K or more back


def mamba_matrices(hf, layer: int, projected: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(M (heads, T, T), x (T, heads, P)) of Mamba-2 layer `layer` from its in_proj output, by the definitions: the
    causal convolution (conv1d padded by K - 1, cut to T) and SiLU, softplus time steps, then M entry by entry."""
    mamba = hf.model.layers[layer].mamba
    H, P, N, G = mamba.num_heads, mamba.head_dim, mamba.ssm_state_size, mamba.n_groups
    T = projected.shape[0]
    _, xbc, dt = projected.double().split([H * P, mamba.conv_dim, H], dim=-1)
    conv = torch.nn.functional.conv1d(xbc.T[None], mamba.conv1d.weight.double(), mamba.conv1d.bias.double(),
                                      padding=mamba.conv_kernel_size - 1, groups=mamba.conv_dim)[0, :, :T].T
    x, b, c = torch.nn.functional.silu(conv).split([H * P, G * N, G * N], dim=-1)
    dt = torch.nn.functional.softplus(dt + mamba.dt_bias.double())  # (T, H)
    a = -torch.exp(mamba.A_log.double())
    m = torch.zeros(H, T, T, dtype=torch.float64)
    for h in range(H):
        g = h // (H // G)  # the group whose B and C the head reads
        for i in range(T):
            for j in range(i + 1):
                bj, ci = b[j, g * N:(g + 1) * N], c[i, g * N:(g + 1) * N]
                m[h, i, j] = (ci @ bj) * torch.exp(a[h] * dt[j + 1:i + 1, h].sum()) * dt[j, h]
            m[h, i, i] += mamba.D[h].double()
    return m.detach(), x.unflatten(-1, (H, P)).detach()


def test_served_maps_of_the_mamba2_layers_are_their_exact_ssd_matrices(served, hf_zoo):
    hf = hf_zoo[MAMBA]["hf"]
    ids = torch.randint(0, 300, (13,), generator=torch.Generator().manual_seed(3)).tolist()
    maps, exact = served_maps(served, MAMBA, ids)
    seen = caught(hf, ids, [0, 2], "mamba", "norm")
    heads = hf.config.num_attention_heads
    assert {i for i, _ in exact} == {0, 2} and hf.config.mamba_n_heads > heads  # more than the maps show
    for i, parts in seen.items():
        m, x = mamba_matrices(hf, i, parts["p"])
        y = torch.einsum("hij,jhp->ihp", m, x).flatten(1)  # the matrices applied to the layer's values
        assert torch.allclose(y, parts["y"].double(), atol=1e-5, rtol=0), (y - parts["y"]).abs().max()
        ours = served_stack(exact, i)  # (ssm heads, T, T)
        assert ours.shape == m.shape and torch.allclose(ours, m, atol=3e-5, rtol=0), (ours - m).abs().max()
        y = torch.einsum("hij,jhp->ihp", ours, x).flatten(1)
        assert torch.allclose(y, parts["y"].double(), atol=1e-4, rtol=0), (y - parts["y"]).abs().max()
        grouped = m.unflatten(0, (heads, -1)).mean(1)  # the model's map heads: groups of the layer's heads
        for h in range(heads):
            assert np.allclose(maps[i, h], grouped[h].numpy(), atol=3e-5, rtol=0), (i, h)


def delta_matrices(hf, layer: int, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(W (value heads, T, T), v (T, heads, dv), the input of the layer's output norm (T, heads, dv)) of Gated
    DeltaNet layer `layer`, from its two input projections' outputs (hooks): the causal convolution and SiLU by
    conv1d, q and k L2-normalized, q / sqrt(dk), beta = sigmoid(b), alpha = exp(-exp(A_log) softplus(a + dt_bias)),
    then the gated delta rule run token by token (the paper's recurrence) on value vectors e_j, one per key: the
    output's row i at key j is W[i, j], the rule being linear in its values."""
    mod, cfg, seen = hf.model.layers[layer].linear_attn, hf.config, {}
    hooks = [mod.in_proj_qkvz.register_forward_hook(lambda _m, _a, out: seen.update(qkvz=out.clone())),
             mod.in_proj_ba.register_forward_hook(lambda _m, _a, out: seen.update(ba=out.clone())),
             mod.norm.register_forward_pre_hook(lambda _m, a: seen.update(y=a[0].clone()))]
    hooked_forward(hf, ids, hooks)
    H, G, dk, dv, T = cfg.linear_num_value_heads, cfg.linear_num_key_heads, cfg.linear_key_head_dim, \
        cfg.linear_value_head_dim, len(ids)
    with torch.no_grad():
        q, k, v, _, b, a = (t.double() for t in mod.fix_query_key_value_ordering(seen["qkvz"], seen["ba"]))
        qkv = torch.cat([t.reshape(1, T, -1) for t in (q, k, v)], -1)[0]
        conv = torch.nn.functional.conv1d(qkv.T[None], mod.conv1d.weight.double(), groups=qkv.shape[-1],
                                          padding=cfg.linear_conv_kernel_dim - 1)[0, :, :T].T
        q, k, v = torch.nn.functional.silu(conv).split([G * dk, G * dk, H * dv], dim=-1)
        q, k = (t.unflatten(-1, (G, dk)).repeat_interleave(H // G, dim=1) for t in (q, k))  # (T, H, dk)
        q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6) / dk ** 0.5
        k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
        beta = torch.sigmoid(b[0])  # (T, H)
        alpha = torch.exp(-torch.exp(mod.A_log.double()) * torch.nn.functional.softplus(a[0] + mod.dt_bias.double()))
        w = torch.zeros(H, T, T, dtype=torch.float64)
        state = torch.zeros(H, dk, T, dtype=torch.float64)  # column j: the state of value vector e_j
        for t in range(T):
            state = alpha[t, :, None, None] * state
            write = beta[t, :, None] * (torch.eye(T, dtype=torch.float64)[t] - torch.einsum("hkj,hk->hj", state, k[t]))
            state = state + k[t][..., None] * write[:, None, :]
            w[:, t] = torch.einsum("hkj,hk->hj", state, q[t])
    return w, v.unflatten(-1, (H, dv)), seen["y"].reshape(T, H, dv).double()


def test_served_maps_of_the_gated_deltanet_layers_are_their_exact_matrices(served, hf_zoo):
    """Qwen3-Next's linear-attention layers: W from the recurrence applied to the layer's values reproduces
    transformers' output before its norm and gate (its chunked form), and the served maps are W's head groups."""
    hf = hf_zoo[DELTA]["hf"]
    ids = torch.randint(0, 300, (15,), generator=torch.Generator().manual_seed(3)).tolist()
    maps, exact = served_maps(served, DELTA, ids)
    heads = hf.config.num_attention_heads
    assert {i for i, _ in exact} == {0, 2}
    for i in (0, 2):
        w, v, y = delta_matrices(hf, i, ids)
        got = torch.einsum("hij,jhp->ihp", w, v)
        assert torch.allclose(got, y, atol=1e-5, rtol=0), (got - y).abs().max()
        assert torch.count_nonzero(torch.triu(w, 1)) == 0 and (w.sum(-1) - 1).abs().max() > 0.1  # causal, unnormalised
        ours = served_stack(exact, i)  # (value heads, T, T)
        assert ours.shape == w.shape and torch.allclose(ours, w, atol=3e-5, rtol=0), (ours - w).abs().max()
        got = torch.einsum("hij,jhp->ihp", ours, v)
        assert torch.allclose(got, y, atol=1e-4, rtol=0), (got - y).abs().max()
        grouped = w.unflatten(0, (heads, -1)).mean(1)
        for h in range(heads):
            assert np.allclose(maps[i, h], grouped[h].numpy(), atol=3e-5, rtol=0), (i, h)


def test_served_mixer_maps_of_falcon_h1s_mamba2_beside_its_attention_are_its_exact_ssd_matrices(served, hf_zoo):
    """Falcon-H1: every layer's Mamba-2 mixer runs beside its attention, so the maps are the attention's; the
    mixer's own matrices come in mixer_maps, built here from transformers' in_proj output times its mup vector,
    and applied to the values and gated by silu(z) they give transformers' input to out_proj."""
    hf = hf_zoo[BESIDE]["hf"]
    ids = torch.randint(0, 300, (11,), generator=torch.Generator().manual_seed(5)).tolist()
    maps, exact = served_maps(served, BESIDE, ids)
    layers = list(range(hf.config.num_hidden_layers))
    assert {i for i, _ in exact} == set(layers) and not hf.config.mamba_rms_norm  # the gate alone follows
    for i in layers:  # the maps stay attention probabilities
        assert np.allclose(maps[i, 0].sum(-1), 1.0, atol=1e-5)
    seen = caught(hf, ids, layers, "mamba", "out_proj")
    for i, parts in seen.items():
        mamba = hf.model.layers[i].mamba
        projected = parts["p"] * mamba.mup_vector[0, 0]
        m, x = mamba_matrices(hf, i, projected)
        z = projected[:, :mamba.num_heads * mamba.head_dim].double()
        ours = served_stack(exact, i)
        assert ours.shape == m.shape and torch.allclose(ours, m, atol=3e-5, rtol=0), (ours - m).abs().max()
        y = torch.einsum("hij,jhp->ihp", ours, x).flatten(1) * torch.nn.functional.silu(z)
        assert torch.allclose(y, parts["y"].double(), atol=1e-4, rtol=0), (y - parts["y"]).abs().max()


def test_mixer_maps_follow_the_maps_window_and_last_row(served):
    """LAST_ROW and a window of query rows cut the mixers' matrices as they cut the maps: the same rows of the whole
    prompt's matrices, each message's query_start saying where its rows start."""
    ids = torch.randint(0, 300, (12,), generator=torch.Generator().manual_seed(8)).tolist()
    _, whole = served_maps(served, MAMBA, ids)
    for attention, first, count, rows in ((pb.ATTENTION_LAST_ROW, 0, 0, slice(11, 12)),
                                          (pb.ATTENTION_FULL, 4, 5, slice(4, 9))):
        resp = served.Predict(pb.PredictRequest(model=MAMBA, prompt=prompt(ids), attention=attention, mixer_maps=True,
                                                query_start=first, query_count=count), timeout=60)
        assert {(m.layer, m.head) for m in resp.mixer_maps} == set(whole)
        for m in resp.mixer_maps:
            got = np.frombuffer(m.data, "<f4").reshape(m.shape)
            np.testing.assert_allclose(got, whole[m.layer, m.head][rows], atol=1e-6, rtol=0)
            assert m.query_start == rows.start


def test_a_mixer_maps_call_past_the_message_limit_is_refused_before_it_runs(served):
    """Predict's and Profile's mixer_maps hold every matrix of the whole prompt in one call: a prompt whose matrices
    pass --max-message-bytes is RESOURCE_EXHAUSTED (the worker's TooLarge) before any run, as a map request is."""
    ids = list(range(1, 301)) * 2  # 600 tokens: LFM2's 2 conv layers x 64 channels x 600^2 cells pass 64 MiB
    for call, request in ((served.Predict, pb.PredictRequest(model=FAMILY, prompt=prompt(ids), mixer_maps=True,
                                                             attention=pb.ATTENTION_FULL)),
                          (served.Profile, pb.ProfileRequest(model=FAMILY, prompt=prompt(ids), mixer_maps=True))):
        with pytest.raises(grpc.RpcError) as err:
            call(request, timeout=60)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err.value.details()
        assert "mixer matrices" in err.value.details()


def test_mixer_maps_without_the_maps_are_invalid_argument(served):
    with pytest.raises(grpc.RpcError) as err:
        served.Predict(pb.PredictRequest(model=FAMILY, prompt=prompt([1, 2, 3]), mixer_maps=True), timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "attention" in err.value.details()


def bucket(name: str, dist: np.ndarray) -> np.ndarray:
    """Whether each distance falls in the profile column `name` ("0", "1", "2-3", "64+")."""
    if name.endswith("+"):
        return dist >= int(name[:-1])
    lo, _, hi = name.partition("-")
    return (dist >= int(lo)) & (dist <= int(hi or lo))


@pytest.mark.parametrize("family", [FAMILY, MAMBA, DELTA])
def test_mixer_layers_profile_is_the_share_of_each_rows_weight_by_distance(served, family):
    """The Profile RPC's columns for a mixer layer: the buckets hold |m| / sum |m| by distance and the entropy is
    that share's, computed here from the served maps."""
    ids = torch.randint(0, 300, (21,), generator=torch.Generator().manual_seed(4)).tolist()
    prof = served.Profile(pb.ProfileRequest(model=family, prompt=prompt(ids)), timeout=60)
    values = np.frombuffer(prof.values, "<f4").reshape(prof.shape)
    resp = served.Predict(pb.PredictRequest(model=family, prompt=prompt(ids), attention=pb.ATTENTION_FULL),
                          timeout=60)
    cols = list(prof.columns)
    t = np.arange(len(ids))
    dist = t[:, None] - t[None, :]
    for m in resp.attention:
        if m.layer not in (0, 2):
            continue
        rows = np.abs(np.frombuffer(m.data, "<f4").reshape(m.shape).astype(np.float64))
        share = rows / rows.sum(-1, keepdims=True)
        want = {name: (share * bucket(name, dist)).sum(-1).mean() for name in cols[:prof.buckets]}
        logs = np.log(np.where(share > 0, share, 1.0))
        want["entropy"] = (-(share * logs).sum(-1)).mean()
        for name, value in want.items():
            assert abs(values[m.layer, m.head, cols.index(name)] - value) < 1e-4, (m.layer, m.head, name)
        assert values[m.layer, m.head, :prof.buckets].sum() == pytest.approx(1.0, abs=1e-5)


@pytest.mark.parametrize("family, last", [(BESIDE, 0), (MAMBA, 7), (FAMILY, 0)])
def test_mixer_maps_profile_is_the_share_of_each_own_matrix_rows_weight_by_distance(served, hf_zoo, family, last):
    """Profile with mixer_maps: per layer with a mixer (Falcon-H1's beside its attention too) and per channel or
    head, |m| / sum |m| of its own served matrix by distance, the first position and the entropy, as computed here
    from Predict's mixer_maps; the heads past a layer's own count are zero rows."""
    ids = torch.randint(0, 300, (19,), generator=torch.Generator().manual_seed(6)).tolist()
    prof = served.Profile(pb.ProfileRequest(model=family, prompt=prompt(ids), mixer_maps=True, last=last), timeout=60)
    _, exact = served_maps(served, family, ids)
    rows = slice(len(ids) - last if last else 0, None)  # the query rows averaged
    layers = sorted({i for i, _ in exact})
    assert list(prof.mixer_layers) == layers
    assert list(prof.mixer_heads) == [len([h for i, h in exact if i == layer]) for layer in layers]
    values = np.frombuffer(prof.values, "<f4").reshape(prof.shape)
    assert tuple(prof.shape[:2]) == (len(layers), max(prof.mixer_heads))
    cols, t = list(prof.columns), np.arange(len(ids))
    dist = t[:, None] - t[None, :]
    for entry, layer in enumerate(layers):
        for head in range(prof.mixer_heads[entry]):
            weight = np.abs(exact[layer, head].astype(np.float64))
            share = (weight / weight.sum(-1, keepdims=True))[rows]
            want = {name: (share * bucket(name, dist[rows])).sum(-1).mean() for name in cols[:prof.buckets]}
            want["first"] = share[:, 0].mean()
            want["entropy"] = (-(share * np.log(np.where(share > 0, share, 1.0))).sum(-1)).mean()
            for name, value in want.items():
                assert abs(values[entry, head, cols.index(name)] - value) < 1e-4, (layer, head, name)
        assert not values[entry, prof.mixer_heads[entry]:].any()


# the projection a layer's heads go into: a mixer's, or (Falcon-H1) the attention's, the Mamba-2 beside it untouched
ABLATED = {FAMILY: "conv.out_proj", MAMBA: "mamba.out_proj", BESIDE: "self_attn.o_proj", DELTA: "linear_attn.out_proj"}


@pytest.mark.parametrize("family", [FAMILY, MAMBA, BESIDE, DELTA])
def test_a_mixer_heads_ablation_equals_transformers_with_its_channels_zeroed(hf_zoo, family):
    """head_keep on a mixer layer zeroes the head's group of channels before its output projection: transformers
    with a pre-hook zeroing the same channels gives the same logits.  In a Falcon-H1 layer the head is the
    attention's: its Mamba-2 layer runs as it is."""
    hf, model = hf_zoo[family]["hf"], load_artifact(hf_zoo[family]["artifact"], threads=1)
    ids = torch.randint(0, 300, (11,), generator=torch.Generator().manual_seed(7)).tolist()
    layer, head, H = hf.config.num_hidden_layers - 1, 1, hf.config.num_attention_heads
    out = run(model, [resolve(model, Intervention(ablate_heads=((layer, head),)), ids, None)], maps=False)

    def zero(_m, args):
        y = args[0].clone()
        width = y.shape[-1] // H
        y[..., head * width:(head + 1) * width] = 0
        return (y,)

    hook = hf.model.layers[layer].get_submodule(ABLATED[family]).register_forward_pre_hook(zero)
    try:
        with torch.no_grad():
            want = hf(input_ids=torch.tensor([ids])).logits[0]
    finally:
        hook.remove()
    got = torch.from_numpy(out["logits"][0])
    assert (got - want).abs().max() < 1e-4
    with torch.no_grad():  # and the ablation changed something
        assert (hf(input_ids=torch.tensor([ids])).logits[0] - want).abs().max() > 1e-3


def test_switching_a_mixer_layers_positions_off_is_refused_naming_the_layer(served):
    """LFM2's attention layers rotate (layer 1 may be switched off), its conv layers have no encoding to remove."""
    with pytest.raises(grpc.RpcError) as err:
        served.Predict(pb.PredictRequest(model=FAMILY, prompt=prompt([5, 6, 7]),
                                         intervention=pb.Intervention(positional_off=[0])), timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "layer 0" in err.value.details() and "short_conv mixer" in err.value.details()
    served.Predict(pb.PredictRequest(model=FAMILY, prompt=prompt([5, 6, 7]),
                                     intervention=pb.Intervention(positional_off=[1])), timeout=30)


def test_encoding_note_says_where_each_layers_order_comes_from(served):
    note = served.Encoding(pb.EncodingRequest(model=FAMILY, length=8), timeout=30).note
    assert "layers 0, 2: a gated causal convolution over 3 tokens" in note
    assert "layer 1: RoPE base 1e+06" in note
    note = served.Encoding(pb.EncodingRequest(model=MAMBA, length=8), timeout=30).note
    assert note.startswith("no positional encoding: order reaches the attention layers only through the causal mask")
    assert "layers 0, 2: a Mamba-2 state-space layer" in note and "layer 1: no positional encoding (NoPE)" in note
    note = served.Encoding(pb.EncodingRequest(model=DELTA, length=8), timeout=30).note
    assert "layers 0, 2: a Gated DeltaNet layer, no attention (order from its decaying delta-rule state and a " \
           "convolution over 4 tokens)" in note and "layer 1: RoPE base 10000" in note
    note = served.Encoding(pb.EncodingRequest(model=BESIDE, length=8), timeout=30).note
    assert "layers 0, 1: RoPE base 1000 beside a Mamba-2 state-space layer (order also from its recurrence and a " \
           "convolution over 4 tokens)" in note


def imported(folder, family: str, **changes):
    """The family's tiny transformers model with `changes` to its config (weights perturbed as the zoo's), saved in
    folder and imported: (transformers' model, posenc's)."""
    import transformers as tf

    from model.hf import import_folder
    from tests.hf.helpers import hf_config, perturb, tokenizer_json

    config = hf_config(family)
    for name, value in changes.items():
        setattr(config, name, value)
    torch.manual_seed(0)
    hf = tf.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    perturb(hf, 0)
    hf.save_pretrained(folder)
    (folder / "tokenizer.json").write_text(tokenizer_json())
    return hf, import_folder(folder)[0].eval()


def test_nemotron_h_time_steps_clamped_below_equal_transformers_prompt(tmp_path):
    """time_step_min raised until it binds on about half of the tiny model's time steps: posenc's forward equals
    transformers' on a whole prompt (its chunked scan clamps; its one-token recurrent step does not, so a cached step
    is compared nowhere here)."""
    hf, ours = imported(tmp_path, "nemotron_h", time_step_min=0.7)
    assert ours.cfg.ssm_dt_min == 0.7
    ids = torch.randint(0, 300, (1, 17), generator=torch.Generator().manual_seed(5))
    steps = []
    hook = hf.model.layers[0].mixer.in_proj.register_forward_hook(lambda _m, _a, out: steps.append(out[..., -8:]))
    try:
        with torch.no_grad():
            want = hf(input_ids=ids).logits
    finally:
        hook.remove()
    dt = torch.nn.functional.softplus(steps[0] + hf.model.layers[0].mixer.dt_bias)
    assert 0.2 < (dt < 0.7).float().mean() < 0.8  # the clamp binds on many steps
    with torch.no_grad():
        got = ours(ids).logits
    assert (got - want).abs().max() < 1e-4


@pytest.mark.parametrize("family, built, edits, field, value", [
    # Nemotron-H's older mamba_dt_min, which transformers takes over time_step_min
    ("nemotron_h", {}, {"mamba_dt_min": 0.7}, "ssm_dt_min", 0.7),
    # Qwen3-Next's rotated fraction given only in the older rope_scaling
    (DELTA, {}, {"rope_parameters": None, "rope_scaling": {"rope_type": "default", "rope_theta": 10000.0,
                                                           "partial_rotary_factor": 0.5}}, "rope_fraction", 0.5),
    # a Qwen3-Next without experts: every layer a dense MLP
    (DELTA, {"num_experts": 0}, {}, "n_experts", 0),
    # both spellings: rope_scaling replaces rope_parameters whole, its base then the top-level rope_theta
    (DELTA, {}, {"rope_parameters": {"rope_type": "default", "rope_theta": 5e5, "partial_rotary_factor": 0.25},
                 "rope_scaling": {"rope_type": "linear", "factor": 2.0, "partial_rotary_factor": 0.5},
                 "rope_theta": 2e4}, "rope_base", 2e4),
])
def test_config_spellings_import_as_transformers_reads_them(tmp_path, family, built, edits, field, value):
    """A folder's config.json as transformers reads it back (from_pretrained): posenc's import takes the same values
    and gives transformers' logits."""
    import json

    import transformers as tf

    from model.hf import import_folder

    imported(tmp_path, family, **built)
    data = {**json.loads((tmp_path / "config.json").read_text()), **edits}
    (tmp_path / "config.json").write_text(json.dumps({k: v for k, v in data.items() if v is not None}))
    hf = tf.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    if getattr(hf.config, "num_experts", 0) or getattr(hf.config, "n_routed_experts", 0):
        hf.set_experts_implementation("eager")
    ours = import_folder(tmp_path)[0].eval()
    assert getattr(ours.cfg, field) == value
    ids = torch.randint(0, 300, (1, 19), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        assert (ours(ids).logits - hf(input_ids=ids).logits).abs().max() < 1e-4


@pytest.mark.parametrize("rms_norm, before_gate", [(True, True), (True, False)])
def test_falcon_h1_mamba_output_norms_equal_transformers_prompt_and_cached_steps(tmp_path, rms_norm, before_gate):
    """mamba_rms_norm with the norm before the gate (Falcon-H1's default) and after it, beside the tiny model's
    no-norm form (the family tests): posenc's forward equals transformers' on a prompt, and three cached one-token
    steps equal transformers' cached steps (its recurrent update)."""
    hf, ours = imported(tmp_path, BESIDE, mamba_rms_norm=rms_norm, mamba_norm_before_gate=before_gate)
    assert ours.cfg.ssm_norm == ("norm_then_gate" if before_gate else "gated")
    ids = torch.randint(0, 300, (1, 20), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        want = hf(input_ids=ids[:, :17], use_cache=True)
        got = ours(ids[:, :17])
        assert (got.logits - want.logits).abs().max() < 1e-4
        cache, past = want.past_key_values, got.presents
        for t in range(17, 20):
            want = hf(input_ids=ids[:, t:t + 1], past_key_values=cache, use_cache=True)
            got = ours(ids[:, t:t + 1], past_key_values=past)
            cache, past = want.past_key_values, got.presents
            assert (got.logits - want.logits).abs().max() < 1e-4, t


HYBRIDS = [FAMILY, MAMBA, BESIDE, DELTA]


@pytest.mark.parametrize("family", HYBRIDS)
def test_concurrent_streams_joining_and_leaving_the_batch_each_equal_generate_alone(served, hf_zoo, family):
    """Five greedy streams of different prompt lengths and lengths of their own, sent at once: the worker's decode
    batch takes them in and lets them go at different steps, each row carrying its conv (and SSM) state in the
    padded layout; every stream's tokens equal transformers' generate() for its prompt alone."""
    from concurrent.futures import ThreadPoolExecutor

    hf = hf_zoo[family]["hf"]
    g = torch.Generator().manual_seed(11)
    jobs = [(torch.randint(1, 300, (n,), generator=g).tolist(), new) for n, new in
            ((1, 9), (5, 14), (12, 4), (3, 11), (20, 7))]

    def stream(job):
        ids, new = job
        msgs = served.Generate(pb.GenerateRequest(model=family, prompt=prompt(ids), max_new_tokens=new,
                                                  ignore_eos=True), timeout=120)
        return [m.token.id for m in msgs]

    with ThreadPoolExecutor(len(jobs)) as pool:
        got = list(pool.map(stream, jobs))
    for (ids, new), tokens in zip(jobs, got, strict=True):
        with torch.no_grad():
            want = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.int64),
                               max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
        assert tokens == want[0, len(ids):].tolist(), (family, len(ids))


@pytest.mark.parametrize("family", HYBRIDS)
def test_score_equals_transformers_log_probabilities(served, hf_zoo, family):
    hf = hf_zoo[family]["hf"]
    ids = torch.randint(1, 300, (30,), generator=torch.Generator().manual_seed(12)).tolist()
    resp = served.Score(pb.ScoreRequest(model=family, prompt=prompt(ids)), timeout=60)
    with torch.no_grad():
        logits = hf(input_ids=torch.tensor([ids])).logits[0].double()
    want = torch.log_softmax(logits, -1)[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
    assert np.allclose(list(resp.logprobs), want.numpy(), atol=1e-4)


def test_list_models_names_each_layers_mixer_as_transformers_builds_it(served, hf_zoo):
    """ModelInfo.layer_mixers, against each family's own config: LFM2's layer_types (conv / full_attention),
    Granite's and Qwen3-Next's (linear_attention: its Mamba-2 or Gated DeltaNet layers / full_attention), and
    Falcon-H1's, whose every layer is attention with a Mamba-2 layer beside it."""
    models = served.ListModels(pb.ListModelsRequest(), timeout=30).models
    got = {m.name: list(m.layer_mixers) for m in models}
    linear = {MAMBA: "mamba2", DELTA: "gated_deltanet"}
    for family in (FAMILY, MAMBA, DELTA):
        kinds = {"conv": "short_conv", "linear_attention": linear.get(family), "full_attention": "attention"}
        assert got[family] == [kinds[t] for t in hf_zoo[family]["hf"].config.layer_types]
    assert got[BESIDE] == ["attention"] * hf_zoo[BESIDE]["hf"].config.num_hidden_layers
    # layer_mixer_maps: how many exact matrices mixer_maps gives per layer, by transformers' own sizes
    counts = {m.name: list(m.layer_mixer_maps) for m in models}
    cfgs = {f: hf_zoo[f]["hf"].config for f in (FAMILY, MAMBA, DELTA, BESIDE)}
    assert counts[FAMILY] == [cfgs[FAMILY].hidden_size if t == "conv" else 0 for t in cfgs[FAMILY].layer_types]
    assert counts[MAMBA] == [cfgs[MAMBA].mamba_n_heads if t == "linear_attention" else 0
                             for t in cfgs[MAMBA].layer_types]
    assert counts[DELTA] == [cfgs[DELTA].linear_num_value_heads if t == "linear_attention" else 0
                             for t in cfgs[DELTA].layer_types]
    assert counts[BESIDE] == [cfgs[BESIDE].mamba_n_heads] * cfgs[BESIDE].num_hidden_layers


def test_a_long_prompts_last_row_and_profile_span_every_key_of_a_mamba2_layer(served):
    """300 tokens, past the rows a profile call holds for such a length and past the one-token call Predict's last
    row otherwise takes: the Mamba-2 layers' last row and profile are those of the whole prompt's maps."""
    ids = torch.randint(1, 300, (300,), generator=torch.Generator().manual_seed(13)).tolist()
    full = served.Predict(pb.PredictRequest(model=MAMBA, prompt=prompt(ids), attention=pb.ATTENTION_FULL),
                          timeout=120)
    maps = {(m.layer, m.head): np.frombuffer(m.data, "<f4").reshape(m.shape) for m in full.attention}
    last = served.Predict(pb.PredictRequest(model=MAMBA, prompt=prompt(ids), attention=pb.ATTENTION_LAST_ROW),
                          timeout=120)
    for m in last.attention:
        row = np.frombuffer(m.data, "<f4").reshape(m.shape)[-1]
        assert np.allclose(row, maps[m.layer, m.head][-1], atol=3e-6), (m.layer, m.head)
    assert np.count_nonzero(maps[0, 0][-1][:-1]) > 100  # the last row reaches far back, not the token alone
    prof = served.Profile(pb.ProfileRequest(model=MAMBA, prompt=prompt(ids)), timeout=120)
    values = np.frombuffer(prof.values, "<f4").reshape(prof.shape)
    cols, t = list(prof.columns), np.arange(len(ids))
    dist = t[:, None] - t[None, :]
    for layer in (0, 2):
        for head in range(prof.shape[1]):
            rows = np.abs(maps[layer, head].astype(np.float64))
            share = rows / rows.sum(-1, keepdims=True)
            for name in cols[:prof.buckets]:
                want = (share * bucket(name, dist)).sum(-1).mean()
                assert abs(values[layer, head, cols.index(name)] - want) < 1e-4, (layer, head, name)


def test_the_intervention_graph_of_a_mixer_model_is_its_maps_graph_less_the_matrices(hf_zoo, tmp_path,
                                                                                         monkeypatch):
    """A model with mixers is traced once (export/intervene.py): its intervene.onnx, the maps graph less mixer_maps
    and what only that output needed, has the inputs and outputs (names, types, shapes) and operators of the graph
    traced without exact maps (traced here), and computes what it does on the intervention example."""
    import collections

    import onnx
    import onnxruntime as ort

    from export import dynamo, intervene
    from export.hf import import_folder

    monkeypatch.setattr(dynamo, "CACHE_DIR", None)  # traced here, not read from the run's graph cache
    model, _ = import_folder(hf_zoo[FAMILY]["folder"])
    intervene.export_intervene(model, tmp_path / "traced.onnx", 23, "onnx")
    served_graph = hf_zoo[FAMILY]["artifact"] / intervene.INTERVENE_ONNX
    derived, traced = (onnx.load(str(p)) for p in (served_graph, tmp_path / "traced.onnx"))
    for part in ("input", "output"):
        assert [(v.name, v.type) for v in getattr(derived.graph, part)] == \
            [(v.name, v.type) for v in getattr(traced.graph, part)]
    assert "mixer_maps" not in [o.name for o in derived.graph.output]
    assert collections.Counter(n.op_type for n in derived.graph.node) == \
        collections.Counter(n.op_type for n in traced.graph.node)
    ids, mask, positions, on, keep, rope, kv = intervene.example(model)
    feeds = {i.name: t.numpy() for i, t in zip(derived.graph.input, [ids, mask, positions, on, keep, *rope, *kv],
                                               strict=True)}
    a, b = (ort.InferenceSession(str(p), providers=["CPUExecutionProvider"]).run(None, feeds)
            for p in (served_graph, tmp_path / "traced.onnx"))
    for x, y in zip(a, b, strict=True):
        np.testing.assert_allclose(x, y, rtol=0, atol=1e-5)
