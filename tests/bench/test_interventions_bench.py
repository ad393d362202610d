"""python -m bench interventions runs end to end on a tiny LLaMA (two exports, two workers, a couple of calls per
row) and writes a well-formed results file; the two exports differ by the intervention graph alone.  No timing is
asserted."""

import json

import pytest

from bench.interventions import GENERATE, PREDICT, SCORE, main

pytestmark = pytest.mark.slow  # a model saved, exported twice and served by two workers


def test_the_command_measures_both_exports_and_every_intervention(tmp_path):
    out = tmp_path / "results"
    argv = ["--work", str(tmp_path / "work"), "--width", "128", "--layers", "1", "--short", "4", "--long", "8",
            "--new-tokens", "2", "--repeat", "2", "--block", "1", "--generate-repeat", "1", "--generate-block", "1",
            "--out", str(out)]
    assert main(argv) == 0
    data = json.loads((out / "interventions.json").read_text())
    assert {"date", "machine", "load", "command"} <= set(data["meta"]) and len(data["meta"]["load"]) == 3
    assert data["meta"]["command"].startswith("python -m bench interventions --work")
    tables = data["tables"]
    assert set(tables) == {"plain", "cost", "generate"}
    assert all(len(row) == len(t["columns"]) for t in tables.values() for row in t["rows"])
    # the off export has no intervention graph, and every graph it has is the same file in the on export
    model = data["model"]
    assert model["plain_graphs_equal"] is True and "model.onnx" in model["plain_graphs"]
    assert not any(g.startswith("intervene") for g in model["plain_graphs"])
    assert [r[0] for r in tables["plain"]["rows"]] == ["Predict, 4-token prompt (ms)", "Predict, 8-token prompt (ms)",
                                                       "Generate, one stream, 2 tokens (tokens/s)"]
    assert all(float(r[5]) > 0 for r in tables["plain"]["rows"])
    # every intervention on both prompts, each beside its plain call (whose ratio to itself is 1)
    cost = tables["cost"]["rows"]
    want = [("Predict", label, n) for n in (4, 8) for label in ["plain"] + [lab for lab, _ in PREDICT]]
    want += [("Score", label, n) for n in (4, 8) for label in ["plain"] + [lab for lab, _ in SCORE]]
    assert [tuple(r[:3]) for r in cost] == want
    assert all(r[5] == "1.00x" for r in cost if r[1] == "plain")
    assert [r[0] for r in tables["generate"]["rows"]] == ["plain"] + [lab for lab, _ in GENERATE]
    assert all(float(r[1]) > 0 for r in tables["generate"]["rows"])
    md = (out / "interventions.md").read_text()
    assert "shift 1000, baseline" in md and md.rstrip().endswith("(bench/results/interventions.json).")


def test_a_width_the_heads_cannot_split_is_refused_before_anything_is_made(tmp_path, capsys):
    with pytest.raises(SystemExit) as done:
        main(["--work", str(tmp_path), "--width", "100"])
    assert done.value.code == 2 and "--width" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())
