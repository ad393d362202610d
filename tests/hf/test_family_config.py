"""The config fields families set are validated like every other field and survive model.json's JSON."""

import json

import pytest

from model.config import ModelConfig
from model.errors import ConfigError


def test_window_layers_survive_json():
    cfg = ModelConfig(n_layers=3, sliding_window=4, window_layers=(1, 2), qk_norm="rmsnorm", embed_scale=2.0)
    back = ModelConfig.from_dict(json.loads(cfg.to_json()))
    assert back == cfg and back.window_layers == (1, 2)


@pytest.mark.parametrize("changes, message", [
    ({"sliding_window": -1}, "sliding_window must be a non-negative integer"),
    ({"sliding_window": 4, "window_layers": [4]}, "window_layers must be layer indices below n_layers"),
    ({"qk_norm": "batchnorm"}, "qk_norm must be one of"),
    ({"shared_norm": True}, "shared_norm applies to parallel blocks only"),
    ({"head_bias": True}, "head_bias needs an untied head"),
    ({"embed_scale": 0.0}, "must be > 0"),
    ({"alibi_scale": -1.0}, "must be > 0"),
    ({"nope_layers": [4]}, "nope_layers must be layer indices below n_layers"),
    ({"local_rope_base": 0.5}, "local_rope_base must be > 1"),
    ({"attn_softcap": -1.0}, "attn_softcap must be a number >= 0"),
    ({"logit_scale": 0.0}, "logit_scale must be > 0"),
    ({"pre_norm": False}, "pre_norm false needs sandwich_norm"),
    ({"pre_norm": False, "sandwich_norm": True, "parallel_residual": True}, "pre_norm false needs sandwich_norm"),
])
def test_inconsistent_family_fields_are_refused(changes, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig(**changes)


@pytest.mark.parametrize("variant", ["alibi", "none", "learned"])
@pytest.mark.parametrize("field, value", [("nope_layers", (1,)), ("local_rope_base", 100.0)])
def test_per_layer_rope_fields_need_the_rope_variant(variant, field, value):
    from model.variants import check_config

    with pytest.raises(ConfigError, match=f"{field} applies to the rope variant only"):
        check_config(ModelConfig(variant=variant, **{field: value}))


def test_layers_survive_json_and_describe_each_layer():
    cfg = ModelConfig(n_layers=3, sliding_window=4, window_layers=(0, 1), nope_layers=[2], local_rope_base=50.0,
                      attn_softcap=5.0, rope_scaling="linear", rope_factor=2.0)
    back = ModelConfig.from_dict(json.loads(cfg.to_json()))
    assert back == cfg and back.nope_layers == (2,)
    assert [(x["attention"], x["window"], x["encoding"], x.get("rope", {}).get("base")) for x in cfg.layer_plan()] == [
        ("sliding", 4, "rope", 50.0), ("sliding", 4, "rope", 50.0), ("full", None, "none", None)]
