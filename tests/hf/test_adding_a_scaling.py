"""ARCHITECTURE.md section 9 is true: the ABF example there, as written into model/rope_scaling/types.py, is one
registered class, and with nothing else changed the factory finds it, a folder's rope_parameters and the config
name it, and the rope variant rotates with it as transformers rotates at the base times the factor."""

import re
from pathlib import Path

import pytest
import torch
import transformers as tf
from transformers.models.llama import modeling_llama as llama

from export import gqa
from model import rope_scaling
from model.config import ModelConfig
from model.errors import ConfigError
from model.rope_scaling import types
from model.variants import build_variant

ROOT = Path(__file__).resolve().parents[2]
BASE, FACTOR = 10000.0, 50.0


@pytest.fixture
def abf():
    doc = (ROOT / "ARCHITECTURE.md").read_text()
    section = doc[doc.index("## 9. Adding a RoPE scaling type"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    namespace = dict(vars(types))  # the block is written into types.py: its imports are that module's
    exec(compile(code, "ARCHITECTURE.md section 9", "exec"), namespace)
    try:
        yield namespace["AdjustedBase"]
    finally:
        rope_scaling.TYPES.pop("abf", None)  # other tests see the built-in types only


def test_a_config_naming_the_type_is_refused_until_it_is_registered():
    with pytest.raises(ConfigError, match="rope_scaling must be one of none, linear, .* got 'abf'"):
        build_variant(ModelConfig(variant="rope", rope_scaling="abf", rope_factor=FACTOR))
    with pytest.raises(ConfigError, match="rope_type = 'abf' is not supported"):
        rope_scaling.from_hf({"rope_type": "abf", "factor": FACTOR}, max_positions=64)


def test_the_registered_example_rotates_as_transformers_at_the_adjusted_base(abf):
    assert isinstance(rope_scaling.get("abf"), abf)
    fields = rope_scaling.from_hf({"rope_type": "abf", "factor": FACTOR}, max_positions=64)
    assert fields["rope_scaling"] == "abf" and fields["rope_factor"] == FACTOR
    cfg = ModelConfig(variant="rope", d_model=64, n_heads=4, rope_base=BASE, **fields)
    rope = build_variant(cfg)  # through the factory: the type's checks and frequencies
    # transformers' unscaled rotary embedding with rope_theta = base x factor is ABF by its definition
    hf_cfg = tf.LlamaConfig(hidden_size=64, num_attention_heads=4,
                            rope_parameters={"rope_type": "default", "rope_theta": BASE * FACTOR})
    pos = torch.tensor([[0, 1, 2, 3, 517, 1023, 4095]])
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 4, 7, 16, generator=g), torch.randn(1, 4, 7, 16, generator=g)
    cos, sin = llama.LlamaRotaryEmbedding(hf_cfg)(q, pos)
    want = llama.apply_rotary_pos_emb(q, k, cos, sin)
    for got, expected in zip(rope.rotate(q, k, pos), want, strict=True):
        assert torch.allclose(got, expected, atol=1e-5, rtol=0), (got - expected).abs().max()
    unscaled = build_variant(cfg.replace(rope_scaling="none", rope_factor=1.0)).rotate(q, k, pos)[0]
    assert not torch.allclose(unscaled, want[0], atol=1e-3)  # the factor is what makes it pass
    # what the exporter asks of it: the defaults of a type whose frequencies are constants of the config
    meta = {"variant": "rope", "config": cfg.to_dict(), "sizes": {"head_dim": 16}, "state": [{"sequence_axis": 2}]}
    assert gqa.ineligible(meta) is None and rope_scaling.served_length(cfg) == cfg.context
