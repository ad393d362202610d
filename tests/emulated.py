"""Python commands on a CPU that qemu's user-mode emulator presents, CPUID included: onnxruntime chooses its kernels
by CPUID and has no setting to narrow them, so this is how the suite sees what a machine without AVX-512 or VNNI
computes, on any x86-64 machine (make test installs Debian's qemu-user: make qemu).  Only onnxruntime and numpy run
there (tests/direct.py's entry point): the emulator is tens of times slower than the CPU under it."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ZEN3 = "EPYC-Milan"  # qemu's AMD Zen 3: AVX2 and FMA, no AVX-512, no VNNI, no AMX


def emulated(cpu: str, *args, timeout: float = 600) -> subprocess.CompletedProcess:
    """`python *args` in the repository, on the emulated `cpu`."""
    qemu = shutil.which("qemu-x86_64")
    assert qemu, "qemu-x86_64 is missing: make test installs Debian's qemu-user (make qemu)"
    return subprocess.run([qemu, "-cpu", cpu, sys.executable, *map(str, args)], capture_output=True, text=True,
                          cwd=ROOT, timeout=timeout)


def assert_avx2_only(features) -> None:
    """The CPU features numpy read with CPUID in the emulated process (tests/direct.py writes them): AVX2 without
    AVX-512 and VNNI, so onnxruntime ran the kernels such a machine runs."""
    found = {str(f) for f in features}
    assert "AVX2" in found and "AVX512F" not in found and not {f for f in found if "VNNI" in f}, sorted(found)
