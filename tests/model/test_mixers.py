"""Mixer layers in posenc's own model (model/mixers.py, model/ssm.py): short convolutions, Mamba-2 layers and a
layer that mixes nothing.  A row's answer does not depend on how it is batched or cached (one token at a time,
pieces shorter than the kernel, left-padded pieces while carrying state), with biases on (which a pad's zero input
would carry into a window if pads entered it) and Mamba-2's time steps clamped; the config refuses what it cannot
run."""

import pytest
import torch

from model.config import ModelConfig, preset
from model.errors import ConfigError
from model.layer_spec import LayerSpec
from model.transformer import Transformer

CONV, ATTN = LayerSpec(mixer="short_conv"), LayerSpec()


MAMBA, MLP_ONLY = LayerSpec(mixer="mamba2", mlp=False), LayerSpec(mixer="none")
MODELS = {"short_conv": {"layers": [CONV, ATTN, CONV]},
          "mamba2": {"layers": [MAMBA, MLP_ONLY, ATTN, MAMBA], "ssm_heads": 8, "ssm_head_dim": 8, "ssm_state": 4,
                     "ssm_groups": 2, "ssm_dt_min": 1.3, "residual_scale": 0.7},  # the clamp binds on about half
          # Falcon-H1's layers: a Mamba-2 layer (6 heads, not a multiple of the maps' 4) beside the attention
          # Qwen3-Next's delta layers: 8 value heads on 2 key heads, between attention layers
          "gated_deltanet": {"layers": [LayerSpec(mixer="gated_deltanet"), ATTN, LayerSpec(mixer="gated_deltanet")],
                             "ssm_heads": 8, "ssm_head_dim": 4, "ssm_state": 6, "ssm_groups": 2},
          "beside": {"layers": [LayerSpec(beside="mamba2"), ATTN], "ssm_heads": 6, "ssm_head_dim": 4, "ssm_state": 4,
                     "ssm_groups": 3, "ssm_norm": "norm_then_gate"}}


@pytest.fixture(scope="module", params=list(MODELS))
def model(request):
    return build(request.param)


def build(name: str) -> Transformer:
    torch.manual_seed(0)
    fields = MODELS[name]
    cfg = preset("tiny", norm="rmsnorm", mlp="gated", activation="silu", n_layers=len(fields["layers"]),
                 conv_kernel=4, conv_bias=True, **fields)
    m = Transformer(cfg).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return m


def test_cached_steps_and_uneven_pieces_equal_the_full_forward(model):
    ids = torch.randint(0, 256, (1, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(ids)
        for cuts in ([5, 6, 7, 8, 9, 10], [1, 2, 3], [2, 9]):  # one token at a time, pieces shorter than the kernel
            out, logits, start = None, [], 0
            for end in [*cuts, 11]:
                out = model(ids[:, start:end], past_key_values=None if out is None else out.presents)
                logits.append(out.logits)
                start = end
            assert torch.allclose(torch.cat(logits, 1), full.logits, atol=1e-5), cuts


def test_left_padded_rows_and_padded_pieces_equal_each_row_alone(model):
    """Rows of 9, 4 and 1 tokens left-padded into one batch, then a second piece of 3 new tokens in which the
    shorter rows are padded again while carrying their states: each row's logits are its own."""
    g = torch.Generator().manual_seed(2)
    rows = [torch.randint(0, 256, (n,), generator=g) for n in (9, 4, 1)]
    more = [torch.randint(0, 256, (n,), generator=g) for n in (3, 2, 1)]
    ids = torch.zeros(3, 9, dtype=torch.int64)
    mask = torch.zeros(3, 9, dtype=torch.int64)
    ids2, mask2 = torch.zeros(3, 3, dtype=torch.int64), torch.zeros(3, 3, dtype=torch.int64)
    for b in range(3):
        ids[b, 9 - len(rows[b]):], mask[b, 9 - len(rows[b]):] = rows[b], 1
        ids2[b, 3 - len(more[b]):], mask2[b, 3 - len(more[b]):] = more[b], 1
    with torch.no_grad():
        first = model(ids, mask)
        second = model(ids2, torch.cat([mask, mask2], 1), past_key_values=first.presents)
        for b in range(3):
            alone = model(torch.cat([rows[b], more[b]])[None])
            n, m = len(rows[b]), len(more[b])
            assert torch.allclose(first.logits[b, 9 - n:], alone.logits[0, :n], atol=1e-5), b
            assert torch.allclose(second.logits[b, 3 - m:], alone.logits[0, n:], atol=1e-5), b
            maps = first.attentions[b, :, :, 9 - n:, 9 - n:]
            assert torch.allclose(maps, alone.attentions[0, :, :, :n, :n], atol=1e-6), b


def test_config_refuses_what_it_cannot_run():
    with pytest.raises(ConfigError, match="conv_kernel"):
        ModelConfig(n_layers=2, layers=[CONV, ATTN])
    with pytest.raises(ConfigError, match="at least one attention layer"):
        ModelConfig(n_layers=2, conv_kernel=3, layers=[CONV, CONV])
    with pytest.raises(ConfigError, match="mixer"):
        ModelConfig(n_layers=1, conv_kernel=3, layers=[LayerSpec(mixer="mamba")])
    with pytest.raises(ConfigError, match="ssm_heads"):
        ModelConfig(n_layers=2, conv_kernel=3, layers=[MAMBA, ATTN])
    with pytest.raises(ConfigError, match="leaves a branch out"):
        Transformer(preset("tiny", parallel_residual=True, layers=[MLP_ONLY, ATTN]))
    with pytest.raises(ConfigError, match="beside an attention layer's attention only"):
        ModelConfig(n_layers=2, conv_kernel=3, ssm_heads=4, ssm_head_dim=4, ssm_state=4,
                    layers=[LayerSpec(mixer="mamba2", beside="mamba2"), ATTN])
    with pytest.raises(ConfigError, match="ssm_norm"):
        ModelConfig(ssm_norm="after")
    with pytest.raises(ConfigError, match="sequential pre-norm"):
        Transformer(preset("tiny", parallel_residual=True, conv_kernel=3, ssm_heads=4, ssm_head_dim=4, ssm_state=4,
                           layers=[LayerSpec(beside="mamba2"), ATTN]))


def test_a_layer_that_mixes_nothing_maps_each_token_to_itself():
    """Layer 1 of the Mamba-2 model is an MLP alone: its maps are the identity on real tokens, 0 on pads."""
    model = build("mamba2")
    ids = torch.randint(0, 256, (2, 6), generator=torch.Generator().manual_seed(3))
    mask = torch.ones(2, 6, dtype=torch.int64)
    mask[1, :2] = 0
    with torch.no_grad():
        maps = model(ids, mask).attentions[:, 1]  # (B, H, T, T)
    want = torch.eye(6).expand(2, model.cfg.n_heads, 6, 6) * mask[:, None, :, None]
    assert torch.equal(maps, want)


def test_exact_maps_are_each_mixer_heads_own_matrix_and_average_to_the_layers_maps(model):
    """use_exact_maps: every layer with a mixer (beside an attention too) gives one matrix per channel or head,
    leaves the logits alone, is 0 on pads and on the past's keys, and averages over its map-head groups to the
    layer's served maps (a mixer layer's; a mixer beside an attention has no maps of its own)."""
    cfg = model.cfg
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(2))
    mask = torch.ones(2, 9, dtype=torch.int64)
    mask[1, :3] = 0  # left padding
    with torch.no_grad():
        plain = model(ids, mask)
        exact = model.use_exact_maps()(ids, mask)
        step = model(ids[:, -1:], torch.cat([mask, torch.ones(2, 1, dtype=torch.int64)], 1),
                     past_key_values=exact.presents)
        model.use_exact_maps(False)
    assert torch.equal(plain.logits, exact.logits) and plain.mixer_maps is None
    with_mixer = [i for i in range(cfg.n_layers) if cfg.mixer_map_heads(i)]
    assert exact.mixer_maps.shape == (2, len(with_mixer), max(map(cfg.mixer_map_heads, with_mixer)), 9, 9)
    # a cached step: a recurrent mixer's matrix spans the call's own key (the past reaches it through the state), a
    # convolution's its kernel's reach
    reach = cfg.conv_kernel - 1 if cfg.layer(with_mixer[0]).mixer == "short_conv" else 0
    assert step.mixer_maps.shape[-2:] == (1, 10) and not step.mixer_maps[..., :9 - reach].any()
    assert step.mixer_maps[..., 9 - reach:].abs().sum() > 0
    assert not exact.mixer_maps[1, ..., :3].any() and not exact.mixer_maps[1, :, :, :3].any()  # pads
    for m, i in enumerate(with_mixer):
        heads = cfg.mixer_map_heads(i)
        rows = exact.mixer_maps[:, m]
        assert not rows[:, heads:].any()  # zeros past the layer's own count
        assert rows[:, :heads].abs().sum() > 0
        if cfg.attends(i):  # beside an attention: the layer's maps stay the attention's probabilities
            assert torch.allclose(exact.attentions[:, i].sum(-1)[0], torch.ones(cfg.n_heads, 9), atol=1e-5)
            continue
        means = rows[:, :heads].unflatten(1, (cfg.n_heads, heads // cfg.n_heads)).mean(2)
        assert torch.allclose(means, exact.attentions[:, i], atol=1e-6), i
