"""tests/margins.py, the plugin `make margins` runs the suite with: a real pytest run of a small test file records
the share of its tolerance each passing float comparison used, and the report lists those at 90% and above."""

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.margins import comparisons, main, report

ROOT = Path(__file__).resolve().parents[1]

CHECKS = '''
import numpy as np
import torch

def test_bare_asserts():
    d_logits, agree = 0.95e-5, 0.9975
    assert d_logits <= 1e-5 and len("ab") < 3   # 95% of its tolerance; the count is no tolerance
    assert agree >= 0.97                        # a lower bound on a share: (1 - 0.9975) / (1 - 0.97) of its room

def test_closeness_checks():
    np.testing.assert_allclose(np.array([1.0, 2.0]), np.array([1.0, 2.0 + 1e-9]), rtol=0, atol=4e-9)
    assert torch.allclose(torch.tensor([0.5]), torch.tensor([0.5 + 2**-20]), rtol=0, atol=2**-19)
    assert torch.allclose(torch.tensor(1.0), torch.tensor(1.0)) and np.allclose(1.0, 1.0)  # scalars: nothing used
'''


def test_a_recorded_run_reports_each_comparisons_share_of_its_tolerance(tmp_path, capsys):
    (tmp_path / "test_checks.py").write_text(CHECKS)
    out = tmp_path / "margins.jsonl"
    env = {**os.environ, "POSENC_MARGINS": str(out), "PYTHONPATH": str(ROOT), "PYTHONDONTWRITEBYTECODE": "1"}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "tests.margins", "-p", "no:cacheprovider",
                          "-o", "enable_assertion_pass_hook=true", "test_checks.py"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    rows = {(r["where"], r["kind"]): r for r in map(json.loads, out.read_text().splitlines())}
    assert set(rows) == {("test_checks.py:7", "assert <="), ("test_checks.py:8", "assert >="),
                         ("test_checks.py:11", "numpy.testing.assert_allclose"),
                         ("test_checks.py:12", "torch.allclose"), ("test_checks.py:13", "torch.allclose"),
                         ("test_checks.py:13", "numpy.allclose")}
    assert rows["test_checks.py:13", "torch.allclose"]["used"] == 0
    assert rows["test_checks.py:13", "numpy.allclose"]["used"] == 0
    assert abs(rows["test_checks.py:7", "assert <="]["used"] - 0.95) < 1e-12
    assert abs(rows["test_checks.py:8", "assert >="]["used"] - 0.0025 / 0.03) < 1e-9
    assert abs(rows["test_checks.py:11", "numpy.testing.assert_allclose"]["used"] - 0.25) < 1e-6  # 1e-9 of 4e-9
    assert rows["test_checks.py:12", "torch.allclose"]["used"] == 0.5  # 2^-20 of 2^-19, exact in float32
    assert [r["where"] for r in report(str(out))] == ["test_checks.py:7"]
    assert main([str(out)]) == 0 and "1 comparison sites use >= 90%" in capsys.readouterr().out


def test_only_float_bounds_count_as_tolerances():
    assert comparisons("3 <= 5") == []  # a count
    assert comparisons("(1.0e-05 <= 2e-05 and 0.5 < 1.0)") == [(1e-05, "<=", 2e-05, 0.5), (0.5, "<", 1.0, 0.5)]
    assert comparisons("-0.5 <= 1e-3") == []  # a signed figure: no share of a tolerance
    assert comparisons("x1.0 <= 2.0") == []  # part of a name, not a number


def test_a_missing_file_is_one_line_and_exit_2(tmp_path, capsys):
    assert main([str(tmp_path / "absent.jsonl")]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1
