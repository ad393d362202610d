"""Each engine's copy of the peer model, made from the one Hugging Face folder by the engine's own tools (in its
own virtualenv), reused when already made.  Each function returns the path, or raises RuntimeError with the
tool's last lines: bench/peers.py records that text as the reason the engine did not run."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from export.quantize import DYNAMIC_WEIGHTS

ROOT = Path(__file__).resolve().parent.parent


def _run(cmd: list[str], what: str, log: Path, env: dict | None = None) -> None:
    with open(log, "w") as f:
        res = subprocess.run(["nice", "-n", "10", *cmd], cwd=ROOT, stdout=f, stderr=subprocess.STDOUT,
                             env={**os.environ, **(env or {})})
    if res.returncode != 0:
        lines = [t for t in log.read_text(errors="replace").splitlines() if t.strip()]
        raise RuntimeError(f"{what} failed (exit {res.returncode}): {' | '.join(lines[-3:])[-600:]}")


def _older_fast(meta: dict) -> bool:
    """Whether an artifact's fast graph predates one of export.fuse's rewrites the peer model takes: the last-position
    head and external data, and the rotations inside GroupQueryAttention (head_dim 64)."""
    fast = meta.get("fast") or {}
    return not (fast.get("logits_positions") and fast.get("external_data")) or (
        fast.get("layout") == "compact" and "GroupQueryAttention do_rotary" not in fast.get("fused", {}))


def posenc_artifact(folder: Path, work: Path, name: str = "smollm") -> Path:
    """python -m export --from-hf: import, export and parity-validate against the folder (posenc's own path); a
    fast graph is added where the export wrote none (a model under its size threshold) or an older one."""
    out = work / "posenc" / name
    if not (out / "manifest.json").is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        _run([sys.executable, "-m", "export", "--from-hf", str(folder), "--out", str(out), "--force",
              "--validate-max-length", "32"], "posenc import", work / "posenc-import.log")
    if _older_fast(json.loads((out / "model.json").read_text())):
        _run([sys.executable, "-m", "export.fuse", str(out)], "posenc fast graph", work / "posenc-fuse.log")
    return out


def posenc_quantized(src: Path, work: Path, method: str) -> Path:
    """python -m export quantize --method int8|int4 beside the fp32 artifact, each in its own served folder.  The
    peer model's weights are random, so its logits are near ties everywhere and top-1 agreement says little; the
    budget is opened here and judged on a model trained here instead (bench/peers_quant.py)."""
    out = work / f"posenc-{method}" / f"{src.name}-{method}"
    if (out / "manifest.json").is_file():
        meta = json.loads((out / "model.json").read_text())
        full_range = method == "dynamic" and meta["quantization"].get("weights") != DYNAMIC_WEIGHTS
        if not full_range and ("fast" not in json.loads((src / "model.json").read_text())
                               or ("fast" in meta and not _older_fast(meta))):
            return out  # else a copy made before quantized copies had a fast graph, an older one, or (dynamic) one
            # with full-range int8 weights, which saturate on CPUs without VNNI: made anew
    out.parent.mkdir(parents=True, exist_ok=True)
    _run([sys.executable, "-m", "export", "quantize", str(src), "--out", str(out), "--method", method, "--force"]
         + ["--max-nats-ratio", "10", "--min-top1", "0"],
         f"posenc quantize {method}", work / f"posenc-{method}.log")
    return out


def ortgenai_model(python: str, folder: Path, work: Path, precision: str = "fp32") -> Path:
    """onnxruntime-genai's model builder for CPU (GroupQueryAttention, RotaryEmbedding, SkipSimplified-
    LayerNormalization graph and genai_config.json): fp32, or its weight-only int8 / int4 (MatMulNBits, blocks of
    32, accuracy_level 4: int8 activations in the CPU kernel, its CPU default)."""
    out = work / ("ortgenai" if precision == "fp32" else f"ortgenai-{precision}")
    if (out / "genai_config.json").is_file():
        return out
    extra = [] if precision == "fp32" else ["--extra_options", "accuracy_level=4"]
    _run([python, "-m", "onnxruntime_genai.models.builder", "-i", str(folder), "-o", str(out), "-p", precision,
          "-e", "cpu", "-c", str(work / f"ortgenai-cache-{precision}"), *extra],
         f"onnxruntime-genai model builder ({precision})", work / f"ortgenai-build-{precision}.log")
    return out


def openvino_model(python: str, folder: Path, work: Path, weights: str = "fp32") -> Path:
    """optimum-intel's OpenVINO export with the tokenizer converted by openvino-tokenizers: weights fp32, or int8
    (its weight compression, `--weight-format int8`: 8-bit weights, per output channel)."""
    out = work / ("openvino" if weights == "fp32" else f"openvino-{weights}")
    if (out / "openvino_model.xml").is_file():
        return out
    cli = str(Path(python).parent / "optimum-cli")
    _run([cli, "export", "openvino", "--model", str(folder), "--task", "text-generation-with-past",
          "--weight-format", weights, str(out)], f"optimum-cli export openvino ({weights})",
         work / f"openvino-export-{weights}.log")
    return out


GGUF_CONVERT = """
import sys
sys.path[:0] = [{src!r}, {src!r} + "/gguf-py"]
import conversion.base as base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"  # a BPE trained here has no known hash
import convert_hf_to_gguf
sys.argv = ["convert_hf_to_gguf.py", {folder!r}, "--outfile", {out!r}, "--outtype", {kind!r}]
convert_hf_to_gguf.main()
"""


def gguf_model(python: str, llama_src: Path, folder: Path, work: Path, kind: str) -> Path:
    """llama.cpp's own converter (convert_hf_to_gguf.py from the vendored source): f32, or q8_0 quantized by it;
    Q4_K_M (llama.cpp's usual 4-bit choice) by llama-quantize from the f32 file, built beside llama-server.
    The BPE was trained here, so its pre-tokenizer is declared GPT-2's (the prompts go in as token ids)."""
    out = work / f"llamacpp-{kind}.gguf"
    if out.is_file():
        return out
    if kind not in ("f32", "q8_0"):
        quantize = llama_src.parent / "build" / "bin" / "llama-quantize"
        if not quantize.is_file():
            raise RuntimeError(f"{quantize} was not built (make bench-peers builds it)")
        f32 = gguf_model(python, llama_src, folder, work, "f32")
        tmp = out.with_suffix(".tmp")
        _run([str(quantize), str(f32), str(tmp), kind, "2"], f"llama-quantize {kind}", work / f"llamacpp-{kind}.log")
        tmp.rename(out)
        return out
    if not (llama_src / "convert_hf_to_gguf.py").is_file():
        raise RuntimeError(f"no llama.cpp source at {llama_src} (make bench-peers unpacks it)")
    tmp = out.with_suffix(".tmp")
    _run([python, "-c", GGUF_CONVERT.format(src=str(llama_src), folder=str(folder), out=str(tmp), kind=kind)],
         f"convert_hf_to_gguf --outtype {kind}", work / f"llamacpp-{kind}.log")
    tmp.rename(out)
    return out


def posenc_for_genai(art: Path, genai: Path, work: Path) -> Path:
    """posenc's fast graph driven by onnxruntime-genai's own generator (bench/peers_loop.md): the graph takes
    GroupQueryAttention's seqlens_k and total_sequence_length, and the head's logits_positions, as inputs the worker
    feeds, where onnxruntime-genai's graph computes the first two from the attention mask; a few nodes in front
    compute all three from the mask and the ids as onnxruntime-genai's builder does (each row's ones minus one, the
    mask's width, every new token), and genai_config.json is the builder's for the same model with the file
    changed.  The weights stay in the artifact's data file (a hard link to it, or a copy)."""
    import onnx  # lazy: only this engine's copy rewrites a graph
    from onnx import TensorProto, helper

    out = work / "posenc-genai"
    meta = json.loads((art / "model.json").read_text())
    fast = meta["fast"]
    if fast.get("layout") != "compact" or not fast.get("logits_positions"):
        raise RuntimeError("the artifact's fast graph is not a compact one with a last-position head")
    if (out / "genai_config.json").is_file() and (out / "source.sha256").is_file() and \
            (out / "source.sha256").read_text() == fast["source_sha256"]:
        return out
    out.mkdir(parents=True, exist_ok=True)
    model = onnx.load(str(art / fast["file"]), load_external_data=False)
    graph = model.graph
    fed = {"seqlens_k", "total_sequence_length", fast["logits_positions"]}
    if not fed <= {i.name for i in graph.input}:
        raise RuntimeError(f"the fast graph lacks one of {sorted(fed)}")
    keep = [i for i in graph.input if i.name not in fed]
    del graph.input[:]
    graph.input.extend(keep)
    const = [helper.make_tensor(name, TensorProto.INT64, [len(v)], v) for name, v in
             (("genai_one", [1]), ("genai_axis1", [1]), ("genai_zero", [0]))]
    const += [helper.make_tensor(name, TensorProto.INT64, [], [v]) for name, v in
              (("genai_zero_scalar", 0), ("genai_one_scalar", 1))]
    # seqlens_k = each row's ones - 1; total = the mask's width; logits_positions = every new token (onnxruntime-genai
    # binds logits for each of a call's tokens, as its own graph computes them)
    nodes = [
        helper.make_node("ReduceSum", ["attention_mask", "genai_axis1"], ["genai_ones"], keepdims=0),
        helper.make_node("Sub", ["genai_ones", "genai_one"], ["genai_seqlens"]),
        helper.make_node("Cast", ["genai_seqlens"], ["seqlens_k"], to=TensorProto.INT32),
        helper.make_node("Shape", ["attention_mask"], ["genai_mask_shape"]),
        helper.make_node("Gather", ["genai_mask_shape", "genai_one"], ["genai_width"], axis=0),
        helper.make_node("Squeeze", ["genai_width"], ["genai_width_scalar"]),
        helper.make_node("Cast", ["genai_width_scalar"], ["total_sequence_length"], to=TensorProto.INT32),
        helper.make_node("Shape", ["input_ids"], ["genai_ids_shape"]),
        helper.make_node("Gather", ["genai_ids_shape", "genai_one"], ["genai_new"], axis=0),
        helper.make_node("Squeeze", ["genai_new"], ["genai_new_scalar"]),
        helper.make_node("Range", ["genai_zero_scalar", "genai_new_scalar", "genai_one_scalar"], ["genai_span"]),
        helper.make_node("Unsqueeze", ["genai_span", "genai_zero"], ["genai_span_row"]),
        helper.make_node("Gather", ["genai_ids_shape", "genai_zero"], ["genai_rows"], axis=0),
        helper.make_node("Concat", ["genai_rows", "genai_new"], ["genai_head_shape"], axis=0),
        helper.make_node("Expand", ["genai_span_row", "genai_head_shape"], [fast["logits_positions"]]),
    ]
    graph.initializer.extend(const)
    rest = list(graph.node)
    del graph.node[:]
    graph.node.extend(nodes + rest)
    if fast.get("external_data"):
        data = art / fast["external_data"]
        link = out / data.name  # a hard link: onnxruntime refuses data a symbolic link takes out of the model's folder
        link.unlink(missing_ok=True)
        try:
            os.link(data, link)
        except OSError:  # another file system
            shutil.copyfile(data, link)
    onnx.save_model(model, str(out / "model.onnx"))
    cfg = json.loads((genai / "genai_config.json").read_text())
    cfg["model"]["decoder"]["filename"] = "model.onnx"
    (out / "genai_config.json").write_text(json.dumps(cfg, indent=4))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (genai / name).is_file():
            (out / name).write_bytes((genai / name).read_bytes())
    (out / "source.sha256").write_text(fast["source_sha256"])
    return out
