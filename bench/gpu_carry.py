"""What a GPU machine that cannot reach a package index needs for bench/peers_gpu.py, made small enough to travel.

onnxruntime-gpu's wheel is 256 MB; 270 MB of it is its CUDA provider library, of which 218 MB are CUDA kernels
compiled for six GPU generations (sm_75 to sm_120).  Only the generation of the GPU it runs on is ever loaded, so
the kernels of the others are overwritten with zeros (the library keeps its size and layout: every fatbin entry
header stays, only the payloads of other architectures become zeros) and the library compresses to about 52 MB.
The rest of the wheel (13 MB compressed) and the worker's pinned dependencies (requirements/worker.txt, 14 MB of
wheels) travel in a second part.

  python -m bench gpu-carry --out .gpu --arch 90      # .gpu/prov (first call), .gpu/ort + .gpu/whl (second call)
"""

from __future__ import annotations

import collections
import lzma
import shutil
import struct
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

from model.cli import Parser

ROOT = Path(__file__).resolve().parent.parent
ORT_GPU = "onnxruntime-gpu==1.31.1"  # the newest onnxruntime-gpu on PyPI; built for CUDA 13 and cuDNN 9
PROVIDER = "onnxruntime/capi/libonnxruntime_providers_cuda.so"
FATBIN_MAGIC = 0xBA55ED50
EXTRA = ("pydantic-core==2.50.5", "annotated-types==0.8.0", "typing-inspection==0.4.5", "typing-extensions==4.16.0",
         "anyio==4.16.0")  # the worker pins' own requirements that the GPU machine's image may lack or hold older


def section(path: Path, name: str) -> tuple[int, int]:
    """(file offset, size) of an ELF section, from readelf."""
    out = subprocess.run(["readelf", "-S", "-W", str(path)], capture_output=True, text=True, check=True).stdout
    for line in out.splitlines():
        cols = line.replace("[ ", "[").split()
        if name in cols:
            i = cols.index(name)
            return int(cols[i + 3], 16), int(cols[i + 4], 16)
    raise RuntimeError(f"{path} has no {name} section")


def keep_arch(data: bytearray, start: int, size: int, arch: int) -> collections.Counter:
    """Zero the payload of every fatbin entry in data[start:start+size] compiled for another architecture than
    `arch`; returns bytes per (kind, architecture) seen.  Fatbin layout: a 16-byte header (magic, version, header
    size, entries' size), then entries each with a header (kind, version, header size, payload size, ..., the
    architecture at byte 28)."""
    seen: collections.Counter = collections.Counter()
    pos, end = start, start + size
    while pos < end:
        magic, _, header, total = struct.unpack_from("<IHHQ", data, pos)
        if magic != FATBIN_MAGIC:
            pos += 8  # fatbins are 8-byte aligned in the section
            continue
        entry, stop = pos + header, pos + header + total
        while entry < stop:
            kind, _, eheader, payload = struct.unpack_from("<HHIQ", data, entry)
            sm = struct.unpack_from("<I", data, entry + 28)[0]
            seen[("ptx" if kind == 1 else "cubin", sm)] += payload
            if sm != arch:
                data[entry + eheader:entry + eheader + payload] = bytes(payload)
            entry += eheader + payload
        pos = stop
    return seen


def pip_download(specs: list[str], dest: Path) -> None:
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                    "--python-version", "3.12", "--implementation", "cp", "--platform", "manylinux_2_28_x86_64",
                    "--platform", "manylinux_2_17_x86_64", "--platform", "manylinux2014_x86_64", "--platform", "any",
                    "-d", str(dest), *specs], check=True)


def main(argv: list[str] | None = None) -> int:
    p = Parser(prog="python -m bench gpu-carry", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=ROOT / ".gpu")
    p.add_argument("--arch", type=int, default=90, help="the GPU's compute capability, major*10+minor (H100: 90)")
    args = p.parse_args(argv)
    for sub in ("prov", "ort", "whl"):
        shutil.rmtree(args.out / sub, ignore_errors=True)
        (args.out / sub).mkdir(parents=True)
    pins = [line.split("#")[0].strip() for line in (ROOT / "requirements" / "worker.txt").read_text().splitlines()]
    pip_download([x for x in pins if x and not x.startswith(("numpy", "onnxruntime", "jinja2"))] + list(EXTRA),
                 args.out / "whl")
    with tempfile.TemporaryDirectory() as tmp:
        pip_download([ORT_GPU], Path(tmp))
        wheel = next(Path(tmp).glob("onnxruntime_gpu-*.whl"))
        with zipfile.ZipFile(wheel) as z:
            z.extractall(Path(tmp) / "x")
        lib = Path(tmp) / "x" / PROVIDER
        data = bytearray(lib.read_bytes())
        seen = keep_arch(data, *section(lib, ".nv_fatbin"), args.arch)
        if not any(sm == args.arch for _, sm in seen):
            raise SystemExit(f"python -m bench gpu-carry: error: {wheel.name} has no kernels for sm_{args.arch}")
        (args.out / "prov" / (lib.name + ".xz")).write_bytes(lzma.compress(bytes(data), preset=9))
        lib.unlink()
        with tarfile.open(args.out / "ort" / "ort-rest.tar.xz", "w:xz", preset=9) as tar:
            for item in sorted((Path(tmp) / "x").iterdir()):
                tar.add(item, arcname=item.name)
    for (kind, sm), size in sorted(seen.items()):
        print(f"{kind} sm_{sm}: {size / 1e6:.1f} MB{' (kept)' if sm == args.arch else ''}")
    for sub in ("prov", "ort", "whl"):
        print(f"{args.out / sub}: {sum(f.stat().st_size for f in (args.out / sub).iterdir()) / 1e6:.1f} MB")
    return 0

