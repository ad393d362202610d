"""make test's second pass holds PyTorch to AVX2 (the Makefile's NARROW_ISA): the settings it uses must take effect,
or that pass would repeat the first on an AVX-512 machine and show nothing of what an AVX2-only machine computes."""

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def narrow_env() -> dict[str, str]:
    """The variables of the Makefile's NARROW_ISA line."""
    line = re.search(r"^NARROW_ISA := (.+)$", (ROOT / "Makefile").read_text(), re.M)
    assert line, "the Makefile has no NARROW_ISA line"
    return dict(item.split("=", 1) for item in line.group(1).split())


def test_the_narrowed_pass_runs_pytorch_on_avx2():
    env = narrow_env()
    assert env["ATEN_CPU_CAPABILITY"] == "avx2"
    out = subprocess.run([sys.executable, "-c", "import torch; print(torch.backends.cpu.get_cpu_capability())"],
                         env={**os.environ, **env}, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "AVX2", out.stdout + out.stderr


def test_the_makefile_runs_the_numerics_tests_under_it():
    recipe = (ROOT / "Makefile").read_text().split("\ntest:", 1)[1].split("\n\n", 1)[0]
    assert "$(NARROW_ISA) $(PY) -m pytest" in recipe and "-m numerics" in recipe
