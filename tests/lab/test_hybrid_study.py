"""The hybrid study's designs are the models they are named after, and docs/img/hybrid.png is drawn from
bench/results/hybrid.json alone.

The layer patterns are checked against transformers' own config classes (SmolLM3 and Llama 4's no_rope_layers,
Cohere2 and Gemma 3's layer_types at four layers), not against the study's own rule; the designs must differ only in
positional fields, so the study compares positions and nothing else."""

import copy
import json

import numpy as np
import pytest
import transformers as tf
from matplotlib import image

from lab.experiments.hybrid import DESIGNS, LAYERS, PLOT, RESULTS, config, main

POSITIONAL = {"layers", "sliding_window", "local_rope_base", "rope_base"}


def plan(design):
    return config(design).layer_plan()


def test_the_designs_differ_only_in_their_positions():
    base = config("rope").to_dict()
    for design in DESIGNS:
        changed = {k for k, v in config(design).to_dict().items() if v != base[k]}
        assert changed <= POSITIONAL, (design, changed - POSITIONAL)
    assert {c.n_layers for c in map(config, DESIGNS)} == {LAYERS}


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
