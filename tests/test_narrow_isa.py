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
    assert "if $(PY) -m tests.isa; then $(NARROW_ISA)" in recipe  # run where it differs from the first pass


# /proc/cpuinfo's flags of an AMD EPYC 7763 (Zen 3, AVX2 only) and an Intel Xeon 8480+ (Sapphire Rapids), abridged to
# their vector extensions.
ZEN3 = "flags\t\t: fpu sse sse2 ssse3 fma sse4_1 sse4_2 avx f16c avx2 bmi1 bmi2 sha_ni vaes vpclmulqdq\n"
SAPPHIRE_RAPIDS = ("flags\t\t: fpu sse sse2 ssse3 fma sse4_1 sse4_2 avx f16c avx2 avx512f avx512dq avx512bw "
                   "avx512_vnni avx512_bf16 avx_vnni amx_bf16 amx_tile amx_int8\n")


def test_the_second_pass_is_kept_where_the_cpu_has_more_than_avx2():
    from tests import isa

    assert not isa.wider_than_avx2(isa.cpu_flags(ZEN3))
    assert isa.wider_than_avx2(isa.cpu_flags(SAPPHIRE_RAPIDS))
    # PyTorch's own reading of this CPU: where it would pick AVX-512 kernels, the second pass must run
    import torch

    if torch.backends.cpu.get_cpu_capability() == "AVX512":
        assert isa.wider_than_avx2(isa.cpu_flags())
    out = subprocess.run([sys.executable, "-m", "tests.isa"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == (0 if isa.wider_than_avx2(isa.cpu_flags()) else 1), out.stdout + out.stderr
