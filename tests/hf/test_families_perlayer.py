"""Each layer's attention and positions, read from config.json as transformers' config classes derive them: the
per-layer description posenc records in model.json ("layers") equals the one built here from transformers' own
config object (layer_types, no_rope_layers, rope_parameters per layer type), for the tiny Zoo folders and for the
older and derived spellings of the same fields; a model whose layers differ only in which ones rotate keeps the
compact fast graph."""

import json
import os
import shutil

import pytest

from tests.hf.test_families_refusals import edit_config

PER_LAYER = ["smollm3", "ministral", "gemma2", "gemma3", "cohere2", "gpt_oss", "llama4", "gemma4_text"]


# which layers rotate, as transformers' attention modules decide it from the config: SmolLM3Attention.use_rope is
# no_rope_layers[i], Cohere2Attention rotates only where its layer type gives it a sliding window; the rest always
ROTATES = {"smollm3": lambda c: c.no_rope_layers, "llama4_text": lambda c: c.no_rope_layers,
           "cohere2": lambda c: [int(t == "sliding_attention") for t in c.layer_types]}


# the families whose attention modules carry a learned sink per head in every layer (GptOssAttention.sinks)
SINKS = {"gpt_oss"}


def transformers_plan(theirs):
    """Each layer as transformers builds it: its type's mask (and window), whether it rotates, its type's base."""
    n = theirs.num_hidden_layers
    types = theirs.layer_types
    rotates = ROTATES.get(theirs.model_type, lambda c: [1] * n)(theirs)
    params = theirs.rope_parameters
    plan = []
    for i in range(n):
        sliding = types[i] == "sliding_attention"
        rope = params.get(types[i], params)  # Gemma 3: one entry per layer type
        extra = {"chunk": None, "temperature": None, "mixer": "attention", "beside": "none", "kernel": None}  # every
        # layer attends, with nothing beside its attention
        if types[i] == "chunked_attention":  # Llama 4: a chunked_attention mask of attention_chunk_size
            extra["chunk"] = theirs.attention_chunk_size
        if getattr(theirs, "attn_temperature_tuning", False) and not rotates[i]:  # Llama4TextAttention's NoPE rule
            extra["temperature"] = {"floor": theirs.floor_scale, "scale": theirs.attn_scale}
        plan.append({**extra, "attention": "chunked" if extra["chunk"] else "sliding" if sliding else "full",
                     "window": theirs.sliding_window if sliding else None,
                     "softcap": getattr(theirs, "attn_logit_softcapping", None),
                     "sinks": theirs.model_type in SINKS,
                     "encoding": "rope" if rotates[i] else "none",
                     "base": rope["rope_theta"] if rotates[i] else None,
                     "scaling": rope.get("rope_type", "default") if rotates[i] else None,
                     "factor": rope.get("factor", 1.0) if rotates[i] else None})
    return plan


def ours(plan):
    names = {"none": "default"}  # posenc's name for unscaled RoPE, transformers' rope_type
    return [{**{k: v for k, v in layer.items() if k != "rope"},
             "base": layer["rope"]["base"] if "rope" in layer else None,
             "scaling": names.get(layer["rope"]["scaling"], layer["rope"]["scaling"]) if "rope" in layer else None,
             "factor": layer["rope"]["factor"] if "rope" in layer else None} for layer in plan]


@pytest.mark.parametrize("family", PER_LAYER)
def test_model_json_describes_each_layer_as_transformers_builds_it(hf_zoo, family):
    meta = json.loads((hf_zoo[family]["artifact"] / "model.json").read_text())
    want = transformers_plan(hf_zoo[family]["hf"].config)
    assert ours(meta["layers"]) == want
    assert len({(layer["attention"], layer["encoding"], layer["base"]) for layer in want}) == 2  # layers differ


@pytest.mark.parametrize("family, changes", [
    ("smollm3", {"no_rope_layers": None, "no_rope_layer_interval": 1}),  # every layer NoPE
    ("smollm3", {"no_rope_layers": [0, 1], "use_sliding_window": True, "sliding_window": 5, "layer_types": None}),
    ("ministral", {"layer_types": None}),  # every layer windowed
    ("gemma2", {"layer_types": ["full_attention", "sliding_attention"]}),
    ("gemma3", {"layer_types": None, "sliding_window_pattern": 6}),  # both layers local
    ("gemma3", {"rope_parameters": None, "rope_theta": 5e5, "rope_local_base_freq": 50.0,  # the older spelling
                "rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
    ("cohere2", {"layer_types": None, "sliding_window_pattern": 4}),  # both layers sliding, both rotate
    ("cohere2", {"layer_types": ["full_attention", "full_attention"]}),  # no positional encoding anywhere
    ("gpt_oss", {"layer_types": None, "rope_parameters": None}),  # GptOssConfig's own layer types and YaRN
    ("llama4", {"no_rope_layers": None, "no_rope_layer_interval": 1, "layer_types": None}),  # every layer NoPE
    ("llama4", {"no_rope_layers": [], "no_rope_layer_interval": 2, "layer_types": None}),  # empty: derived
    ("llama4", {"attention_chunk_size": None, "layer_types": None, "attn_temperature_tuning": False}),
    ("llama4", {"layer_types": ["full_attention", "full_attention"], "attn_scale": 0.0}),
    ("gpt_oss", {"rope_parameters": None, "rope_theta": 5e4,  # the older spelling
                 "rope_scaling": {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 128,
                                  "beta_fast": 16.0, "beta_slow": 2.0, "truncate": False}}),
])
def test_derived_and_older_fields_are_read_as_transformers_reads_them(hf_zoo, tmp_path, family, changes):
    import transformers as tf

    from model.hf import read_config

    folder = tmp_path / family
    shutil.copytree(hf_zoo.saved_folder(family)[0], folder)
    edit_config(folder, **changes)
    cfg = read_config(folder)[0]
    assert ours(cfg.layer_plan()) == transformers_plan(tf.AutoConfig.from_pretrained(folder))


def test_nope_layers_keep_the_compact_fast_graph(hf_zoo, tmp_path):
    """SmolLM3's NoPE layer only skips a rotation before attention: GroupQueryAttention replaces every Attention node,
    the RoPE layer's rotations go into its GroupQueryAttention while the NoPE layer's has none to take, and the fast
    graph equals the exact one (proven against transformers in test_families.py)."""
    from export.fuse import add_to_artifact

    folder = tmp_path / "smollm3"
    folder.mkdir()
    for p in hf_zoo["smollm3"]["artifact"].iterdir():
        os.link(p, folder / p.name)
    entry = add_to_artifact(folder)
    assert entry["layout"] == "compact" and entry["fused"]["GroupQueryAttention"] == 2
    assert entry["fused"]["GroupQueryAttention do_rotary"] == 1  # layer 0 (RoPE); layer 1 is NoPE
    assert entry["parity"]["max_abs_diff"] <= 1e-4


def test_soft_capped_scores_keep_the_padded_fast_graph(hf_zoo, tmp_path):
    from export.fuse import add_to_artifact

    folder = tmp_path / "gemma2"
    folder.mkdir()
    for p in hf_zoo["gemma2"]["artifact"].iterdir():
        os.link(p, folder / p.name)
    entry = add_to_artifact(folder)
    assert entry["layout"] == "padded" and entry["parity"]["max_abs_diff"] <= 1e-4


def test_attention_sinks_keep_the_padded_fast_graph(hf_zoo, tmp_path):
    """GroupQueryAttention has no sink input: a gpt-oss model keeps the padded fast graph even with no sliding
    window (every layer full), for its sinks, and that graph equals the exact one."""
    from export.fuse import add_to_artifact
    from export.gqa import ineligible

    folder = tmp_path / "gpt_oss"
    folder.mkdir()
    for p in hf_zoo["gpt_oss"]["artifact"].iterdir():
        os.link(p, folder / p.name)
    meta = json.loads((folder / "model.json").read_text())
    meta["config"]["sliding_window"], meta["config"]["layers"] = 0, []
    assert "attention sinks" in ineligible(meta)
    entry = add_to_artifact(folder)
    assert entry["layout"] == "padded" and entry["parity"]["max_abs_diff"] <= 1e-4
