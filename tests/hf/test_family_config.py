"""The config fields families set are validated like every other field and survive model.json's JSON; each layer's
record (LayerSpec) is read back from JSON, and from the per-layer lists older configs carry."""

import json

import pytest

from model.config import OLD_LAYER_LISTS, LayerSpec, ModelConfig
from model.errors import ConfigError

FULL, SLIDING, NOPE = LayerSpec(), LayerSpec("sliding"), LayerSpec(encoding="none")


def test_layer_records_survive_json():
    cfg = ModelConfig(n_layers=3, sliding_window=4, layers=[FULL, SLIDING, SLIDING], qk_norm="rmsnorm",
                      embed_scale=2.0)
    back = ModelConfig.from_dict(json.loads(cfg.to_json()))
    assert back == cfg and back.layers == (FULL, SLIDING, SLIDING)
    assert [back.layer(i).attention for i in range(3)] == ["full", "sliding", "sliding"]


def test_records_all_alike_are_stored_as_none():
    """One spelling per model: records equal to the uniform one are (), which applies every model-wide value."""
    assert ModelConfig(n_layers=2, sliding_window=4, layers=[SLIDING, SLIDING]).layers == ()
    assert ModelConfig(n_layers=2, sliding_window=4) == ModelConfig(n_layers=2, sliding_window=4, layers=[SLIDING] * 2)
    assert ModelConfig(n_layers=2, sliding_window=4, layers=[FULL, FULL]).layers == (FULL, FULL)  # not uniform
    local = ModelConfig(n_layers=2, sliding_window=4, local_rope_base=50.0)
    assert local.layer(1) == LayerSpec("sliding", "local")
    chunked = ModelConfig(n_layers=2, attention_chunk=8, temperature_floor=4.0)
    assert chunked.layer(0) == LayerSpec("chunked", temperature=True)


@pytest.mark.parametrize("old, records", [
    ({"sliding_window": 4, "window_layers": [1]}, [FULL, SLIDING, FULL]),
    ({"sliding_window": 4, "window_layers": []}, []),  # empty: every layer
    ({"sliding_window": 4, "window_layers": [0, 1], "nope_layers": [2], "local_rope_base": 50.0},
     [LayerSpec("sliding", "local")] * 2 + [NOPE]),
    ({"attention_chunk": 8, "chunk_layers": [0], "nope_layers": [1, 2], "temperature_floor": 4.0, "qk_norm": "l2",
      "qk_norm_layers": [0]}, [LayerSpec("chunked")] + [LayerSpec("full", "none", False, True, True)] * 2),
    ({"n_experts": 4, "experts_top_k": 2, "mlp": "gated", "dense_layers": 1},
     [LayerSpec(experts=False), FULL, FULL]),
    ({"n_experts": 4, "experts_top_k": 2, "mlp": "gated", "expert_layers": [1]},
     [LayerSpec(experts=False), FULL, LayerSpec(experts=False)]),
    ({"window_layers": [], "nope_layers": [], "chunk_layers": [], "qk_norm_layers": [], "expert_layers": [],
      "dense_layers": 0}, []),  # a config written before any layer differed
])
def test_older_per_layer_lists_are_read_into_records(old, records):
    """Checkpoints and model.json files written with window_layers, nope_layers, ... load as the same model."""
    assert set(old) - set(ModelConfig.__dataclass_fields__) <= set(OLD_LAYER_LISTS)
    cfg = ModelConfig.from_dict({"n_layers": 3, **old})
    new = {k: v for k, v in old.items() if k not in OLD_LAYER_LISTS}
    assert cfg == ModelConfig(n_layers=3, layers=records, **new) and list(cfg.layers) == records
    assert "window_layers" not in cfg.to_dict() and ModelConfig.from_dict(cfg.to_dict()) == cfg


def test_older_lists_beside_records_are_refused():
    with pytest.raises(ConfigError, match="describe the same layers"):
        ModelConfig.from_dict({"n_layers": 2, "sliding_window": 4, "window_layers": [0], "layers": [{}, {}]})


@pytest.mark.parametrize("changes, message", [
    ({"sliding_window": -1}, "sliding_window must be a non-negative integer"),
    ({"sliding_window": 4, "layers": [SLIDING]}, "layers must hold one record per layer"),
    ({"layers": [SLIDING] * 4}, r"layers\[0\] .* needs sliding_window"),
    ({"layers": [LayerSpec(encoding="local")] * 4}, "needs local_rope_base"),
    ({"layers": [LayerSpec(temperature=True)] * 4}, "needs temperature_floor"),
    ({"layers": [LayerSpec(qk_norm=False)] * 4}, "needs qk_norm"),
    ({"layers": [LayerSpec(experts=False)] * 4}, "needs n_experts"),
    ({"layers": [LayerSpec("window")] * 4}, "needs attention in"),
    ({"layers": [{"attention": "full", "window": 4}] * 4}, "records with LayerSpec's fields"),
    ({"sliding_window": 4, "attention_chunk": 8}, "either windowed .* or chunked"),
    ({"qk_norm": "batchnorm"}, "qk_norm must be one of"),
    ({"shared_norm": True}, "shared_norm applies to parallel blocks only"),
    ({"head_bias": True}, "head_bias needs an untied head"),
    ({"embed_scale": 0.0}, "must be > 0"),
    ({"alibi_scale": -1.0}, "must be > 0"),
    ({"local_rope_base": 0.5}, "local_rope_base must be > 1"),
    ({"attn_softcap": -1.0}, "attn_softcap must be a number >= 0"),
    ({"logit_scale": 0.0}, "logit_scale and residual_scale must be > 0"),
    ({"residual_scale": -0.5}, "logit_scale and residual_scale must be > 0"),
    ({"pre_norm": False}, "pre_norm false needs sandwich_norm"),
    ({"pre_norm": False, "sandwich_norm": True, "parallel_residual": True}, "pre_norm false needs sandwich_norm"),
])
def test_inconsistent_family_fields_are_refused(changes, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig(**changes)


@pytest.mark.parametrize("variant", ["alibi", "none", "learned"])
@pytest.mark.parametrize("field, value, message", [
    ("layers", [FULL, NOPE, FULL, FULL], "layer 1's encoding 'none'"), ("local_rope_base", 100.0, "local_rope_base")])
def test_per_layer_rope_fields_need_the_rope_variant(variant, field, value, message):
    from model.variants import check_config

    with pytest.raises(ConfigError, match=f"{message}.* applies to the rope variant only"):
        check_config(ModelConfig(variant=variant, **{field: value}))


def test_layers_survive_json_and_describe_each_layer():
    cfg = ModelConfig(n_layers=3, sliding_window=4, layers=[LayerSpec("sliding", "local")] * 2 + [NOPE],
                      local_rope_base=50.0, attn_softcap=5.0, rope_scaling="linear", rope_factor=2.0)
    back = ModelConfig.from_dict(json.loads(cfg.to_json()))
    assert back == cfg and back.layer(2) == NOPE
    assert [(x["attention"], x["window"], x["encoding"], x.get("rope", {}).get("base")) for x in cfg.layer_plan()] == [
        ("sliding", 4, "rope", 50.0), ("sliding", 4, "rope", 50.0), ("full", None, "none", None)]
