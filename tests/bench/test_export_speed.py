"""python -m bench export-speed runs end to end on one tiny model and writes a well-formed results file; the graph
exported under torch's own settings (its fake-tensor dispatch cache on, its type-promotion pass) is the same file as
the ones exported with the cache off and with export.promotion's pass (the settings export.dynamo keeps): the rope
model's rotary angles divide by Python ints, so the promotion pass inserts casts there.  No timing is asserted."""

import json

import pytest

from bench.export_speed import main


def test_both_settings_write_the_same_graph_and_the_figures_are_recorded(tmp_path):
    out = tmp_path / "results"
    assert main(["--rounds", "1", "--models", "rope", "--out", str(out)]) == 0
    data = json.loads((out / "export_speed.json").read_text())
    assert {"date", "machine", "load", "command"} <= set(data["meta"])
    [row] = data["rows"]
    assert row["model"] == "rope" and row["same_graph"] is True
    assert row["torch_cpu_s"] > 0 and row["cache_off_cpu_s"] > 0 and row["posenc_cpu_s"] > 0
    rows = data["tables"]["cost"]["rows"]
    assert [r[0] for r in rows] == ["rope", "all"] and rows[-1][-1] is True
    assert (out / "export_speed.md").read_text().rstrip().endswith("(bench/results/export_speed.json).")


@pytest.mark.parametrize("argv, words", [(["--models", "rope,nope"], "unknown models"),
                                         (["--rounds", "0"], "--rounds")])
def test_a_bad_argument_is_refused_before_anything_is_exported(tmp_path, capsys, argv, words):
    with pytest.raises(SystemExit) as done:
        main([*argv, "--out", str(tmp_path)])
    assert done.value.code == 2 and words in capsys.readouterr().err
    assert not any(tmp_path.iterdir())
