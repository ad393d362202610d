"""python -m export --from-hf DIR: a local Hugging Face folder -> an ordinary, validated posenc artifact.

The model comes from model.hf (config.json + safetensors, no transformers); the artifact carries the folder's
tokenizer.json, covered by the manifest, and model.json records it (type, vocabulary size, special ids).  A chat
template (chat_template.jinja, else tokenizer_config.json's `chat_template`: a string, or a list of named templates
whose "default" is taken, as transformers takes them) goes into the artifact's chat_template.jinja, and the
tokenizer entry records it with the special token strings the template is rendered with (bos_token, eos_token, ...:
those transformers' tokenizer of the folder has, model.hf.load.named_tokens); the worker's /v1/chat/completions
renders it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from export import proof
from export.build import CHAT_TEMPLATE, DEFAULT_ATTENTION, DEFAULT_OPSET, build_artifact, tokenizer_entry
from export.errors import ExportError
from model.files import sha256_file
from model.hf import import_folder
from model.hf.files import CONFIG, read_json
from model.hf.load import named_tokens

# Imported models validate at lengths up to this (1, 7, the context, 2x, 4x, cut here): a real model's
# attentions at 4x a 2048-token context would not fit in memory.  --validate-max-length changes it.
VALIDATION_MAX_LENGTH = 256
# The proof at import runs up to this many positions (or validation_max_length, if longer): past a tiny model's
# windows, chunks and original contexts; a real model's 4096-token window is past it (the verdict lists the lengths)
PROOF_MAX_LENGTH = 256


def import_artifact(folder: str | Path, out: str | Path, *, name: str | None = None, force: bool = False,
                    opset: int = DEFAULT_OPSET, attention: str = DEFAULT_ATTENTION,
                    validation_max_length: int = VALIDATION_MAX_LENGTH, external_data: bool | None = None,
                    rope_scaling: dict[str, Any] | None = None, verify: bool | None = None,
                    interventions: bool = True):
    """Import, prove, export, validate, write atomically; returns (validation report, import info).  rope_scaling: a
    rope_parameters object that replaces the folder's RoPE scaling (recorded in model.json's source).  verify: the
    proof against transformers' own model of the folder (export/proof.py; None: whenever transformers is installed),
    its verdict recorded in model.json's source; the generic import is never written without it."""
    folder, out = Path(folder), Path(out)
    if out.exists() and not force:  # before a long import (artifact.staging checks again)
        raise ExportError(f"{out} already exists; pass --force to replace it")
    model, info = import_folder(folder, rope_scaling)
    verify = proof.available() if verify is None else verify
    if info["generic"] and not verify:
        why = "pass no --no-verify" if proof.available() else "install transformers (the build extra)"
        raise ExportError(f"{folder}: model_type {info['family']!r} has no module and is read by the generic import, "
                          f"written only when proven equal to transformers: {why}")
    if verify and not proof.available():
        raise ExportError(f"{folder}: the proof at import needs transformers (the build extra); --no-verify skips it")
    source: dict[str, Any] = {"kind": "huggingface", "path": str(folder), "family": info["family"],
                              "architectures": info["architectures"],
                              "config_sha256": sha256_file(folder / CONFIG)}
    if rope_scaling is not None:
        source["rope_scaling"] = rope_scaling
    if verify:  # before anything is written: a refusal leaves no folder
        source["proof"] = proof.prove(model, folder, read_json(folder / CONFIG),
                                      max(PROOF_MAX_LENGTH, validation_max_length), generic=info["generic"],
                                      override=rope_scaling)
    info["proof"] = source.get("proof")
    special = {"bos_token_id": info["bos_token_id"], "eos_token_id": info["eos_token_id"],
               "eos_token_ids": eos_token_ids(folder, info["eos_token_id"])}
    tokenizer = (info["tokenizer"], tokenizer_entry(info["tokenizer_vocab_size"], special, chat_template(folder)))
    extra = {"validation_max_length": validation_max_length, "family": info["family"],
             "max_model_len": info["max_model_len"]}  # the positions served by default (vLLM's rule)
    report = build_artifact(model, out, name=name or out.name, opset=opset, source=source, training={},
                            force=force, attention=attention, tokenizer=tokenizer, extra=extra,
                            external_data=external_data, interventions=interventions)
    return report, info


def eos_token_ids(folder: Path, from_config) -> list[int] | None:
    """The ids transformers' generate() stops at: generation_config.json's eos_token_id when the folder has one,
    else config.json's; one id or a list.  The worker stops its streams there."""
    value = from_config
    if (folder / "generation_config.json").is_file():
        value = read_json(folder / "generation_config.json").get("eos_token_id", value)
    if value is None:
        return None
    ids = value if isinstance(value, list) else [value]
    if not all(type(v) is int and v >= 0 for v in ids):
        raise ExportError(f"{folder}: eos_token_id {value!r} is not a token id or a list of them")
    return sorted(set(ids))


def chat_template(folder: Path) -> dict[str, Any] | None:
    """The folder's chat template and the special token strings transformers renders it with (its tokenizer's
    special_tokens_map: the tokenizer class's defaults where the folder names none), or None when it has none."""
    config = read_json(folder / "tokenizer_config.json") if (folder / "tokenizer_config.json").is_file() else {}
    if (folder / CHAT_TEMPLATE).is_file():  # transformers prefers the file to the config's entry
        source = (folder / CHAT_TEMPLATE).read_text(encoding="utf-8")
    else:
        source = config.get("chat_template")
        if source is None:
            return None
        if isinstance(source, list):
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
            if "default" not in named:
                raise ExportError(f"{folder}: tokenizer_config.json has chat templates {sorted(map(str, named))} "
                                  "and none named 'default'")
            source = named["default"]
        if not isinstance(source, str):
            raise ExportError(f"{folder}: tokenizer_config.json's chat_template is not a string or a list of "
                              "named templates")
    model_type = read_json(folder / CONFIG).get("model_type") if (folder / CONFIG).is_file() else None
    return {"template": source, "tokens": named_tokens(folder, model_type)}
