import dataclasses

import pytest

from model.config import PRESETS, ModelConfig, preset
from model.errors import ConfigError, UnknownVariantError
from model.variants import REGISTRY, VARIANT_NAMES, build_variant, check_config, max_positions


def test_registry_matches_names():
    assert tuple(REGISTRY) == VARIANT_NAMES
    assert len(VARIANT_NAMES) == 22


def test_default_preset_is_design_section_3():
    cfg = preset("default", "rope")
    assert (cfg.vocab_size, cfg.d_model, cfg.n_heads, cfg.n_layers, cfg.d_mlp, cfg.context) == (
        256, 128, 4, 4, 512, 128)


@pytest.mark.parametrize("name", sorted(PRESETS))
@pytest.mark.parametrize("variant", VARIANT_NAMES)
def test_presets_valid_for_every_variant(name, variant):
    cfg = preset(name, variant)
    assert cfg.variant == variant
    assert check_config(cfg) is REGISTRY[variant]
    assert max_positions(cfg) == (cfg.context if variant == "learned" else None)  # only a table bounds positions


def test_unknown_variant_lists_known():
    cfg = ModelConfig(variant="warp")  # a name is data to the config; the registry is what knows the names
    with pytest.raises(UnknownVariantError) as err:
        build_variant(cfg)
    for name in VARIANT_NAMES:
        assert name in str(err.value)


@pytest.mark.parametrize("changes, match", [
    ({"d_model": 30, "n_heads": 4}, "divisible"),
    ({"n_layers": 0}, "positive integer"),
    ({"context": -1}, "positive integer"),
    ({"d_mlp": True}, "positive integer"),
    ({"vocab_size": 2.5}, "positive integer"),
    ({"t5_buckets": 8, "t5_max_distance": 3}, "t5"),
    ({"rope_base": 1.0}, "rope_base"),
    ({"n_heads": 4, "n_kv_heads": 3}, "multiple of n_kv_heads"),
    ({"norm": "batchnorm"}, "norm must be one of layernorm, rmsnorm"),
    ({"mlp": "moe"}, "mlp must be one of"),
    ({"activation": "tanh"}, "activation must be one of"),
    ({"rope_pairing": "random"}, "rope_pairing"),
    ({"rope_fraction": 0.0}, "rope_fraction"),
    ({"tie_head": 1}, "true or false"),
    ({"d_head": -1}, "non-negative"),
])
def test_inconsistent_config_rejected(changes, match):
    with pytest.raises(ConfigError, match=match):
        ModelConfig(**changes)


@pytest.mark.parametrize("changes, match", [
    ({"variant": "rope", "d_model": 12, "n_heads": 4}, "rope needs an even head dimension"),
    ({"variant": "rope", "d_model": 64, "n_heads": 4, "rope_fraction": 0.1}, "even head dimension"),
    ({"variant": "sinusoidal", "d_model": 15, "n_heads": 3}, "sinusoidal needs an even d_model, got 15"),
    ({"variant": "rope", "rope_scaling": "nope"}, "rope_scaling must be one of none, linear, ntk, dynamic"),
    ({"variant": "alibi", "rope_scaling": "yarn", "rope_factor": 2.0}, "rope variant only, not alibi"),
    ({"variant": "rope", "rope_scaling": "llama3", "rope_low_freq_factor": 4.0}, "must exceed rope_low_freq"),
])
def test_what_a_name_requires_is_refused_by_its_class(changes, match):
    """A config is data: the class its variant or scaling names checks what that name requires, before any model
    is built (check_config) and when one is (build_variant)."""
    cfg = ModelConfig(**changes)
    for check in (check_config, build_variant):
        with pytest.raises(ConfigError, match=match):
            check(cfg)


def test_frozen_and_json_roundtrip():
    cfg = preset("tiny", "fire")
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.d_model = 64
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg


def test_from_dict_rejects_unknown_fields():
    with pytest.raises(ConfigError, match="use_alibi"):
        ModelConfig.from_dict({**preset("tiny").to_dict(), "use_alibi": True})


def test_unknown_preset():
    with pytest.raises(ConfigError, match="known presets"):
        preset("huge")


def test_architecture_defaults_are_todays_model():
    """Old checkpoints carry no architecture fields: the defaults must be the architecture they were trained as."""
    cfg = ModelConfig()
    assert (cfg.norm, cfg.mlp, cfg.activation, cfg.kv_heads, cfg.head_dim, cfg.parallel_residual) == \
        ("layernorm", "plain", "gelu", 4, 32, False)
    assert cfg.qkv_bias and cfg.out_bias and cfg.mlp_bias and cfg.tie_head and not cfg.embed_norm
    assert (cfg.rope_fraction, cfg.rope_pairing, cfg.rope_dim) == (1.0, "half", 32)
    old = {k: v for k, v in cfg.to_dict().items() if k not in {"norm", "mlp", "activation", "n_kv_heads", "d_head",
                                                               "parallel_residual", "qkv_bias", "out_bias",
                                                               "mlp_bias", "tie_head", "embed_norm",
                                                               "rope_fraction", "rope_pairing"}}
    assert ModelConfig.from_dict(old) == cfg


def test_explicit_head_dim_and_grouped_kv_heads():
    cfg = ModelConfig(d_model=64, n_heads=4, n_kv_heads=2, d_head=24, rope_fraction=0.5)
    assert (cfg.head_dim, cfg.kv_heads, cfg.rope_dim) == (24, 2, 12)
