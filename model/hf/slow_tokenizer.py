"""A Hub folder's slow tokenizer files -> the tokenizer.json the artifact carries, built with the `tokenizers`
library as transformers builds its tokenizer from the same files (no transformers needed).

Byte-level BPE (`vocab.json` + `merges.txt`: GPT-2, OPT, GPT-J folders; transformers' GPT2Tokenizer): the BPE model
with GPT-2's byte-level pre-tokenizer (`add_prefix_space` from the config) and decoder; the special tokens
`tokenizer_config.json` names (bos, eos and unk default to `<|endoftext|>`, as GPT2Tokenizer's do), or
`special_tokens_map.json` when the config has no `added_tokens_decoder`; every added token with its flags; and a
post-processor that puts bos before (`add_bos_token`: OPT's folders put `</s>` there) and eos after
(`add_eos_token`) every encoding.  SentencePiece (`tokenizer.model`) is model/hf/sentencepiece.py's.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

from model.errors import ImportRefusedError

VOCAB, MERGES = "vocab.json", "merges.txt"
CONFIG, SPECIAL_MAP, ADDED = "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json"
# transformers' named special tokens, in the order it adds them (SPECIAL_TOKENS_ATTRIBUTES)
NAMED = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
GPT2_DEFAULTS = {"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>", "unk_token": "<|endoftext|>"}
# the classes whose tokenizer is GPT-2's byte-level BPE over vocab.json + merges.txt; model types whose
# AutoTokenizer is GPT2Tokenizer when the folder names no class
BYTE_LEVEL_CLASSES = ("GPT2Tokenizer", "GPT2TokenizerFast")
BYTE_LEVEL_MODEL_TYPES = ("gpt2", "opt", "gptj")
FLAGS = ("single_word", "lstrip", "rstrip", "normalized", "special")


def _json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as err:
        raise ImportRefusedError(f"{path}: not valid JSON ({err})") from None
    if not isinstance(data, dict):
        raise ImportRefusedError(f"{path}: not a JSON object")
    return data


def token(value: Any, where: str, special: bool | None = None) -> AddedToken | None:
    """An AddedToken from a config value (a string, or a dict with `content` and flags, `__type` ignored), None for
    null; special: force the flag (a named special token is special whatever the dict says)."""
    if value is None:
        return None
    if isinstance(value, str):
        flags: dict[str, Any] = {}
        content = value
    elif isinstance(value, dict) and isinstance(value.get("content"), str):
        content = value["content"]
        flags = {k: value[k] for k in FLAGS if k in value}
        if not all(isinstance(v, bool) for v in flags.values()):
            raise ImportRefusedError(f"{where}: flags of {content!r} must be true or false")
    else:
        raise ImportRefusedError(f"{where}: {value!r} is not a token (a string or an object with content)")
    if special is not None:
        flags["special"] = special
    # transformers' AddedToken: a special token is matched on the raw text unless it says otherwise
    flags.setdefault("normalized", not flags.get("special", False))
    return AddedToken(content, **flags)


def _flag(config: dict[str, Any], name: str, default: bool, where: Path) -> bool:
    value = config.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ImportRefusedError(f"{where}: {name} = {value!r} must be true or false")
    return value


def special_tokens(folder: Path, config: dict[str, Any], defaults: dict[str, str]) -> tuple[
        dict[int, AddedToken], dict[str, AddedToken], list[AddedToken]]:
    """(added tokens by id, named special tokens, extra special tokens) as transformers reads them: the config's
    added_tokens_decoder, or else special_tokens_map.json over the config and added_tokens.json's ids."""
    where = folder / CONFIG
    by_id: dict[int, AddedToken] = {}
    named_values = {k: config.get(k, defaults.get(k)) for k in NAMED}
    extra_values = list(config.get("additional_special_tokens") or []) + list(
        v for v in (config.get("extra_special_tokens") or []) if not isinstance(config.get("extra_special_tokens"),
                                                                               dict))
    decoder = config.get("added_tokens_decoder")
    if decoder is not None:
        if not isinstance(decoder, dict):
            raise ImportRefusedError(f"{where}: added_tokens_decoder must be an object of id: token")
        for key, value in decoder.items():
            if not str(key).isdigit():
                raise ImportRefusedError(f"{where}: added_tokens_decoder key {key!r} is not a token id")
            by_id[int(key)] = token(value, str(where))
    else:
        for key, value in _json(folder / SPECIAL_MAP).items():
            if key in NAMED:
                named_values[key] = value
            elif key in ("additional_special_tokens", "extra_special_tokens") and isinstance(value, list):
                extra_values += [v for v in value if v not in extra_values]
        names = {str(v["content"] if isinstance(v, dict) else v) for v in
                 [*named_values.values(), *extra_values] if v is not None}
        for content, index in _json(folder / ADDED).items():
            if type(index) is not int or index < 0:
                raise ImportRefusedError(f"{folder / ADDED}: id of {content!r} must be a token id, got {index!r}")
            by_id[index] = AddedToken(content, normalized=content not in names, special=content in names)
    by_content = {t.content: t for t in by_id.values()}
    named: dict[str, AddedToken] = {}
    for key in NAMED:
        value = token(named_values[key], f"{where}: {key}", special=True)
        if value is not None:
            named[key] = by_content.get(value.content, value)
    extra = [t for t in (token(v, f"{where}: additional_special_tokens", special=True) for v in extra_values) if t]
    return by_id, named, extra


def named_tokens(folder: Path, defaults: dict[str, str]) -> dict[str, str]:
    """The named special tokens (bos_token, ...) transformers' tokenizer of the folder has (its special_tokens_map):
    the config's and special_tokens_map.json's as special_tokens() reads them, `defaults` (the class's) where they
    name none.  A chat template is rendered with them."""
    _, named, _ = special_tokens(folder, _json(folder / CONFIG), defaults)
    return {key: added.content for key, added in named.items()}


def add_tokens(tok: Tokenizer, by_id: dict[int, AddedToken], named: dict[str, AddedToken], extra: list[AddedToken],
               where: Path) -> None:
    """Added tokens in transformers' order: by id, then the named special tokens, then the extra ones; a token new
    to the vocabulary takes the next id, which must be the id the config gives it."""
    for index, added in sorted(by_id.items()):
        (tok.add_special_tokens if added.special else tok.add_tokens)([added])
        got = tok.token_to_id(added.content)
        if got != index:
            raise ImportRefusedError(f"{where}: added token {added.content!r} has id {index}, but the vocabulary "
                                     f"gives it {got}")
    seen = {t.content for t in by_id.values()}
    for added in [*named.values(), *extra]:
        if added.content not in seen:
            (tok.add_special_tokens if added.special else tok.add_tokens)([added])
            seen.add(added.content)


def post_processor(tok: Tokenizer, named: dict[str, AddedToken], bos: bool, eos: bool):
    """transformers' update_post_processor: bos before and eos after each sequence, as the config asks."""
    pieces = [(named.get("bos_token"), bos), (named.get("eos_token"), eos)]
    (b, add_b), (e, add_e) = [(t.content if t is not None else None, want and t is not None) for t, want in pieces]
    single = f"{f'{b}:0 ' if add_b else ''}$A:0{f' {e}:0' if add_e else ''}"
    pair = f"{single}{f' {b}:1' if add_b else ''} $B:1{f' {e}:1' if add_e else ''}"
    special = [(t, tok.token_to_id(t)) for t, want in ((b, add_b), (e, add_e)) if want]
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=list(dict.fromkeys(special)))


def byte_level_bpe(folder: Path, model_type: str | None) -> str:
    """tokenizer.json text for a folder with vocab.json + merges.txt (GPT2Tokenizer's byte-level BPE)."""
    where = folder / CONFIG
    config = _json(where)
    kind = config.get("tokenizer_class")
    if kind is None and model_type not in BYTE_LEVEL_MODEL_TYPES:
        raise ImportRefusedError(f"{folder / VOCAB}: {CONFIG} names no tokenizer_class and model_type "
                                 f"{model_type!r} does not use GPT2Tokenizer (no tokenizer.json to read instead)")
    if kind is not None and kind not in BYTE_LEVEL_CLASSES:
        raise ImportRefusedError(f"{where}: tokenizer_class {kind!r} is not built from {VOCAB} + {MERGES} here "
                                 f"(only {', '.join(BYTE_LEVEL_CLASSES)}); a folder with its tokenizer.json is read "
                                 "as it is")
    try:
        vocab, merges = models.BPE.read_file(str(folder / VOCAB), str(folder / MERGES))
        tok = Tokenizer(models.BPE(vocab, merges, fuse_unk=False))
    except Exception as err:  # the library's own parse error names the line
        raise ImportRefusedError(f"{folder / VOCAB} + {MERGES}: not a BPE vocabulary and merges list ({err})") from None
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=_flag(config, "add_prefix_space", False, where))
    tok.decoder = decoders.ByteLevel()
    by_id, named, extra = special_tokens(folder, config, GPT2_DEFAULTS)
    add_tokens(tok, by_id, named, extra, where)
    tok.post_processor = post_processor(tok, named, _flag(config, "add_bos_token", False, where),
                                        _flag(config, "add_eos_token", False, where))
    return tok.to_str()
