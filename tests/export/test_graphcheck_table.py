"""The learned table check reads the graph's own table and compares it with model.json's max_positions."""

import json
import shutil

import onnx

from export import artifact
from export.graphcheck import table_rows
from export.validate import validate_folder


def test_table_rows_against_max_positions(tiny_artifacts):
    root, reports = tiny_artifacts
    proto = onnx.load(str(root / "learned" / "model.onnx"))
    assert table_rows(proto, "pos.table.weight", 16).passed
    wrong = table_rows(proto, "pos.table.weight", 32)
    assert not wrong.passed and "16 rows" in wrong.detail and "they differ" in wrong.detail
    assert not table_rows(proto, "pos.table.weight", None).passed
    missing = table_rows(onnx.load(str(root / "alibi" / "model.onnx")), "pos.table.weight", 16)
    assert not missing.passed and "no initializer" in missing.detail
    row = [c for c in reports["learned"].checks if c.output == "bounded table recorded"]
    assert len(row) == 1 and row[0].passed  # the export's own validation ran it
    assert not [c for c in reports["rope"].checks if c.output == "bounded table recorded"]


def test_validate_fails_an_artifact_that_promises_more_positions_than_its_table(tiny_artifacts, tmp_path):
    root, _ = tiny_artifacts
    folder = shutil.copytree(root / "learned", tmp_path / "learned")
    meta = json.loads((folder / "model.json").read_text())
    meta["max_positions"] = 32  # the worker would accept 32-token prompts; the graph's table has 16 rows
    (folder / "model.json").write_text(json.dumps(meta))
    artifact.write_manifest(folder, None)
    report = validate_folder(folder)
    failed = {c.output for c in report.checks if not c.passed}
    assert not report.passed and "bounded table recorded" in failed
