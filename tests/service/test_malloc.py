"""service.malloc: glibc thresholds raised once per process, never over the operator's own settings."""

import os
import platform
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROBE = "from service import malloc; print(malloc.tune(), malloc.tune())"


def run_probe(**env) -> str:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, env={**clean, **env}, capture_output=True,
                         text=True, timeout=60, check=True)
    return out.stdout.strip()


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the thresholds are glibc's")
def test_tunes_glibc_once():
    assert run_probe() == "True True"


@pytest.mark.parametrize("var", ["MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_"])
def test_operator_settings_win(var):
    assert run_probe(**{var: "131072"}) == "False False"
