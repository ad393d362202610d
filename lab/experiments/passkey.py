"""make passkey: the passkey study (lab/passkey.py) against served models: an imported RoPE model past its context,
the same model under RoPE scalings that extend it, and the lab's own passkey models where they were trained.

1. A tiny LLaMA is built with transformers (random weights, spread wide so attention is far from uniform:
   attention, not accuracy, is what random weights can show) with max_position_embeddings CONTEXT, beside a byte-level
   BPE tokenizer trained on the built-in corpus, and saved as a Hugging Face folder.
2. The folder is imported (export.hf) plain and under each scaling of SCALINGS (x FACTOR).
3. The lab's trained passkey models (`make lengthgen` leaves them in /tmp/posenc-lengthgen/artifacts/passkey; seed 0
   of each row) are added where that folder exists (`--trained DIR`, `--trained ''` for none).
4. A worker in this process (--long-context 1: an imported model answers past its max_position_embeddings) serves
   them all, and lab.passkey.study measures each through posenc.v1 (Generate, Predict's last row, Tokenize).

Writes bench/results/passkey.json (bench.lib.results: meta, tables, the whole study) and docs/img/passkey.png drawn
from that JSON alone (`--plot-only` draws it again without building or serving anything).
  python -m lab.experiments.passkey [--n N] [--work DIR] [--trained DIR] [--plot-only]
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.lib.results import meta, write
from client.api import Client
from lab import passkey
from lab.experiments.scaling import train_tokenizer
from lab.pictures import passkey_plot
from model.cli import Parser
from model.corpus import train_text

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results" / "passkey.json"
PLOT = ROOT / "docs" / "img" / "passkey.png"
TRAINED = Path("/tmp/posenc-lengthgen/artifacts/passkey")
CONTEXT, FACTOR = 256, 4
SPREAD = 0.3  # the weights' standard deviation: attention far from uniform (initialisation's 0.02 is near it)
LENGTHS = (192, 256, 512, 1024)  # tokens: 0.75x to 4x the imported model's context (its shortest prompt is about 140)
LAB_LENGTHS = (384, 768, 1536, 3072)  # bytes: the lab's passkey models train on prompts of about 270 to 560
SCALINGS = {"none": {"rope_type": "default"},
            "dynamic": {"rope_type": "dynamic", "factor": FACTOR},
            "yarn": {"rope_type": "yarn", "factor": FACTOR, "original_max_position_embeddings": CONTEXT}}


def build_folder(folder: Path, seed: int = 0) -> dict[str, Any]:
    """The Hugging Face folder: a LLaMA of random weights (normal, std SPREAD; norms' scales 1) and its tokenizer."""
    # lazy: torch and transformers (213 MB) load only to build the model; --plot-only never does
    import torch
    import transformers as tf

    tok = train_tokenizer(train_text())
    torch.manual_seed(seed)
    config = tf.LlamaConfig(vocab_size=tok.get_vocab_size(), hidden_size=32, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
                            max_position_embeddings=CONTEXT, rope_theta=10000.0, tie_word_embeddings=False,
                            bos_token_id=0, eos_token_id=0)
    model = tf.LlamaForCausalLM(config).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.ones_like(p) if "norm" in name else SPREAD * torch.randn(p.shape, generator=g))
    if folder.exists():
        shutil.rmtree(folder)
    model.save_pretrained(folder, safe_serialization=True)
    tf.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>").save_pretrained(folder)
    return {"family": "llama", "hidden_size": 32, "layers": 2, "heads": 4, "kv_heads": 2, "vocab": tok.get_vocab_size(),
            "max_position_embeddings": CONTEXT, "rope_theta": 10000.0, "weights": f"random normal, std {SPREAD}",
            "seed": seed}


def import_all(folder: Path, out: Path) -> list[str]:
    # lazy: export pulls onnxscript (92 MB) and torch; only a measuring run imports
    from export.hf import import_artifact

    names = []
    for kind, rope in SCALINGS.items():
        name = "llama" if kind == "none" else f"llama-{kind}{FACTOR}"
        import_artifact(folder, out / name, force=True, validation_max_length=8, rope_scaling=rope)
        names.append(name)
    return names


def add_trained(trained: Path | None, out: Path) -> list[str]:
    """Copies of the lab's trained passkey models (seed 0 of each row), named lab-ROW."""
    if not trained or not trained.is_dir():
        return []
    names = []
    for folder in sorted(trained.glob("*-s0")):
        if (folder / "model.json").exists():
            name = f"lab-{folder.name.removesuffix('-s0')}"
            shutil.rmtree(out / name, ignore_errors=True)
            shutil.copytree(folder, out / name)
            names.append(name)
    return names


def measure(artifacts: Path, imported: list[str], lab: list[str], n: int) -> dict[str, Any]:
    # lazy: the worker loads only when the study serves its models; --plot-only never does
    from service.server import Server
    from service.settings import Limits, Settings

    server = Server(Settings(model_dir=artifacts, host="127.0.0.1", port=0, threads=2, metrics_port=-1,
                             http_port=-1, limits=Limits(long_context=True))).start()
    try:
        with Client(f"127.0.0.1:{server.port}", timeout=600) as client:
            result = passkey.study(client, imported, list(LENGTHS), passkey.DEPTHS, n=n, concurrency=2)
            if lab:
                more = passkey.study(client, lab, list(LAB_LENGTHS), passkey.DEPTHS, n=n, concurrency=2)
                result["models"].update(more["models"])
                result["seconds"] += more["seconds"]
            return result
    finally:
        server.stop(grace=1)


def by_length(result: dict[str, Any], names: list[str], lengths: tuple[int, ...]) -> dict[str, Any]:
    """Per model and length, over the depths and layers: accuracy, needle mass (control mass)."""
    rows = []
    for name in names:
        row, shown = result["models"][name], []
        for length in lengths:
            cells = [c for c in row["cells"] if c["length"] == length and "unavailable" not in c]
            controls = [np.mean(c["control_mass"]) for c in cells if c["control_mass"]]
            shown.append(f"{np.mean([c['accuracy'] for c in cells]):.2f} · "
                         f"{np.mean([np.mean(c['needle_mass']) for c in cells]):.3f} "
                         f"({np.mean(controls):.3f})" if cells and controls else None)
        rows.append([name, row["variant"], row["trained_context"], *shown])
    return {"columns": ["model", "variant", "context", *(str(x) for x in lengths)], "rows": rows,
            "note": "Each cell: accuracy · the last prompt row's attention mass on the needle (on a control span as "
                    "long), averaged over the depths and the layers; columns: prompt length in the model's tokens; "
                    "–: no cell of that length could be measured."}


def tables(result: dict[str, Any], imported: list[str], lab: list[str]) -> dict[str, Any]:
    out = {"imported": by_length(result, imported, LENGTHS)}
    if lab:
        out["lab"] = by_length(result, lab, LAB_LENGTHS)
    for name, table in zip(result["models"], passkey.tables(result), strict=True):
        out[name] = {"title": f"{name}: needle depth x prompt length", "columns": table.header, "rows": table.rows,
                     "note": table.intro[0]}
    return out


def plot(doc: dict[str, Any], path: Path) -> None:
    passkey_plot(doc["study"], path)


def main(argv: list[str] | None = None) -> int:
    p = Parser(prog="python -m lab.experiments.passkey", description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=4, help="examples per cell")
    p.add_argument("--work", default="/tmp/posenc-passkey", help="where the HF folder and artifacts go")
    p.add_argument("--trained", default=str(TRAINED), help="the lab's trained passkey artifacts ('' for none)")
    p.add_argument("--out", default=str(RESULTS))
    p.add_argument("--plot", default=str(PLOT))
    p.add_argument("--plot-only", action="store_true", help="draw --plot from --out alone")
    args = p.parse_args(argv)
    if args.plot_only:
        plot(json.loads(Path(args.out).read_text()), Path(args.plot))
        print(f"drew {args.plot} from {args.out}")
        return 0
    start, work = time.monotonic(), Path(args.work)
    model = build_folder(work / "hf")
    imported = import_all(work / "hf", work / "artifacts")
    lab = add_trained(Path(args.trained) if args.trained else None, work / "artifacts")
    result = measure(work / "artifacts", imported, lab, args.n)
    doc = {"meta": meta("make passkey", seconds=round(time.monotonic() - start, 1)),
           "tables": tables(result, imported, lab), "model": model, "scalings": SCALINGS, "study": result}
    out = Path(args.out)
    write(out.parent, out.stem, doc, indent=1)
    plot(doc, Path(args.plot))
    print("\n\n".join(t.markdown() for t in passkey.tables(result)))
    print(f"wrote {out} and {args.plot} in {doc['meta']['seconds']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
