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


# 12 threads alive at once, each having allocated; prints tune()'s answer and glibc's arena count (malloc_info).
ARENAS = r"""
import ctypes, sys, tempfile, threading
from service import malloc
tuned = malloc.tune()
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_void_p]
libc.fopen.restype, libc.fopen.argtypes = ctypes.c_void_p, [ctypes.c_char_p, ctypes.c_char_p]
libc.fclose.argtypes, libc.malloc_info.argtypes = [ctypes.c_void_p], [ctypes.c_int, ctypes.c_void_p]
ready, done = threading.Barrier(13), threading.Event()
def work():
    libc.free(libc.malloc(4096))
    ready.wait()
    done.wait()
threads = [threading.Thread(target=work) for _ in range(12)]
for t in threads:
    t.start()
ready.wait()
with tempfile.NamedTemporaryFile("r") as f:
    fp = libc.fopen(f.name.encode(), b"w")
    libc.malloc_info(0, fp)
    libc.fclose(fp)
    print(tuned, f.read().count("<heap nr="))
done.set()
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the arenas are glibc's")
def test_arenas_capped_unless_the_operator_says():
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}

    def arenas(**env):
        out = subprocess.run([sys.executable, "-c", ARENAS], cwd=ROOT, env={**clean, **env}, capture_output=True,
                             text=True, timeout=60, check=True)
        tuned, count = out.stdout.split()
        return tuned, int(count)

    assert arenas() == ("True", 2)
    assert arenas(MALLOC_ARENA_MAX="4") == ("False", 4)  # the operator's limit, not ours
