"""What the further families have that posenc does not implement exactly is refused: exit 2, one line naming the
file and the field, nothing written (damaged copies of the tiny folders tests/hf/conftest.py's Zoo saves)."""

import json
import shutil

import pytest

from export.__main__ import main


def edit_config(folder, **changes):
    data = json.loads((folder / "config.json").read_text())
    data.update(changes)
    (folder / "config.json").write_text(json.dumps(data))


CASES = {
    "window not an integer": ("mistral", {"sliding_window": 0.5}, "sliding_window = 0.5 is not supported"),
    "unknown layer type": ("qwen2", {"layer_types": ["full_attention", "chunked_attention"]},
                           "layer_types = ['full_attention', 'chunked_attention'] is not supported"),
    "window layers not an index": ("qwen3", {"use_sliding_window": True, "sliding_window": 4, "layer_types": None,
                                             "max_window_layers": -1}, "max_window_layers = -1 is not supported"),
    "bidirectional gemma": ("gemma", {"use_bidirectional_attention": True},
                            "use_bidirectional_attention = True is not supported"),
    "activation posenc lacks": ("stablelm", {"hidden_act": "tanh"}, "hidden_act = 'tanh' is not supported"),
    "rotary on no dims": ("gptj", {"rotary_dim": None}, "rotary_dim = None is not supported"),
    "projected embeddings": ("opt", {"word_embed_proj_dim": 16}, "word_embed_proj_dim = 16 is not supported"),
    "norms without weights": ("opt", {"layer_norm_elementwise_affine": False},
                              "layer_norm_elementwise_affine = False is not supported"),
    "clipped qkv": ("mpt", {"attn_config": {"alibi": True, "clip_qkv": 6.0}}, "attn_config.clip_qkv = 6.0"),
    "mpt without alibi": ("mpt", {"attn_config": {"alibi": False}}, "attn_config.alibi = False"),
    "logit scale": ("mpt", {"logit_scale": 0.5}, "logit_scale = 0.5 is not supported"),
    "new falcon, sequential": ("falcon", {"parallel_attn": False}, "parallel_attn = False is not supported"),
    "old falcon, grouped": ("falcon_alibi", {"multi_query": False, "num_kv_heads": 2},
                            "num_kv_heads = 2 is not supported"),
    "rope type phi3 lacks": ("phi3", {"rope_parameters": {"rope_type": "axial", "rope_theta": 1e4}},
                             "rope_type = 'axial' is not supported"),
    "rope flags per layer miscounted": ("smollm3", {"no_rope_layers": [1]}, "no_rope_layers = [1] is not supported"),
    "sliding layers, window off": ("smollm3", {"layer_types": ["sliding_attention", "full_attention"]},
                                   "layer_types = ['sliding_attention', 'full_attention'] is not supported"),
    "chunked layers": ("ministral", {"layer_types": ["chunked_attention", "full_attention"]},
                       "layer_types = ['chunked_attention', 'full_attention'] is not supported"),
    "bidirectional gemma2": ("gemma2", {"use_bidirectional_attention": True},
                             "use_bidirectional_attention = True is not supported"),
    "sliding layers, no window": ("gemma3", {"sliding_window": None}, "sliding_window = None is not supported"),
    "scaled local rope": ("gemma3", {"rope_parameters": {
        "full_attention": {"rope_type": "default", "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}},
        "rope_parameters.sliding_attention = {'rope_type': 'linear', 'factor': 2.0, 'rope_theta': 10000.0} is not"),
    "logits scaled to nothing": ("cohere2", {"logit_scale": 0}, "logit_scale = 0 is not supported"),
    "codegen, hidden not in 4 shards": ("codegen", {"n_embd": 30}, "n_embd = 30 is not supported"),
    "codegen, rotary unset": ("codegen", {"rotary_dim": None}, "rotary_dim = None is not supported"),
    "gpt_bigcode, cross-attention": ("gpt_bigcode", {"add_cross_attention": True},
                                     "add_cross_attention = True is not supported"),
    "phi, tied head with a bias": ("phi", {"tie_word_embeddings": True}, "tie_word_embeddings = True is not supported"),
    "gpt_oss, quantized experts": ("gpt_oss", {"quantization_config": {"quant_method": "mxfp4"}},
                                   "quantization_config = 'mxfp4' is not supported"),
    "gpt_oss, more experts per token than experts": ("gpt_oss", {"num_experts_per_tok": 5},
                                                     "num_experts_per_tok = 5 is not supported"),
    "gpt_oss, no clamp": ("gpt_oss", {"swiglu_limit": 0}, "swiglu_limit = 0 is not supported"),
    "gpt_oss, sliding layers, no window": ("gpt_oss", {"sliding_window": None},
                                           "sliding_window = None is not supported"),
    "llama4, quantized": ("llama4", {"quantization_config": {"quant_method": "fbgemm_fp8"}},
                          "quantization_config = 'fbgemm_fp8' is not supported"),
    "llama4, chunked layers without a chunk": ("llama4", {"attention_chunk_size": None},
                                               "attention_chunk_size = None is not supported"),
    "llama4, sliding layers": ("llama4", {"layer_types": ["sliding_attention", "full_attention"]},
                               "layer_types = ['sliding_attention', 'full_attention'] is not supported"),
    "llama4, rope flags miscounted": ("llama4", {"no_rope_layers": [1]}, "no_rope_layers = [1] is not supported"),
    "llama4, more experts per token than experts": ("llama4", {"num_experts_per_tok": 5},
                                                    "num_experts_per_tok = 5 is not supported"),
    "llama4, experts past the last layer": ("llama4", {"moe_layers": [2]}, "moe_layers = [2] is not supported"),
    "llama4, no temperature floor": ("llama4", {"floor_scale": 0}, "floor_scale = 0 is not supported"),
    "llama4, negative temperature": ("llama4", {"attn_scale": -0.1}, "attn_scale = -0.1 is not supported"),
    "lfm2, a layer kind posenc lacks": ("lfm2", {"layer_types": ["conv", "sliding_attention", "conv"]},
                                        "layer_types = ['conv', 'sliding_attention', 'conv'] is not supported"),
    "granite, mamba heads in no groups": ("granitemoehybrid", {"mamba_n_heads": 2, "mamba_d_head": 32},
                                          "mamba_n_heads = 2 is not supported"),
    "granite, clamped time steps": ("granitemoehybrid", {"time_step_limit": [0.01, 10.0]},
                                    "time_step_limit = [0.01, 10.0] is not supported"),
    "granite, biased projections": ("granitemoehybrid", {"mamba_proj_bias": True},
                                    "mamba_proj_bias = True is not supported"),
    "falcon_h1, clamped time steps": ("falcon_h1", {"time_step_limit": [0.001, 100.0]},
                                      "time_step_limit = [0.001, 100.0] is not supported"),
    "falcon_h1, a biased Mamba-2 output": ("falcon_h1", {"projectors_bias": True},
                                           "projectors_bias = True is not supported"),
    "falcon_h1, multipliers miscounted": ("falcon_h1", {"ssm_multipliers": [1.0, 2.0]},
                                          "ssm_multipliers = [1.0, 2.0] is not supported"),
    "qwen3_next, unnormalized top-k weights": ("qwen3_next", {"norm_topk_prob": False},
                                               "norm_topk_prob = False is not supported"),
    "qwen3_next, value heads not grouped on key heads": ("qwen3_next", {"linear_num_key_heads": 3},
                                                         "linear_num_value_heads = 8 is not supported"),
    "qwen3_next, a shared expert of part of an expert": ("qwen3_next", {"shared_expert_intermediate_size": 24},
                                                         "shared_expert_intermediate_size = 24 is not supported"),
    "nemotron_h, experts behind a latent projection": ("nemotron_h", {"moe_latent_size": 8},
                                                       "moe_latent_size = 8 is not supported"),
    "nemotron_h, a shared expert of part of an expert": ("nemotron_h", {"moe_shared_expert_intermediate_size": 24},
                                                         "moe_shared_expert_intermediate_size = 24 is not supported"),
    "nemotron_h, a block kind posenc lacks": ("nemotron_h", {"layers_block_type": None,
                                                             "hybrid_override_pattern": "M-*X"},
                                              "hybrid_override_pattern = 'M-*X' is not supported"),
}


@pytest.mark.parametrize("case", CASES)
def test_refused_field_is_one_line_exit_2_and_writes_nothing(hf_zoo, tmp_path, capsys, case):
    family, changes, message = CASES[case]
    folder = tmp_path / family
    shutil.copytree(hf_zoo.saved_folder(family)[0], folder)
    edit_config(folder, **changes)
    out_parent = tmp_path / "artifacts"
    out_parent.mkdir()
    capsys.readouterr()  # saving the folder writes progress bars
    code = main(["--from-hf", str(folder), "--out", str(out_parent / "m")])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.count("\n") == 1 and err.startswith("error: ") and message in err, err
    assert str(folder / "config.json") in err
    assert list(out_parent.iterdir()) == []


@pytest.mark.parametrize("family, changes, window, layers", [
    ("qwen2", {"use_sliding_window": False, "sliding_window": 32768, "layer_types": None}, 0, []),  # Qwen2's Hub form
    ("qwen2", {"layer_types": None, "max_window_layers": 0}, 7, [0, 1]),  # every layer from 0 on
    ("qwen3", {"use_sliding_window": True, "sliding_window": 5, "layer_types": ["sliding_attention",
                                                                                 "full_attention"]}, 5, [0]),
    ("mistral", {"sliding_window": None}, 0, []),
])
def test_window_fields_are_read_as_transformers_reads_them(hf_zoo, tmp_path, family, changes, window, layers):
    """Which layers a config windows, from config.json alone: the layers transformers' config class marks
    sliding_attention from the same fields."""
    import transformers as tf

    from model.hf import read_config

    folder = tmp_path / family
    shutil.copytree(hf_zoo.saved_folder(family)[0], folder)
    edit_config(folder, **changes)
    cfg = read_config(folder)[0]
    sliding = [i for i in range(cfg.n_layers) if cfg.layer(i).attention == "sliding"]
    assert (cfg.sliding_window, sliding) == (window, layers)
    theirs = tf.AutoConfig.from_pretrained(folder)
    types = getattr(theirs, "layer_types", None) or ["sliding_attention" if theirs.sliding_window else
                                                     "full_attention"] * theirs.num_hidden_layers
    marked = [i for i, t in enumerate(types) if t == "sliding_attention" and theirs.sliding_window]
    assert marked == layers
