"""Whether this CPU offers PyTorch's kernels more than the AVX2 make test's second pass holds them to (the Makefile's
NARROW_ISA): `python -m tests.isa` exits 0 when it does (AVX-512, AVX-VNNI or AMX: the second pass computes
something the first did not), 1 when AVX2 is already the widest (the second pass would repeat the first exactly, so
make test runs the numerics tests once, in the first pass, under the same AVX2 kernels)."""

from __future__ import annotations

import sys
from pathlib import Path

# Instruction-set extensions past AVX2 that ATen, oneDNN or MKL dispatch to (flags as /proc/cpuinfo names them).
WIDER = ("avx512f", "avx_vnni", "amx_tile")


def cpu_flags(cpuinfo: str | None = None) -> set[str]:
    """The CPU's feature flags, from /proc/cpuinfo's first "flags" line."""
    text = cpuinfo if cpuinfo is not None else Path("/proc/cpuinfo").read_text()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    raise RuntimeError("/proc/cpuinfo has no flags line")


def wider_than_avx2(flags: set[str]) -> bool:
    return any(flag in flags for flag in WIDER)


def main() -> int:
    wider = [flag for flag in WIDER if flag in cpu_flags()]
    if wider:
        print(f"this CPU has {', '.join(wider)}: the numerics tests run again with PyTorch held to AVX2")
        return 0
    print("this CPU's widest vector instructions are AVX2: the first pass ran the numerics tests under them")
    return 1


if __name__ == "__main__":
    sys.exit(main())
