"""The peer model's artifact in a few megabytes, rebuilt bit for bit on a machine it cannot be copied to.

A GPU machine that receives only a small working tree cannot be sent the 1 GB artifact of the peer benchmark's
model (bench/peers_model.py).  So the weights are drawn from a seed instead of copied:

  redraw   the Hugging Face folder's large tensors are replaced by draws from numpy's PCG64 (seeded per tensor,
           uniform with each tensor's mean and standard deviation; small tensors such as norm weights kept), and
           posenc's importer exports that folder as usual (its parity validation against transformers included);
  pack     every file of the artifact except the weight files is copied; each weight file is described as regions
           that are tensors of the redrawn folder (as stored, transposed, or concatenated along rows, as the
           exporter's fused QKV is; in float32, or in float16 as export/half.py's converter rounds them for
           fast16.onnx), plus what is left (small tensors, padding) compressed;
  unpack   draws the same tensors from the seed, writes each region, and checks every file against the artifact's
           manifest sha256: the rebuilt artifact is the one exported here, or unpack fails.

Only numpy and the standard library are needed to unpack (PCG64's raw output and SeedSequence are fixed by numpy;
the arithmetic is float64 then one rounding to float32).

  python -m bench gpu-pack pack --work /tmp/posenc-peers --out .gpu/pack
  python -m bench gpu-pack unpack .gpu/pack --out /tmp/gpu-models
"""

from __future__ import annotations

import hashlib
import json
import lzma
import shutil
import sys
from pathlib import Path

import numpy as np

from model.cli import Parser

BIG = 65536  # tensors with at least this many elements are drawn from the seed; smaller ones are kept
SEED = 20261127
NAME = "smollm-redrawn"
HF_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json")


def draw(seed: int, spec: dict) -> np.ndarray:
    """One tensor of the redrawn model: uniform on mean +- std * sqrt(3) (the source tensor's mean and standard
    deviation), from PCG64 seeded with (seed, index)."""
    n = int(np.prod(spec["shape"]))
    bits = np.random.Generator(np.random.PCG64([seed, spec["index"]])).bit_generator.random_raw(n)
    u = (bits >> np.uint64(11)).astype(np.float64) * 2.0 ** -53  # [0, 1) from the top 53 bits
    half = spec["std"] * 3.0 ** 0.5
    return ((2.0 * u - 1.0) * half + spec["mean"]).astype(np.float32).reshape(spec["shape"])


def to_half(t: np.ndarray) -> np.ndarray:
    """float32 -> float16 as onnxruntime's float16 converter writes weights (export/half.py): magnitudes below
    5.96e-08 raised to it, above 65504 lowered to it, then numpy's rounding."""
    low, high = 5.96e-08, 65504.0
    t = np.where((t > 0) & (t < low), low, t)
    t = np.where((t > -low) & (t < 0), -low, t)
    t = np.where((t > high) & (t < np.inf), high, t)
    t = np.where((t > -np.inf) & (t < -high), -high, t)
    return np.float16(t)


def redraw(src: Path, dst: Path, seed: int = SEED, big: int = BIG) -> dict:
    """dst <- src's Hugging Face folder with its large float32 tensors redrawn; returns the recipe of each."""
    from safetensors.numpy import load_file, save_file

    tensors = load_file(str(src / "model.safetensors"))
    recipe, out = {}, {}
    for i, name in enumerate(sorted(tensors)):
        t = tensors[name]
        if t.size >= big and t.dtype == np.float32:
            recipe[name] = {"index": i, "shape": list(t.shape), "std": float(t.std(dtype=np.float64)),
                            "mean": float(t.mean(dtype=np.float64))}
            out[name] = draw(seed, recipe[name])
        else:
            out[name] = t
    dst.mkdir(parents=True, exist_ok=True)
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    for f in HF_FILES:
        if (src / f).is_file():
            shutil.copyfile(src / f, dst / f)
    desc = {"seed": seed, "big": big, "source": str(src), "tensors": recipe}
    (dst / "redrawn.json").write_text(json.dumps(desc, indent=1))
    return recipe


def _external(folder: Path) -> dict[str, list[tuple[int, int, list[int], str]]]:
    """data file -> [(offset, length, dims, dtype)] of every graph's external initializers stored in it."""
    import onnx

    found: dict[str, set] = {}
    for graph in sorted(folder.glob("*.onnx")):
        model = onnx.load(str(graph), load_external_data=False)
        for init in model.graph.initializer:
            if init.data_location != onnx.TensorProto.EXTERNAL:
                continue
            kind = {onnx.TensorProto.FLOAT: "float32", onnx.TensorProto.FLOAT16: "float16"}.get(init.data_type)
            if kind is None:
                continue  # only float32 and float16 regions can be drawn; the rest stays in the residue
            d = {e.key: e.value for e in init.external_data}
            found.setdefault(d["location"], set()).add((int(d.get("offset", 0)), int(d["length"]), tuple(init.dims),
                                                        kind))
    return {k: [(o, n, list(dims), kind) for o, n, dims, kind in sorted(v)] for k, v in found.items()}


def _pieces(region: np.ndarray, tensors: dict[str, np.ndarray], first_rows: dict) -> tuple[list[str], bool] | None:
    """The redrawn tensors whose row-wise concatenation is the region (or its transpose), if any."""
    for transposed in (False, True):
        rows = region.T if transposed else region
        if rows.ndim != 2:
            continue
        parts, p = [], 0
        while p < rows.shape[0]:
            key = (rows[p].tobytes(), rows.shape[1])
            hit = next((n for n in first_rows.get(key, []) if p + tensors[n].shape[0] <= rows.shape[0]
                        and np.array_equal(rows[p:p + tensors[n].shape[0]], tensors[n])), None)
            if hit is None:
                break
            parts.append(hit)
            p += tensors[hit].shape[0]
        if p == rows.shape[0]:
            return parts, transposed
    return None


def pack(artifact: Path, hf: Path, out: Path, extra: list[Path] = ()) -> dict:
    """out <- the artifact's small files, pack.json (recipe, regions, sha256) and each data file's residue."""
    from safetensors.numpy import load_file

    redrawn = json.loads((hf / "redrawn.json").read_text())
    tensors = {k: v for k, v in load_file(str(hf / "model.safetensors")).items() if k in redrawn["tensors"]}
    by_type = {"float32": tensors, "float16": {k: to_half(v) for k, v in tensors.items()}}  # fast16.onnx's weights
    first_rows: dict = {kind: {} for kind in by_type}
    for kind, named in by_type.items():
        for name, t in named.items():
            if t.ndim == 2:
                first_rows[kind].setdefault((t[0].tobytes(), t.shape[1]), []).append(name)
    manifest = json.loads((artifact / "manifest.json").read_text())
    layout = _external(artifact)
    if out.exists():
        shutil.rmtree(out)
    (out / "artifact").mkdir(parents=True)
    files: dict = {}
    for name in manifest["files"]:
        if name in layout:
            continue
        shutil.copyfile(artifact / name, out / "artifact" / name)
    shutil.copyfile(artifact / "manifest.json", out / "artifact" / "manifest.json")
    drawn = 0
    for data_file, regions in layout.items():
        raw = bytearray((artifact / data_file).read_bytes())
        placed = []
        for offset, length, dims, kind in regions:
            if length < redrawn.get("big", BIG) * np.dtype(kind).itemsize:
                continue
            region = np.frombuffer(bytes(raw[offset:offset + length]), kind).reshape(dims)
            found = _pieces(region, by_type[kind], first_rows[kind])
            if found is None:
                continue
            placed.append({"offset": offset, "shape": dims, "parts": found[0], "transposed": found[1],
                           "dtype": kind})
            raw[offset:offset + length] = bytes(length)
            drawn += length
        (out / f"{data_file}.rest.xz").write_bytes(lzma.compress(bytes(raw), preset=9))
        files[data_file] = {"size": len(raw), "sha256": manifest["files"][data_file]["sha256"], "regions": placed}
    for path in extra:
        shutil.copyfile(path, out / path.name)
    desc = {"name": artifact.name, "seed": redrawn["seed"], "tensors": redrawn["tensors"], "files": files,
            "drawn_bytes": drawn}
    (out / "pack.json").write_text(json.dumps(desc, indent=1))
    return desc


def unpack(src: Path, models: Path) -> Path:
    """models/<name> <- the artifact rebuilt from src (pack's output); every weight file checked by sha256."""
    desc = json.loads((src / "pack.json").read_text())
    folder = models / desc["name"]
    stage = models / f".{desc['name']}.unpacking"
    if stage.exists():
        shutil.rmtree(stage)
    shutil.copytree(src / "artifact", stage)
    try:
        cache: dict[str, np.ndarray] = {}
        for data_file, entry in desc["files"].items():
            raw = bytearray(lzma.decompress((src / f"{data_file}.rest.xz").read_bytes()))
            for region in entry["regions"]:
                parts = []
                for name in region["parts"]:
                    if name not in cache:
                        cache[name] = draw(desc["seed"], desc["tensors"][name])
                    parts.append(cache[name])
                arr = np.concatenate(parts, axis=0) if len(parts) > 1 else parts[0]
                if region.get("dtype", "float32") == "float16":
                    arr = to_half(arr)
                data = np.ascontiguousarray(arr.T if region["transposed"] else arr).tobytes()
                raw[region["offset"]:region["offset"] + len(data)] = data
            digest = hashlib.sha256(raw).hexdigest()
            if len(raw) != entry["size"] or digest != entry["sha256"]:
                raise RuntimeError(f"{data_file} rebuilt with sha256 {digest[:12]}, the manifest says "
                                   f"{entry['sha256'][:12]}: another seed, or a numpy that draws otherwise")
            (stage / data_file).write_bytes(raw)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)  # nothing half-built is left
        raise
    if folder.exists():
        shutil.rmtree(folder)
    stage.rename(folder)
    return folder


def main(argv: list[str] | None = None) -> int:
    p = Parser(prog="python -m bench gpu-pack", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("pack", help="redraw the peer model, import it, pack the artifact")
    a.add_argument("--work", type=Path, default=Path("/tmp/posenc-peers"))
    a.add_argument("--out", type=Path, required=True)
    a.add_argument("--reference-prompts", type=int, default=32)
    u = sub.add_parser("unpack", help="rebuild the artifact from a pack")
    u.add_argument("pack", type=Path)
    u.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    try:
        if args.cmd == "unpack":
            print(unpack(args.pack, args.out))
            return 0
        from bench import peers_prepare as prep
        from bench.peers_model import make_folder, prompts, reference_tokens

        hf = args.work / "hf"
        make_folder(hf)
        redrawn = args.work / "hf-redrawn"
        if not (redrawn / "redrawn.json").is_file():
            redraw(hf, redrawn)
        art = prep.posenc_artifact(redrawn, args.work / "gpu", NAME)  # not beside the peers' served artifact
        if "half" not in (json.loads((art / "model.json").read_text()).get("fast") or {}):  # --provider cuda's
            prep._run([sys.executable, "-m", "export.fuse", str(art), "--half"], "posenc float16 fast graph",
                      args.work / "posenc-half.log")
        ref = reference_tokens(redrawn, prompts()[:args.reference_prompts])
        ref_file = redrawn / f"reference-{len(ref)}x{prompts().shape[1]}-{len(ref[0])}.json"
        desc = pack(art, redrawn, args.out, [ref_file])
        print(f"{args.out}: {desc['drawn_bytes'] / 1e6:.0f} MB drawn from the seed, "
              f"{sum(f.stat().st_size for f in args.out.rglob('*') if f.is_file()) / 1e6:.1f} MB packed")
        return 0
    except (OSError, RuntimeError, ValueError, KeyError) as err:
        print(f"python -m bench gpu-pack: error: {err}", file=sys.stderr)
        return 2

