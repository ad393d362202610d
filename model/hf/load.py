"""Import a local Hugging Face folder as a posenc Transformer (offline; transformers is never needed).

The model is built on the meta device and given uninitialised memory, then each tensor is read from the
memory-mapped safetensors file, laid out as posenc needs and copied into its parameter: one copy of the weights in
memory plus one tensor in flight, no random initialisation of a model about to be overwritten.
"""

from __future__ import annotations

import atexit
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from model.config import ModelConfig
from model.errors import ConfigError, ImportRefusedError
from model.hf.families import FAMILIES, IGNORED_SUFFIXES, Fields
from model.hf.files import CONFIG, TOKENIZER, Weights, read_json, tokenizer_vocab_size
from model.hf.generic import family as generic_family
from model.hf.sentencepiece import SPM, sentencepiece
from model.hf.sentencepiece import named_tokens as spm_named_tokens
from model.hf.slow_tokenizer import GPT2_DEFAULTS, MERGES, VOCAB, byte_level_bpe
from model.hf.slow_tokenizer import named_tokens as bpe_named_tokens
from model.rope_scaling import served_length
from model.transformer import Transformer
from model.variants import build_variant, check_config

HEAD_NAMES = ("lm_head.weight", "embed_out.weight")


def read_config(folder: Path, rope_scaling: dict[str, Any] | None = None) -> tuple[ModelConfig, Any, dict[str, Any]]:
    """posenc's config, the family's weight mapping and the raw config.json of `folder`; rope_scaling (a
    transformers rope_parameters object) replaces the folder's RoPE scaling.  A model_type no module names is read by
    the generic import (model/hf/generic.py)."""
    path = folder / CONFIG
    data = read_json(path)
    kind = data.get("model_type")
    if not kind:
        raise ImportRefusedError(f"{path}: no model_type (supported: {', '.join(FAMILIES)})")
    if not isinstance(kind, str):
        raise ImportRefusedError(f"{path}: model_type {kind!r} is not a name")
    if kind in FAMILIES:
        values, mapping = FAMILIES[kind](Fields(data, path, rope_scaling))
    else:
        try:
            values, mapping = generic_family(Fields(data, path, rope_scaling), Weights(folder))
        except ImportRefusedError as err:
            raise generic_refusal(kind, err) from None
    try:
        cfg = ModelConfig(**values)
        check_config(cfg)
    except ConfigError as err:
        raise ImportRefusedError(f"{path}: {err}") from None
    return cfg, mapping, data


def generic_refusal(kind: str, err: ImportRefusedError) -> ImportRefusedError:
    """A refusal of the generic import, saying why the generic import read the folder at all."""
    return ImportRefusedError(f"{err} (model_type {kind!r} has no module in model/hf/families/: read by the generic "
                              "import)")


def refusing(kind: str, pairs):
    """The generic import's (name, tensor) pairs, each of its refusals saying why the generic import read them."""
    try:
        yield from pairs
    except ImportRefusedError as err:
        raise generic_refusal(kind, err) from None


def slow_source(folder: Path) -> Path | None:
    """The slow tokenizer file the artifact's tokenizer.json is built from: vocab.json (with merges.txt) or
    tokenizer.model; None when there is neither."""
    if (folder / VOCAB).is_file() and (folder / MERGES).is_file():
        return folder / VOCAB
    return folder / SPM if (folder / SPM).is_file() else None


def tokenizer_text(folder: Path, model_type: str | None) -> str | None:
    """The tokenizer.json to build from the folder's slow tokenizer files; None when it has its own."""
    if (folder / TOKENIZER).is_file():
        return None
    source = slow_source(folder)
    if source is None:
        raise ImportRefusedError(f"{folder / TOKENIZER}: missing, and no slow tokenizer files to build it from "
                                 f"({VOCAB} + {MERGES}, or {SPM}); the artifact carries the model's own tokenizer")
    return byte_level_bpe(folder, model_type) if source.name == VOCAB else sentencepiece(folder, model_type)


def named_tokens(folder: Path, model_type: str | None) -> dict[str, str]:
    """The named special tokens (bos_token, eos_token, ...) of the tokenizer transformers loads from the folder, as
    strings (a chat template is rendered with them): those of the tokenizer built from its slow files, the class's
    defaults where the config names none (GPT2Tokenizer's <|endoftext|>, LlamaTokenizer's <s> and </s>, ...); beside
    the folder's own tokenizer.json, the config's and special_tokens_map.json's, read as transformers reads them."""
    source = None if (folder / TOKENIZER).is_file() else slow_source(folder)
    if source is None:
        return bpe_named_tokens(folder, {})
    if source.name == VOCAB:
        return bpe_named_tokens(folder, GPT2_DEFAULTS)
    return spm_named_tokens(folder, model_type)


def check_tokenizer(folder: Path, cfg: ModelConfig, model_type: str | None = None) -> tuple[Path, int]:
    """The tokenizer.json the artifact carries and its vocabulary size: the folder's own, or one built from its
    slow tokenizer files into a temporary folder (removed when the process ends)."""
    path = folder / TOKENIZER
    text = tokenizer_text(folder, model_type)
    if text is not None:
        built = Path(tempfile.mkdtemp(prefix="posenc-tokenizer-"))
        atexit.register(shutil.rmtree, built, ignore_errors=True)
        path = built / TOKENIZER
        path.write_text(text, encoding="utf-8")
    size = tokenizer_vocab_size(path)
    if size > cfg.vocab_size:
        where = folder / TOKENIZER if text is None else slow_source(folder)
        raise ImportRefusedError(f"{where}: vocabulary of {size} ids exceeds the model's {cfg.vocab_size} embedding "
                                 "rows")
    return path, size


def import_folder(folder: str | Path, rope_scaling: dict[str, Any] | None = None) -> tuple[Transformer, dict[str, Any]]:
    """The model (eval mode) and what the artifact records: tokenizer file and vocabulary, source, family.
    rope_scaling: a rope_parameters object that replaces the folder's (posenc-export --rope-scaling)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ImportRefusedError(f"{folder}: not a folder")
    cfg, mapping, data = read_config(folder, rope_scaling)
    tokenizer, tokenizer_vocab = check_tokenizer(folder, cfg, data.get("model_type"))
    weights = Weights(folder)

    with torch.device("meta"):
        model = Transformer(cfg)
    model = model.to_empty(device="cpu")
    model.pos = build_variant(cfg)  # non-persistent buffers (ALiBi's slopes) are computed, not loaded
    params = dict(model.named_parameters())
    filled: set[str] = set()
    with torch.no_grad():
        mapped = mapping(cfg, weights)
        for name, tensor in mapped if data["model_type"] in FAMILIES else refusing(data["model_type"], mapped):
            target = params.get(name)
            if target is None or target.shape != tensor.shape:  # a mapping bug, not bad input
                raise AssertionError(f"{name}: {tuple(tensor.shape)} does not fit the model")
            target.copy_(tensor)
            filled.add(name)
        if cfg.tie_head:  # some files store the tied head anyway: it must be the embedding
            for head in HEAD_NAMES:
                if weights.has(head) and not torch.equal(weights.take(head, tuple(weights.shape(head))),
                                                         model.tok.weight):
                    raise ImportRefusedError(f"{weights.where[head]}: {head} differs from the input embedding but "
                                             "tie_word_embeddings is true")
    missing = sorted(set(params) - filled)
    if missing:
        raise AssertionError(f"mapping left parameters unset: {', '.join(missing)}")
    unused = [n for n in weights.unused() if not n.endswith(IGNORED_SUFFIXES)]
    if unused:
        how = "generic" if data["model_type"] not in FAMILIES else data["model_type"]
        raise ImportRefusedError(f"{weights.where[unused[0]]}: tensor {unused[0]} is not used by the "
                                 f"{how} import ({len(unused)} unused; a weight posenc does not "
                                 "carry would silently change the model)")
    info = {"family": data["model_type"], "generic": data["model_type"] not in FAMILIES, "folder": str(folder),
            "tokenizer": tokenizer,
            "tokenizer_vocab_size": tokenizer_vocab, "architectures": data.get("architectures"),
            "bos_token_id": data.get("bos_token_id"), "eos_token_id": data.get("eos_token_id"),
            "max_model_len": served_length(cfg)}
    return model.eval(), info
