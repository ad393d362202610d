"""Interventions on imported families against transformers, the independent reference: explicit positions (a
left-padded batch whose rows sit at different positions, then cached steps) against transformers' forward with the
same position_ids; a head ablated against a forward pre-hook on transformers' output projection zeroing that head's
slice; a layer's RoPE switched off against transformers' attention given the identity rotation (cos 1, sin 0); and
another RoPE scaling per request against transformers' model built with that scaling, for every scaling type.
posenc's side is the worker's intervention graph in onnxruntime (service/intervention.py)."""

import inspect

import numpy as np
import pytest
import torch
import transformers

from service.artifacts import load_artifact
from service.intervention import Intervention, Row, resolve, run
from service.rope_request import parse as rope_parse
from tests.hf import float32
from tests.hf.conftest import FAMILIES, MORE
from tests.hf.helpers import VOCAB, hf_config, per_layer_maps
from tests.hf.test_families import compare  # windowed layers' maps: transformers keeps the last keys only

# transformers builds these families' ALiBi from the attention mask and takes no positions (BLOOM, MPT) or ignores
# the ones it is given (Falcon with alibi, Granite 4.0-H and Nemotron-H without RoPE); every other family's model reads
# position_ids
MASK_POSITIONS = {"bloom", "mpt", "falcon_alibi", "granitemoehybrid", "nemotron_h"}
TAKES_POSITIONS = [f for f in FAMILIES + MORE if f not in MASK_POSITIONS]
ROPE_FAMILIES = ["llama", "qwen2", "gpt_neox", "falcon_h1", "qwen3_next"]  # the last two: layer 1 is an attention
# layer beside a Mamba-2 layer (whose order stays), and a gated attention layer with partial RoPE between delta layers


def zoo_entry(hf_families, hf_zoo, family):
    return hf_families[family] if family in FAMILIES else hf_zoo[family]


def test_the_families_said_to_take_positions_are_those_whose_model_reads_them():
    """The list above is transformers' own: the families whose tiny model's logits change when it is given other
    position_ids (a class may take the parameter and ignore it: Falcon's alibi variant, Granite 4.0-H and Nemotron-H
    without RoPE)."""
    reads = set()
    ids = torch.randint(0, VOCAB, (1, 9), generator=torch.Generator().manual_seed(0))
    for family in FAMILIES + MORE:
        config = hf_config(family)
        cls = transformers.AutoModelForCausalLM._model_mapping[type(config)]
        if "position_ids" not in inspect.signature(cls.forward).parameters:
            continue
        torch.manual_seed(0)
        hf = transformers.AutoModelForCausalLM.from_config(config).eval()
        with torch.no_grad():
            plain = hf(input_ids=ids, position_ids=torch.arange(9)[None]).logits
            moved = hf(input_ids=ids, position_ids=torch.arange(9)[None] * 3 + 5).logits
        if not torch.allclose(plain, moved, atol=1e-6):
            reads.add(family)
    assert reads == set(TAKES_POSITIONS)


def layout(prompts, positions):
    """Left-padded ids, mask and position_ids (pads at position 0) for transformers."""
    T = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), T, dtype=torch.int64)
    mask = torch.zeros(len(prompts), T, dtype=torch.int64)
    pos = torch.zeros(len(prompts), T, dtype=torch.int64)
    for b, (p, q) in enumerate(zip(prompts, positions, strict=True)):
        ids[b, T - len(p):], mask[b, T - len(p):], pos[b, T - len(p):] = torch.tensor(p), 1, torch.tensor(q)
    return ids, mask, pos


def hf_run(hf, ids, mask, pos, past=None):
    with torch.no_grad():
        return per_layer_maps(hf.config, hf(input_ids=ids, attention_mask=mask, position_ids=pos,
                                            past_key_values=past, use_cache=True, output_attentions=True))


def rows_for(model, prompts, positions, **edit):
    return [resolve(model, Intervention(positions=tuple(q), **edit), p, None) for p, q in zip(prompts, positions,
                                                                                                strict=True)]


def graph_out(model, rows, **kw):
    out = run(model, rows, maps=True, **kw)
    return torch.from_numpy(out["logits"]), torch.from_numpy(out["attentions"]), out


def windowed(model) -> bool:
    cfg = model.meta.config
    return bool(cfg.get("sliding_window") or cfg.get("attention_chunk"))


@pytest.mark.parametrize("family", TAKES_POSITIONS)
def test_explicit_positions_and_cached_steps_equal_transformers(hf_families, hf_zoo, family):
    """Three rows of 9, 5 and 1 tokens at different positions, then two cached steps (the second jumping ahead).
    A family with a sliding window or chunks hides keys by slot in transformers and by position in posenc: its rows
    are shifted uniformly and its steps follow on (every distance kept), the others' spaced unevenly.  Under a
    length-dependent scaling (Phi-3's LongRoPE) transformers takes one length for the whole batch where posenc
    takes each row's own (a row's answer is its answer alone): each row is held to transformers given it alone."""
    entry = zoo_entry(hf_families, hf_zoo, family)
    hf, model = entry["hf"], load_artifact(entry["artifact"], threads=1)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (9, 5, 1)]
    if windowed(model):
        positions = [list(range(s, s + len(p))) for s, p in zip((3, 40, 120), prompts, strict=True)]
    else:
        positions = [[2 * i + 3 for i in range(9)], [40, 41, 45, 46, 60], [120]]
    steps = [torch.randint(0, VOCAB, (3, 1), generator=g) for _ in range(2)]
    jumps = (1, 1) if windowed(model) else (1, 7)
    groups = [[0], [1], [2]] if model.whole_prompts else [[0, 1, 2]]
    rows = rows_for(model, prompts, positions)
    ids, mask, pos = layout(prompts, positions)
    logits, attentions, out = graph_out(model, rows)
    outputs = [(logits, attentions)]
    past, slots, step_mask = [out[s.output] for s in model.meta.state], pos.numpy(), mask
    for tok, jump in zip(steps, jumps, strict=True):
        nxt = slots.max(axis=1, keepdims=True) + jump
        slots = np.concatenate([slots, nxt], axis=1)
        logits, attentions, out = graph_out(model, rows, new=list(tok.numpy()), past=past, past_positions=list(slots),
                                            past_mask=step_mask.numpy())
        step_mask = torch.cat([step_mask, torch.ones(3, 1, dtype=torch.int64)], dim=1)
        outputs.append((logits, attentions))
        past = [out[s.output] for s in model.meta.state]
    for group in groups:
        n = max(len(prompts[b]) for b in group)
        hf_ids, hf_mask, hf_pos = (t[group, -n:] for t in (ids, mask, pos))
        ref = hf_run(hf, hf_ids, hf_mask, hf_pos)
        width = ids.shape[1]
        got_logits, got_maps = outputs[0]
        compare(ref, got_logits[group][:, -n:], got_maps[group][..., -n:, -n:], hf_mask, n,
                *float32.tolerances(hf.config, ref.logits, n))
        hf_past, slot_pos = ref.past_key_values, hf_pos
        for i, (tok, (got_logits, got_maps)) in enumerate(zip(steps, outputs[1:], strict=True)):
            slot_pos = torch.cat([slot_pos, torch.from_numpy(slots[group, width + i:width + i + 1])], dim=1)
            hf_mask = torch.cat([hf_mask, torch.ones(len(group), 1, dtype=torch.int64)], dim=1)
            ref = hf_run(hf, tok[group], hf_mask, slot_pos[:, -1:], past=hf_past)
            compare(ref, got_logits[group], got_maps[group][..., -hf_mask.shape[1]:], hf_mask, 1,
                    *float32.tolerances(hf.config, ref.logits, hf_mask.shape[1]))
            hf_past = ref.past_key_values


def hooked_and_plain(hf, model, prompt, hook, **edit):
    """transformers' forward with the hook `hook()` registers (removed after it) and without, on one unpadded prompt;
    posenc's intervention graph under `edit` is compared with the hooked one.  Returns (hooked, plain)."""
    ids, mask, pos = layout([prompt], [list(range(len(prompt)))])
    handle = hook()
    try:
        ref = hf_run(hf, ids, mask, pos)
    finally:
        handle.remove()
    logits, attentions, _ = graph_out(model, rows_for(model, [prompt], [list(range(len(prompt)))], **edit))
    compare(ref, logits, attentions, mask, len(prompt), *float32.tolerances(hf.config, ref.logits, len(prompt)))
    return ref, hf_run(hf, ids, mask, pos)


def out_projection(hf, family, layer):
    """transformers' module whose input is the concatenated heads' outputs, in layer `layer`."""
    if family == "gpt_neox":
        return hf.gpt_neox.layers[layer].attention.dense
    if family == "gpt2":
        return hf.transformer.h[layer].attn.c_proj
    return hf.model.layers[layer].self_attn.o_proj


@pytest.mark.parametrize("family", ["llama", "gpt2", "gpt_neox", "qwen2"])
def test_an_ablated_head_equals_transformers_with_that_heads_slice_zeroed(hf_families, hf_zoo, family):
    entry = zoo_entry(hf_families, hf_zoo, family)
    hf, model = entry["hf"], load_artifact(entry["artifact"], threads=1)
    layer, head, dh = 0, 2, model.head_dim

    def zero(module, args):
        x = args[0].clone()
        x[..., head * dh:(head + 1) * dh] = 0
        return (x, *args[1:])

    prompt = list(range(3, 15))
    ref, plain = hooked_and_plain(hf, model, prompt, lambda: out_projection(hf, family, layer)
                                  .register_forward_pre_hook(zero), ablate_heads=((layer, head),))
    assert (ref.logits - plain.logits).abs().max() > 1e-3  # the ablation changed transformers' answer


@pytest.mark.parametrize("family", ROPE_FAMILIES)
def test_a_layer_without_its_rope_equals_transformers_given_the_identity_rotation(hf_families, hf_zoo, family):
    entry = zoo_entry(hf_families, hf_zoo, family)
    hf, model = entry["hf"], load_artifact(entry["artifact"], threads=1)
    layer = 1
    attn = hf.gpt_neox.layers[layer].attention if family == "gpt_neox" else hf.model.layers[layer].self_attn

    def identity(module, args, kwargs):
        cos, sin = kwargs["position_embeddings"]
        return args, {**kwargs, "position_embeddings": (torch.ones_like(cos), torch.zeros_like(sin))}

    prompt = list(range(20, 33))
    ref, plain = hooked_and_plain(hf, model, prompt, lambda: attn.register_forward_pre_hook(identity, with_kwargs=True),
                                  positional_off=(layer,))
    assert (ref.attentions[layer] - plain.attentions[layer]).abs().max() > 1e-3


SCALINGS = [
    {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "dynamic", "factor": 2.0},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
    {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 16, "beta_fast": 16, "mscale": 1.0,
     "mscale_all_dim": 0.5},
    {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 16, "low_freq_factor": 1.0,
     "high_freq_factor": 4.0},
    {"rope_type": "longrope", "factor": 4.0, "original_max_position_embeddings": 16,
     "short_factor": [1.0 + 0.1 * i for i in range(24)], "long_factor": [1.5 + 0.2 * i for i in range(24)]},
    {"rope_type": "default", "rope_theta": 50000.0},
]


@pytest.mark.parametrize("scaling", SCALINGS, ids=lambda s: s["rope_type"] + str(s.get("factor", "")))
def test_a_requests_rope_scaling_equals_transformers_built_with_it(hf_families, scaling):
    """The llama family (head 48: 24 pairs), served unscaled, asked for each scaling at 40 tokens (past the 16 the
    scalings take as original, so dynamic and longrope are on their long branch), against transformers' LLaMA with
    the same weights and that scaling in its config."""
    entry = hf_families["llama"]
    hf, model = entry["hf"], load_artifact(entry["artifact"], threads=1)
    config = hf_config("llama")
    params = dict(scaling)
    theta = params.pop("rope_theta", config.rope_parameters["rope_theta"])
    config.rope_parameters = {"rope_theta": theta, **params}
    if scaling["rope_type"] == "dynamic":  # transformers' dynamic reads max_position_embeddings as its L0
        config.max_position_embeddings = 16
    scaled = transformers.LlamaForCausalLM(config).eval()
    scaled.load_state_dict(hf.state_dict())
    prompt = torch.randint(0, VOCAB, (40,), generator=torch.Generator().manual_seed(9)).tolist()
    ids, mask, pos = layout([prompt], [list(range(40))])
    ref = hf_run(scaled, ids, mask, pos)
    request = dict(scaling)
    if scaling["rope_type"] == "dynamic":
        request["original_max_position_embeddings"] = 16
    row = resolve(model, Intervention(rope_scaling=rope_parse(request)), prompt, None)
    logits, attentions, _ = graph_out(model, [row])
    compare(ref, logits, attentions, mask, 40, *float32.tolerances(config, ref.logits, 40))
    plain = hf_run(hf, ids, mask, pos)
    assert (ref.logits - plain.logits).abs().max() > 1e-3  # the scaling changed transformers' answer


def test_rows_with_different_interventions_equal_each_row_alone(hf_families):
    model = load_artifact(hf_families["llama"]["artifact"], threads=1)
    prompts = [list(range(5, 17)), list(range(40, 47)), list(range(60, 70))]
    edits = [Intervention(shift=100, positional_off=(0,)), Intervention(ablate_heads=((1, 3),)),
             Intervention(rope_scaling=rope_parse({"rope_type": "yarn", "factor": 4.0}), stretch=2.0)]
    rows: list[Row] = [resolve(model, e, p, None) for e, p in zip(edits, prompts, strict=True)]
    together = run(model, rows, maps=True)
    for b, row in enumerate(rows):
        alone = run(model, [row], maps=True)
        n = len(row.ids)
        np.testing.assert_allclose(together["logits"][b, -n:], alone["logits"][0], atol=1e-5)
        np.testing.assert_allclose(together["attentions"][b, :, :, -n:, -n:], alone["attentions"][0], atol=1e-6)
