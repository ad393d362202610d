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
])
def test_inconsistent_family_fields_are_refused(changes, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig(**changes)
