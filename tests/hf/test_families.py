"""The further families against transformers' eager forward, the independent reference, as the first four are
proven (test_hf_parity.py): posenc's PyTorch model and the exported graph in onnxruntime on a left-padded batch of 3
at lengths 1, 7 (the sliding-window families' window) and 200 (past it), through the KV cache past the window, and
32 greedy tokens against generate().  One tiny export per family (tests/hf/conftest.py's Zoo)."""

import dataclasses

import numpy as np
import pytest
import torch

from model.config import LayerSpec
from model.hf import import_folder
from tests.hf import float32, float64
from tests.hf.conftest import MORE
from tests.hf.helpers import REFERENCE_ATTENTION, VOCAB, WINDOW, per_layer_maps
from tests.hf.test_hf_parity import Graph, batch, real_rows

# families whose transformers forward derives positions from the mask itself (position_ids not passed)
OWN_POSITIONS = {"opt", "mpt"}


def hf_forward(family, hf, ids, mask, past=None):
    kw = {}
    if family not in OWN_POSITIONS:  # transformers counts positions from the cache (arange); posenc from the mask
        kw["position_ids"] = (mask.cumsum(-1) - 1).clamp(min=0)[:, -ids.shape[1]:]
    with torch.no_grad():
        return per_layer_maps(hf.config, hf(input_ids=ids, attention_mask=mask, use_cache=True, past_key_values=past,
                                            output_attentions=family not in REFERENCE_ATTENTION, **kw))


def compare(ref, logits, attentions, mask, new, tol_logits, tol_attn):
    """Logits and every layer's maps on the real query rows.  transformers' sliding-window cache keeps only the
    last keys of a windowed layer, so its maps there are that many columns wide: posenc's are compared on those
    columns and must be exactly 0 on the keys before them."""
    real = real_rows(mask, new)
    d_logits = (ref.logits - logits)[real].abs().max().item()
    d_attn = 0.0
    for layer, a in enumerate(ref.attentions or ()):  # none from an SDPA reference
        if a is None:  # a mixer layer: its maps are proven in test_mixers.py
            continue
        b = attentions[:, layer]
        kept = a.shape[-1]
        if kept < b.shape[-1]:
            assert torch.count_nonzero(b[..., :-kept].permute(0, 2, 1, 3)[real]) == 0
            b = b[..., -kept:]
        d_attn = max(d_attn, (a - b).permute(0, 2, 1, 3)[real].abs().max().item())
    assert d_logits <= tol_logits and d_attn <= tol_attn, (d_logits, d_attn)
    return d_logits, d_attn


@pytest.fixture(scope="module")
def torch_models(hf_zoo):
    return {}


def torch_model(hf_zoo, torch_models, family):
    """The family's saved folder imported into posenc's PyTorch model (no export needed)."""
    if family not in torch_models:
        torch_models[family] = import_folder(hf_zoo.saved_folder(family)[0])[0]
    return torch_models[family]


@pytest.mark.numerics
@pytest.mark.parametrize("family", MORE)
@pytest.mark.parametrize("length", [7, 200])
def test_pytorch_model_equals_transformers(hf_zoo, torch_models, family, length):
    """In float64 (tests/hf/float64.py): transformers runs each row alone, posenc the left-padded batch."""
    ids, mask = batch(length)
    hf64 = float64.double(hf_zoo.saved_folder(family)[1])
    refs = float64.rows_alone(lambda hf, i, m: hf_forward(family, hf, i, m), hf64, ids, mask)
    with torch.no_grad():
        out = float64.double(torch_model(hf_zoo, torch_models, family))(ids, mask)
    float64.compare(family, refs, out.logits, out.attentions, mask)


@pytest.mark.parametrize("family", MORE)
@pytest.mark.parametrize("length", [1, WINDOW, 200])
def test_onnx_graph_equals_transformers(hf_zoo, family, length):
    graph = Graph(hf_zoo[family]["artifact"])
    ids, mask = batch(length, seed=1)
    hf = hf_zoo[family]["hf"]
    ref = hf_forward(family, hf, ids, mask)
    logits, attentions, _ = graph.run(ids, mask, graph.empty(3))
    compare(ref, logits, attentions, mask, length, *float32.tolerances(hf.config, ref.logits, length))


@pytest.mark.parametrize("family", MORE)
def test_onnx_kv_cache_steps_past_the_window_equal_transformers_cache(hf_zoo, family):
    hf, graph = hf_zoo[family]["hf"], Graph(hf_zoo[family]["artifact"])
    ids, mask = batch(WINDOW + 2, seed=2)
    ref = hf_forward(family, hf, ids, mask)
    logits, attentions, past = graph.run(ids, mask, graph.empty(3))
    compare(ref, logits, attentions, mask, WINDOW + 2, *float32.tolerances(hf.config, ref.logits, WINDOW + 2))
    hf_past = ref.past_key_values
    g = torch.Generator().manual_seed(3)
    for _ in range(3):
        step = torch.randint(0, VOCAB, (3, 1), generator=g)
        mask = torch.cat([mask, torch.ones(3, 1, dtype=torch.int64)], dim=1)
        ref = hf_forward(family, hf, step, mask, past=hf_past)
        hf_past = ref.past_key_values
        logits, attentions, past = graph.run(step, mask, past)
        compare(ref, logits, attentions, mask, 1, *float32.tolerances(hf.config, ref.logits, mask.shape[1]))


@pytest.mark.parametrize("family", MORE)
def test_greedy_tokens_equal_transformers_generate(hf_zoo, family):
    hf, graph = hf_zoo[family]["hf"], Graph(hf_zoo[family]["artifact"])
    prompt = torch.randint(0, VOCAB, (1, 6), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = hf.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=32,
                           min_new_tokens=32, pad_token_id=0)[0, 6:].tolist()
    got, cur, mask, past = [], prompt.numpy(), np.ones((1, 6), np.int64), graph.empty(1)
    for _ in range(32):
        logits, _, past = graph.run(cur, mask, past)
        last = logits[0, -1].clone()
        last[hf.generation_config.eos_token_id] = float("-inf")  # as generate's min_new_tokens: no end before 32 tokens
        got.append(int(last.argmax()))
        cur, mask = np.array([[got[-1]]]), np.concatenate([mask, np.ones((1, 1), np.int64)], axis=1)
    assert got == want


@pytest.mark.parametrize("family", MORE)
def test_artifact_validates_and_records_the_family(hf_zoo, family):
    import json

    entry = hf_zoo[family]
    assert entry["report"].passed, entry["report"].format_table()
    meta = json.loads((entry["artifact"] / "model.json").read_text())
    assert meta["family"] == entry["hf"].config.model_type and meta["source"]["kind"] == "huggingface"
    config = meta["config"]  # what each tiny model is there to exercise was imported, not defaulted away
    assert {k: config[k] for k in EXERCISES[family]} == EXERCISES[family]


def record(attention: str = "full", encoding: str = "model", **kinds) -> dict:
    """A layer's record as model.json's config holds it."""
    return dataclasses.asdict(LayerSpec(attention, encoding, **kinds))


FULL, SLIDING = record(), record("sliding")
EXERCISES = {  # layers [] where every layer is alike (ModelConfig.uniform_layer)
    "qwen2": {"sliding_window": WINDOW, "layers": [FULL, SLIDING], "qkv_bias": True, "out_bias": False},
    "mistral": {"sliding_window": WINDOW, "layers": [], "d_head": 12},
    "qwen3": {"qk_norm": "rmsnorm", "d_head": 16, "qkv_bias": True},
    "gemma": {"embed_scale": 32 ** 0.5, "activation": "gelu_tanh", "tie_head": True},
    "stablelm": {"qk_norm": "layernorm_per_head", "shared_norm": True, "rope_fraction": 0.25},
    "gptj": {"rope_pairing": "interleaved", "rope_fraction": 0.5, "head_bias": True, "shared_norm": True},
    "mpt": {"variant": "alibi", "norm_bias": False, "n_heads": 12},
    "falcon": {"variant": "rope", "n_kv_heads": 2, "shared_norm": False, "parallel_residual": True},
    "falcon_alibi": {"variant": "alibi", "n_kv_heads": 1, "shared_norm": True, "alibi_scale": 8 ** -0.5},
    "phi3": {"rope_scaling": "longrope", "rope_original_context": 64, "sliding_window": WINDOW},
    "opt": {"variant": "learned", "context": 256, "activation": "relu", "post_norm": False},
    "smollm3": {"layers": [FULL, record(encoding="none")], "rope_base": 2e6, "tie_head": True, "sliding_window": 0},
    "ministral": {"sliding_window": WINDOW, "layers": [SLIDING, FULL], "qkv_bias": False},
    "gemma2": {"attn_softcap": 4.0, "final_softcap": 3.0, "attn_scale_dim": 10.0, "sandwich_norm": True,
               "layers": [SLIDING, FULL]},
    "gemma3": {"local_rope_base": 100.0, "rope_base": 1e6, "rope_scaling": "linear", "rope_factor": 4.0,
               "qk_norm": "rmsnorm", "layers": [record("sliding", "local"), FULL], "attn_softcap": 0.0},
    "cohere2": {"layers": [SLIDING, record(encoding="none")], "rope_pairing": "interleaved", "logit_scale": 0.5,
                "shared_norm": True, "norm_bias": False},
    "olmo2": {"qk_norm": "rmsnorm_all_heads", "pre_norm": False, "sandwich_norm": True, "norm": "rmsnorm"},
    "starcoder2": {"sliding_window": WINDOW, "layers": [], "mlp": "plain", "mlp_bias": True,
                   "norm": "layernorm", "n_kv_heads": 2, "activation": "gelu_tanh"},
    "phi": {"qk_norm": "layernorm", "rope_fraction": 0.5, "shared_norm": True, "head_bias": True, "qkv_bias": True},
    "codegen": {"rope_pairing": "interleaved", "rope_fraction": 0.5, "n_heads": 2, "head_bias": True,
                "shared_norm": True},
    "gpt_bigcode": {"variant": "learned", "n_kv_heads": 1, "context": 256, "attn_scale_dim": 0.0, "tie_head": True},
    "gpt_oss": {"attn_sinks": True, "n_experts": 4, "experts_top_k": 2, "mlp": "clamped_swiglu", "swiglu_alpha": 1.5,
                "swiglu_limit": 1.0, "rope_scaling": "yarn", "rope_truncate": False, "rope_original_context": 64,
                "layers": [SLIDING, FULL], "qkv_bias": True},
    "deepseek_v3": {"mla_kv_rank": 16, "mla_q_rank": 12, "rope_dims": 8, "d_head": 16, "v_head_dim": 8,
                    "rope_pairing": "interleaved", "rope_scaling": "yarn", "rope_mscale_all_dim": 0.707,
                    "router": "sigmoid", "expert_groups": 4, "expert_groups_top_k": 2,
                    "layers": [record(experts=False), FULL],
                    "shared_experts": 1, "router_scale": 2.5},
    "llama4": {"layers": [record("chunked", experts=False), record(encoding="none", qk_norm=False, temperature=True)],
               "attention_chunk": 8, "temperature_floor": 4.0, "temperature_scale": 0.5, "qk_norm": "l2",
               "rope_pairing": "interleaved", "rope_scaling": "llama3", "router": "topk_sigmoid",
               "router_scales_input": True,
               "d_mlp": 64, "d_expert": 16, "shared_experts": 1, "experts_top_k": 2},
    "lfm2": {"layers": [record(mixer="short_conv"), FULL, record(mixer="short_conv")], "conv_kernel": 3,
             "conv_bias": False, "d_mlp": 48, "qk_norm": "rmsnorm", "tie_head": True, "rope_base": 1e6},
    "granitemoehybrid": {"variant": "none", "layers": [record(mixer="mamba2"), FULL, record(mixer="mamba2")],
                         "ssm_heads": 8, "ssm_head_dim": 8, "ssm_state": 16, "ssm_groups": 2, "conv_kernel": 4,
                         "conv_bias": True, "residual_scale": 0.5, "embed_scale": 2.0, "logit_scale": 0.5,
                         "n_experts": 4, "shared_experts": 2, "d_mlp": 16},
    "nemotron_h": {"variant": "none", "mlp": "plain", "activation": "relu2", "ssm_dt_min": 0.001, "ssm_groups": 2,
                   "layers": [record(mixer="mamba2", mlp=False), record(mixer="none", experts=False),
                              record(mlp=False), record(mixer="none"), record(mixer="mamba2", mlp=False)],
                   "n_experts": 8, "experts_top_k": 2, "d_expert": 16, "shared_experts": 2, "router": "sigmoid",
                   "expert_groups": 2, "expert_groups_top_k": 1, "router_scale": 2.5},
    "falcon_h1": {"layers": [record(beside="mamba2")] * 2, "ssm_heads": 8, "ssm_head_dim": 8, "ssm_state": 16,
                  "ssm_groups": 2, "ssm_norm": "none", "embed_scale": 2.0, "logit_scale": 0.5, "rope_base": 1000.0,
                  "mlp": "gated", "norm": "rmsnorm"},
    "qwen3_next": {"layers": [record(mixer="gated_deltanet"), record(experts=False), record(mixer="gated_deltanet")],
                   "ssm_heads": 8, "ssm_groups": 4, "ssm_state": 8, "ssm_head_dim": 8, "attn_gate": True,
                   "shared_gate": True, "n_experts": 4, "shared_experts": 2, "d_expert": 16, "rope_fraction": 0.25,
                   "qk_norm": "rmsnorm"},
    "gemma4_text": {"layers": [record("sliding", "local"), FULL], "local_rope_base": 100.0, "rope_base": 1000.0,
                    "rope_scaling": "proportional", "rope_fraction": 0.5, "rope_dims": 16, "v_norm": True,
                    "qk_norm": "rmsnorm", "attn_scale_dim": 1.0, "final_softcap": 3.0, "sandwich_norm": True},
}


def window_of(hf):
    """transformers' own per-layer window: the layers its config marks sliding_attention (all, without
    layer_types, where sliding_window is set)."""
    cfg = hf.config
    size = getattr(cfg, "sliding_window", None)
    types = getattr(cfg, "layer_types", None) or ["sliding_attention" if size else "full_attention"] * \
        cfg.num_hidden_layers
    return size, [i for i, t in enumerate(types) if t == "sliding_attention" and size]


@pytest.mark.parametrize("family", ["qwen2", "mistral", "ministral", "gemma2", "cohere2",
                                    "starcoder2", "gpt_oss", "gemma4_text"])
def test_attention_outside_the_window_is_exactly_zero(hf_zoo, torch_models, family):
    """The windowed layers' maps are 0 on every key WINDOW or more positions back (and the full layers' are not),
    in the graph and in transformers, under left padding."""
    size, layers = window_of(hf_zoo[family]["hf"])
    assert size == WINDOW and layers
    graph = Graph(hf_zoo[family]["artifact"])
    ids, mask = batch(30, seed=5)
    _, attentions, _ = graph.run(ids, mask, graph.empty(3))
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    far = (pos[:, :, None] - pos[:, None, :] >= WINDOW) & mask.bool()[:, None, :] & real_rows(mask, 30)[:, :, None]
    for layer in range(attentions.shape[1]):
        a = attentions[:, layer].permute(0, 2, 3, 1)[far]  # (cells, heads)
        if layer in layers:
            assert torch.count_nonzero(a) == 0
        else:
            assert (a > 0).all()


@pytest.mark.parametrize("heads", [4, 6, 12])
@pytest.mark.parametrize("bias_max", [8, 16])
def test_alibi_slopes_follow_mpts_rule_for_any_bias_max(heads, bias_max):
    """transformers' MPT model always builds its bias with 8, so the family test cannot see alibi_bias_max; MPT's
    own slope function (transformers' copy, called with the maximum) is the reference for the rest."""
    from transformers.models.mpt.modeling_mpt import build_mpt_alibi_tensor

    from model.variants.alibi import alibi_slopes

    want = -build_mpt_alibi_tensor(heads, 2, bias_max)[:, 0, 0]  # the bias at distance 1 is -slope
    assert torch.allclose(torch.tensor(alibi_slopes(heads, bias_max)), want, rtol=1e-6, atol=0)


@pytest.mark.numerics
@pytest.mark.parametrize("length", [7, 200])
@pytest.mark.parametrize("form", ["opt_post_norm", "falcon_sequential", "gpt_bigcode_mha"])
def test_other_block_forms_equal_transformers(hf_zoo, form, length):
    """Block forms the exported tiny models do not take, in PyTorch (their graphs are the exported ones' with the
    norms moved or the rows regrouped): OPT-350m's norm after each residual add with no final norm, Falcon's old
    architecture without multi-query (q/k/v fused per head) and without the parallel block, and GPT-BigCode without
    multi-query (c_attn per head) and with its scores unscaled (scale_attn_weights false)."""
    folder, hf = hf_zoo.saved_folder(form)
    model, _ = import_folder(folder)
    assert {"opt_post_norm": model.cfg.post_norm, "falcon_sequential": not model.cfg.parallel_residual,
            "gpt_bigcode_mha": model.cfg.kv_heads == 4 and model.cfg.attn_scale_dim == 1.0}[form]
    ids, mask = batch(length, seed=6)
    refs = float64.rows_alone(lambda m, i, k: hf_forward(form.split("_")[0], m, i, k), float64.double(hf), ids, mask)
    with torch.no_grad():
        out = float64.double(model)(ids, mask)
    float64.compare(form, refs, out.logits, out.attentions, mask)  # in float64, as the families above
