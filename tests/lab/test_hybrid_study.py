"""The hybrid study's designs are the models they are named after, and docs/img/hybrid.png is drawn from
bench/results/hybrid.json alone.

The layer patterns are checked against transformers' own config classes (SmolLM3 and Llama 4's no_rope_layers,
Cohere2, Gemma 3, Granite 4.0-H and Qwen3-Next's layer_types at four layers), not against the study's own rule; the
designs must differ only in where their order comes from (positional fields, or a recurrent layer's), so the study
compares that and nothing else."""

import copy
import dataclasses
import json

import numpy as np
import pytest
import transformers as tf
from matplotlib import image
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

from lab.experiments.hybrid import DESIGNS, LAYERS, PLOT, RESULTS, config, main, parameters, tables
from model.transformer import Transformer

POSITIONAL = {"variant", "layers", "sliding_window", "local_rope_base", "rope_base"}
# A Mamba-2 or Gated DeltaNet layer has no positional encoding: its order comes from its recurrence and its
# convolution, so the mixer's
# fields are where that design's order comes from and count beside the positional ones; any other field differing
# (a width, a norm, the MLP, the heads) fails the comparison
MIXER = {"conv_kernel", "conv_bias", "ssm_heads", "ssm_head_dim", "ssm_state", "ssm_groups"}
# in a layer's record: its attention's reach, its encoding, and what mixes its tokens (attention or a recurrent layer)
LAYER_ORDER = {"attention", "encoding", "mixer"}


def plan(design):
    return config(design).layer_plan()


def outside_order(cfg, rope):
    """What differs between cfg and the rope design beyond where their order comes from: model fields, mixer sizes
    set without a mixer layer, and each layer record's other fields (qk_norm, experts, temperature, ...)."""
    base = rope.to_dict()
    changed = {k for k, v in cfg.to_dict().items() if v != base[k]}
    out = changed - POSITIONAL - MIXER
    if changed & MIXER and all(cfg.attends(i) for i in range(cfg.n_layers)):
        out |= changed & MIXER  # the mixer's sizes are those of its Mamba-2 layers: only where there are some
    for i in range(cfg.n_layers):
        mine, theirs = dataclasses.asdict(cfg.layer(i)), dataclasses.asdict(rope.layer(i))
        out |= {f"layers[{i}].{k}" for k in mine if mine[k] != theirs[k] and k not in LAYER_ORDER}
    return out


def test_the_designs_differ_only_in_where_their_order_comes_from():
    for design in DESIGNS:
        assert not outside_order(config(design), config("rope")), design
    assert {c.n_layers for c in map(config, DESIGNS)} == {LAYERS}
    # the comparison covers the designs with recurrent layers, each of one kind
    mixers = {d: {e["mixer"] for e in plan(d)} - {"attention"} for d in DESIGNS}
    assert {d: m for d, m in mixers.items() if m} == {"mamba2+nope4": {"mamba2"}, "deltanet+nope4": {"gated_deltanet"}}


def test_every_design_has_its_row_in_each_table():
    doc = json.loads(RESULTS.read_text())
    assert set(doc["designs"]) == set(DESIGNS)
    for table in tables(doc).values():
        assert [row[0] for row in table["rows"]] == list(DESIGNS)


@pytest.mark.parametrize("design", ["mamba2+nope4", "deltanet+nope4"])
@pytest.mark.parametrize("change", [{"d_mlp": 512}, {"n_kv_heads": 4}, {"mlp": "plain"}, {"d_model": 96}])
def test_a_difference_outside_the_order_is_caught(change, design):
    assert outside_order(config(design).from_dict({**config(design).to_dict(), **change}),
                         config("rope")) == set(change)


def test_a_layer_record_or_mixer_size_outside_the_order_is_caught():
    rope = config("rope")
    mamba = config("mamba2+nope4").to_dict()
    # q/k norm on (qk_norm) with the last layer's record opting out: the model field and that record differ
    normed = rope.from_dict({**mamba, "qk_norm": "rmsnorm",
                             "layers": [{"mixer": "mamba2"}] * 3 + [{"encoding": "none", "qk_norm": False}]})
    assert outside_order(normed, rope) == {"qk_norm", f"layers[{LAYERS - 1}].qk_norm"}
    assert not outside_order(rope.from_dict({**mamba, "ssm_state": 32}), rope)  # the Mamba-2 layers' own size
    assert outside_order(rope.from_dict({**rope.to_dict(), "ssm_state": 32}), rope) == {"ssm_state"}  # no layer


def test_nope_every_4th_layer_is_smollm3s_and_llama4s_pattern():
    for cfg in (tf.SmolLM3Config(num_hidden_layers=LAYERS), tf.Llama4TextConfig(num_hidden_layers=LAYERS)):
        nope = [i for i, uses_rope in enumerate(cfg.no_rope_layers) if not uses_rope]
        assert nope, "the reference must have a NoPE layer at this depth"
        assert [i for i, e in enumerate(plan("rope+nope4")) if e["encoding"] == "none"] == nope
    assert all(e["encoding"] == "none" for e in plan("nope"))
    assert all(e["encoding"] == "rope" and e["attention"] == "full" for e in plan("rope"))


def test_local_and_global_layers_follow_cohere2_and_gemma3():
    cohere = tf.Cohere2Config(num_hidden_layers=LAYERS).layer_types
    gemma = tf.Gemma3TextConfig(num_hidden_layers=LAYERS, sliding_window_pattern=LAYERS).layer_types
    for design, reference in (("local+nope", cohere), ("local+global", gemma)):
        kinds = ["sliding_attention" if e["attention"] == "sliding" else "full_attention" for e in plan(design)]
        assert kinds == reference, design
    # Cohere2: the global layers have no positional encoding, the windowed ones RoPE
    assert [e["encoding"] for e in plan("local+nope")] == ["none" if t == "full_attention" else "rope" for t in cohere]
    # Gemma 3: windowed layers at rope_local_base_freq 10k, global ones at rope_theta 1M (its defaults)
    g = tf.Gemma3TextConfig()
    local = g.rope_parameters["sliding_attention"]["rope_theta"]
    globl = g.rope_parameters["full_attention"]["rope_theta"]
    assert [e["rope"]["base"] for e in plan("local+global")] == [
        globl if t == "full_attention" else local for t in gemma]


def granite(**sizes):
    """transformers' Granite 4.0-H at this study's size: four blocks named as its checkpoints name them (a 'mamba'
    block, which the class reads as 'linear_attention', and an 'attention' block every 4th), dense (no experts),
    with its default position_embedding_type."""
    return tf.GraniteMoeHybridConfig(
        num_hidden_layers=LAYERS, layer_types=["mamba", "mamba", "mamba", "attention"], vocab_size=256,
        hidden_size=128, intermediate_size=384, shared_intermediate_size=384, num_local_experts=0,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True, **sizes)


def test_mamba2_with_nope_every_4th_has_granite_4_hs_layer_kinds():
    cfg = config("mamba2+nope4")
    kinds = ["linear_attention" if e["mixer"] == "mamba2" else "full_attention" for e in cfg.layer_plan()]
    assert kinds == granite().layer_types
    assert "linear_attention" in kinds and "full_attention" in kinds
    # Granite's attention has no positional encoding: position_embedding_type null, so its model builds no rotary
    # embedding; the design's attention layer is NoPE, and no layer of it rotates anything
    reference = tf.GraniteMoeHybridModel(granite(
        mamba_n_heads=cfg.ssm_heads, mamba_d_head=cfg.ssm_head_dim, mamba_d_state=cfg.ssm_state,
        mamba_n_groups=cfg.ssm_groups, mamba_d_conv=cfg.conv_kernel, mamba_conv_bias=cfg.conv_bias,
        mamba_expand=cfg.ssm_heads * cfg.ssm_head_dim // cfg.d_model))
    assert reference.config.position_embedding_type is None and reference.rotary_emb is None
    assert [e["encoding"] for e in cfg.layer_plan()] == [
        "recurrence" if t == "linear_attention" else "none" for t in reference.config.layer_types]
    assert all("rope" not in e for e in cfg.layer_plan())
    # Granite's blocks built at the design's sizes hold as many parameters as the design's mixers (the sizes mean
    # the same thing in both), and parameters() counts them on the model
    ours = Transformer(cfg)
    for block, layer, count in zip(ours.blocks, reference.layers, parameters("mamba2+nope4")["mixers"], strict=True):
        theirs = layer.mamba if layer.mamba is not None else layer.self_attn
        assert sum(p.numel() for p in block.attn.parameters()) == sum(p.numel() for p in theirs.parameters()) == count


def test_deltanet_with_nope_every_4th_has_qwen3_nexts_layer_pattern():
    cfg = config("deltanet+nope4")
    reference = tf.Qwen3NextConfig(
        num_hidden_layers=LAYERS, hidden_size=cfg.d_model, linear_num_value_heads=cfg.ssm_heads,
        linear_value_head_dim=cfg.ssm_head_dim, linear_key_head_dim=cfg.ssm_state, linear_num_key_heads=cfg.ssm_groups,
        linear_conv_kernel_dim=cfg.conv_kernel)
    kinds = ["linear_attention" if e["mixer"] == "gated_deltanet" else "full_attention" for e in cfg.layer_plan()]
    assert kinds == reference.layer_types  # full_attention_interval 4: the 4th layer attends
    assert "linear_attention" in kinds and "full_attention" in kinds
    # Qwen3-Next rotates a quarter of its attention's dimensions; the design's attention is NoPE as mamba2+nope4's is,
    # so the two recurrent designs differ in their recurrent layers alone
    assert reference.rope_parameters["partial_rotary_factor"] < 1
    assert [e["encoding"] for e in cfg.layer_plan()] == ["recurrence"] * (LAYERS - 1) + ["none"]
    assert all("rope" not in e for e in cfg.layer_plan())
    assert config("mamba2+nope4").layer_plan()[-1] == cfg.layer_plan()[-1]
    assert cfg.ssm_heads % cfg.n_heads == 0  # the maps average value heads into n_heads equal groups
    # transformers' Gated DeltaNet layer built at the design's sizes holds as many parameters as the design's (its conv
    # unbiased, as Qwen3-Next's), and parameters() counts them on the model
    theirs = sum(p.numel() for p in Qwen3NextGatedDeltaNet(reference, layer_idx=0).parameters())
    counts = parameters("deltanet+nope4")["mixers"]
    assert counts[:-1] == [theirs] * (LAYERS - 1) and counts[-1] == parameters("rope")["mixers"][-1]
    for block, entry in zip(Transformer(cfg).blocks, cfg.layer_plan(), strict=True):
        assert (type(block.attn).__name__ == "GatedDeltaNet") == (entry["mixer"] == "gated_deltanet")


def draw(doc, folder):
    src, out = folder / "hybrid.json", folder / "hybrid.png"
    src.write_text(json.dumps(doc))
    assert main(["--plot-only", "--out", str(src), "--plot", str(out)]) == 0
    return image.imread(out)


def test_the_committed_picture_is_drawn_from_the_committed_results(tmp_path):
    committed = image.imread(PLOT)
    drawn = draw(json.loads(RESULTS.read_text()), tmp_path)
    assert drawn.shape == committed.shape
    assert np.array_equal(drawn, committed), f"{int((drawn != committed).any(-1).sum())} pixels differ"


def test_a_changed_result_changes_the_picture(tmp_path):
    doc = json.loads(RESULTS.read_text())
    changed = copy.deepcopy(doc)
    changed["study"]["rows"]["nope"]["cells"]["16"]["perplexity_per_byte"] *= 1.5
    assert not np.array_equal(draw(changed, tmp_path), image.imread(PLOT))
    changed = copy.deepcopy(doc)
    changed["profiles"]["rope+nope4"]["layers"][3]["mass_past_context"] += 0.2
    assert not np.array_equal(draw(changed, tmp_path), image.imread(PLOT))
    doc["meta"]["date"] = "2000-01-01T00:00:00+00:00"  # what the picture does not show leaves it as it is
    assert np.array_equal(draw(doc, tmp_path), image.imread(PLOT))


@pytest.mark.parametrize("argv", [["--steps", "0"], ["--text-bytes", "100"]])
def test_bad_arguments_are_one_line_and_exit_2(argv, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "error" in err
