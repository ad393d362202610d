"""A Hub folder's SentencePiece model (`tokenizer.model`) -> the tokenizer.json the artifact carries, built with the
`tokenizers` library as transformers 5 builds its tokenizer from the same folder (no transformers, sentencepiece
or protobuf needed: the model file is read with a small reader of protobuf's wire format).

Fields read, by their numbers in sentencepiece's sentencepiece_model.proto: ModelProto pieces = 1 (SentencePiece:
piece = 1, score = 2, type = 3 with NORMAL 1, UNKNOWN 2, CONTROL 3, USER_DEFINED 4, UNUSED 5, BYTE 6), trainer_spec =
2 (model_type = 3 with UNIGRAM 1, BPE 2; treat_whitespace_as_suffix = 24; byte_fallback = 35; unk/bos/eos/pad ids
40-43; unk/bos/eos pieces 45-47), normalizer_spec = 3 (name = 1, precompiled_charsmap = 2, add_dummy_prefix = 3,
remove_extra_whitespaces = 4, escape_whitespaces = 5, normalization_rule_tsv = 6); absent fields take the proto's
defaults.

transformers derives three different tokenizers from a BPE tokenizer.model, by the class AutoTokenizer picks:
- LlamaTokenizer (`tokenizer_class` LlamaTokenizer in a `llama` folder): every piece in the vocabulary, merges ranked
  by the merged piece's id, byte fallback, a Metaspace pre-tokenizer that puts "▁" before the first chunk of text
  (`legacy: false`, the default) or before every chunk between special tokens (`legacy: true`), nothing when
  `add_prefix_space` is false; the decoder turns "▁" into spaces, fuses byte pieces and strips one leading space.
- GemmaTokenizer (a `gemma` folder): the same vocabulary and merges, spaces replaced by "▁" and no prefix, a decoder
  that strips nothing; `<bos>`, `<eos>`, `<pad>`, `<mask>` are its default special tokens.
- the generic backend (Mistral's and Phi-3's folders, and a `llama` folder that names no class): the model file's
  own settings: merges of normal pieces ranked by score, byte fallback as the file says, user-defined pieces kept
  whole, `add_dummy_prefix`, `remove_extra_whitespaces` (spaces only) and `escape_whitespaces` as normalizer steps.
Control and user-defined pieces are added tokens (control ones special); bos and eos go before and after each
encoding as `add_bos_token` / `add_eos_token` say (both off unless the config turns them on). A model file or
folder setting outside these (a unigram model, a normalization rule or charsmap, another tokenizer class) is
refused, naming the field.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

from model.errors import ImportRefusedError
from model.hf.slow_tokenizer import CONFIG, SPECIAL_MAP, _flag, _json, add_tokens, post_processor, special_tokens

SPM = "tokenizer.model"
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
UNIGRAM, BPE = 1, 2
# (model_type, tokenizer_class without "Fast") -> the tokenizer transformers 5's AutoTokenizer builds for it
KINDS = {("llama", "LlamaTokenizer"): "llama", ("llama", None): "generic", ("mistral", "LlamaTokenizer"): "generic",
         ("mistral", None): "generic", ("phi3", "LlamaTokenizer"): "generic", ("phi3", None): "generic",
         ("gemma", "GemmaTokenizer"): "gemma", ("gemma", None): "gemma"}
DEFAULTS = {"llama": {"unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>"},
            "gemma": {"unk_token": "<unk>", "bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>",
                      "mask_token": "<mask>"}}


@dataclass
class Spm:
    """What of a ModelProto the tokenizer depends on (proto2 defaults where a field is absent)."""

    pieces: list[tuple[str, float, int]] = field(default_factory=list)  # (piece, score, type)
    model_type: int = UNIGRAM
    byte_fallback: bool = False
    suffix: bool = False  # treat_whitespace_as_suffix
    ids: dict[str, int] = field(default_factory=lambda: {"unk": 0, "bos": 1, "eos": 2, "pad": -1})
    names: dict[str, str] = field(default_factory=lambda: {"unk": "<unk>", "bos": "<s>", "eos": "</s>"})
    normalizer: str = ""  # normalizer_spec.name
    charsmap: bytes = b""
    rules: str = ""  # normalization_rule_tsv
    dummy_prefix: bool = True
    extra_whitespaces: bool = True  # remove_extra_whitespaces
    escape: bool = True  # escape_whitespaces


def _varint(data: bytes, pos: int, where: Path) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(data) or shift > 63:
            raise ImportRefusedError(f"{where}: not a SentencePiece model (a varint runs past the data)")
        byte = data[pos]
        value |= (byte & 0x7F) << shift
        pos += 1
        shift += 7
        if not byte & 0x80:
            return value, pos


def fields(data: bytes, where: Path):
    """(field number, value) of each field in a protobuf message: an int for varints and fixed32/fixed64 (their raw
    bits), bytes for length-delimited fields."""
    pos = 0
    while pos < len(data):
        key, pos = _varint(data, pos, where)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _varint(data, pos, where)
        elif wire in (1, 5):
            size = 8 if wire == 1 else 4
            if pos + size > len(data):
                raise ImportRefusedError(f"{where}: not a SentencePiece model (a fixed field runs past the data)")
            value, pos = int.from_bytes(data[pos:pos + size], "little"), pos + size
        elif wire == 2:
            size, pos = _varint(data, pos, where)
            if pos + size > len(data):
                raise ImportRefusedError(f"{where}: not a SentencePiece model (field {number} runs past the data)")
            value, pos = data[pos:pos + size], pos + size
        else:
            raise ImportRefusedError(f"{where}: not a SentencePiece model (wire type {wire} in field {number})")
        yield number, value


def _int32(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value  # negative int32s are sign-extended to 64 bits


def _text(value, where: Path, name: str) -> str:
    try:
        return bytes(value).decode("utf-8")
    except (TypeError, UnicodeDecodeError):
        raise ImportRefusedError(f"{where}: {name} is not UTF-8 text") from None


def read_model(path: Path) -> Spm:
    """The SentencePiece ModelProto in `path`."""
    try:
        data = path.read_bytes()
    except OSError as err:
        raise ImportRefusedError(f"{path}: unreadable ({err})") from None
    spm = Spm()
    for number, value in fields(data, path):
        if number == 1 and isinstance(value, bytes):  # pieces
            piece, score, kind = None, 0.0, NORMAL
            for n, v in fields(value, path):
                if n == 1 and isinstance(v, bytes):
                    piece = _text(v, path, "a piece")
                elif n == 2 and isinstance(v, int):
                    score = struct.unpack("<f", v.to_bytes(4, "little"))[0]
                elif n == 3 and isinstance(v, int):
                    kind = v
            if piece is None:
                raise ImportRefusedError(f"{path}: piece {len(spm.pieces)} has no text")
            spm.pieces.append((piece, score, kind))
        elif number == 2 and isinstance(value, bytes):  # trainer_spec
            for n, v in fields(value, path):
                if n == 3 and isinstance(v, int):
                    spm.model_type = v
                elif n == 24 and isinstance(v, int):
                    spm.suffix = bool(v)
                elif n == 35 and isinstance(v, int):
                    spm.byte_fallback = bool(v)
                elif 40 <= n <= 43 and isinstance(v, int):
                    spm.ids[("unk", "bos", "eos", "pad")[n - 40]] = _int32(v)
                elif 45 <= n <= 47 and isinstance(v, bytes):
                    spm.names[("unk", "bos", "eos")[n - 45]] = _text(v, path, f"trainer_spec field {n}")
        elif number == 3 and isinstance(value, bytes):  # normalizer_spec
            for n, v in fields(value, path):
                if n == 1 and isinstance(v, bytes):
                    spm.normalizer = _text(v, path, "normalizer_spec.name")
                elif n == 2 and isinstance(v, bytes):
                    spm.charsmap = v
                elif n in (3, 4, 5) and isinstance(v, int):
                    setattr(spm, {3: "dummy_prefix", 4: "extra_whitespaces", 5: "escape"}[n], bool(v))
                elif n == 6 and isinstance(v, bytes):
                    spm.rules = _text(v, path, "normalizer_spec.normalization_rule_tsv")
    if not spm.pieces:
        raise ImportRefusedError(f"{path}: not a SentencePiece model (no pieces)")
    return spm


def check(spm: Spm, where: Path, kind: str) -> None:
    """Refuse what the built tokenizer would not reproduce."""
    if spm.model_type != BPE:
        name = {UNIGRAM: "UNIGRAM", 3: "WORD", 4: "CHAR"}.get(spm.model_type, str(spm.model_type))
        raise ImportRefusedError(f"{where}: trainer_spec.model_type {name} is not built here (only BPE, as LLaMA, "
                                 "Mistral and Gemma use)")
    if spm.charsmap or spm.rules:
        raise ImportRefusedError(f"{where}: normalizer_spec {spm.normalizer or 'custom'!r} has a normalization rule "
                                 "(precompiled_charsmap / normalization_rule_tsv) that is not reproduced here (only "
                                 "the identity normalizer)")
    if spm.suffix:
        raise ImportRefusedError(f"{where}: trainer_spec.treat_whitespace_as_suffix is not reproduced here")
    if kind != "generic" and not spm.byte_fallback:
        raise ImportRefusedError(f"{where}: trainer_spec.byte_fallback is false, but the {kind} tokenizer falls back "
                                 "to byte pieces")
    seen: set[str] = set()
    for piece, _, _ in spm.pieces:
        if piece in seen:
            raise ImportRefusedError(f"{where}: piece {piece!r} occurs twice")
        seen.add(piece)


def merges_by_id(vocab: dict[str, int]) -> list[tuple[str, str]]:
    """Every split of a piece into two pieces, ranked by the merged piece's id, then the left part's length (the
    merges transformers' LlamaTokenizer and GemmaTokenizer take from a tokenizer.model)."""
    ranked = [(index, i, piece[:i], piece[i:]) for piece, index in vocab.items() for i in range(1, len(piece))
              if piece[:i] in vocab and piece[i:] in vocab]
    return [(left, right) for _, _, left, right in sorted(ranked)]


def merges_by_score(spm: Spm) -> list[tuple[str, str]]:
    """Splits of a normal piece into two normal pieces, ranked by the merged piece's score (highest first), then its
    id: SentencePiece's BPE order (the generic backend's)."""
    normal = {p: (score, i) for i, (p, score, kind) in enumerate(spm.pieces) if kind == NORMAL}
    ranked = [(-score, index, p[:i], p[i:]) for p, (score, index) in normal.items() for i in range(1, len(p))
              if p[:i] in normal and p[i:] in normal]
    return [(left, right) for _, _, left, right in sorted(ranked)]


def backend(spm: Spm, kind: str, legacy: bool, prefix: bool, unk: str) -> Tokenizer:
    """The model, normalizer, pre-tokenizer and decoder of `kind`'s tokenizer (no added tokens yet); unk: the
    unknown token GemmaTokenizer names."""
    vocab = {piece: i for i, (piece, _, _) in enumerate(spm.pieces)}
    replace = decoders.Replace("▁", " ")
    if kind == "llama":
        tok = Tokenizer(models.BPE(vocab, merges_by_id(vocab), fuse_unk=True, byte_fallback=True))
        scheme = ("first" if not legacy else "always") if prefix else "never"
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme=scheme, split=False)
        tail = [decoders.Strip(" ", 1, 0)] if prefix else []
        tok.decoder = decoders.Sequence([replace, decoders.ByteFallback(), decoders.Fuse(), *tail])
        return tok
    if kind == "gemma":
        tok = Tokenizer(models.BPE(vocab, merges_by_id(vocab), unk_token=unk, fuse_unk=True, byte_fallback=True))
        tok.normalizer = normalizers.Replace(" ", "▁")
        tok.pre_tokenizer = pre_tokenizers.Split(" ", "merged_with_previous")
        tok.decoder = decoders.Sequence([replace, decoders.ByteFallback(), decoders.Fuse()])
        return tok
    user = [p for p, _, k in spm.pieces if k == USER_DEFINED]
    tok = Tokenizer(models.BPE(vocab, merges_by_score(spm), unk_token=spm.names["unk"], fuse_unk=True,
                               byte_fallback=spm.byte_fallback, ignore_merges=bool(user)))
    steps = []
    if spm.extra_whitespaces:  # SentencePiece collapses and trims spaces only, not other whitespace
        steps += [normalizers.Replace(Regex(r"\A +| +\z"), ""), normalizers.Replace(Regex(" {2,}"), " ")]
    if spm.escape:
        steps.append(normalizers.Replace(" ", "▁"))
    if spm.dummy_prefix and legacy:  # Metaspace adds no prefix to text that starts with "▁"; SentencePiece does
        steps.append(normalizers.Replace(Regex(r"\A▁"), "▁▁"))
    tok.normalizer = normalizers.Sequence(steps)
    pre = []
    if spm.dummy_prefix:
        pre.append(pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always" if legacy else "first",
                                            split=False))
    if user:  # SentencePiece emits a user-defined piece whole
        pattern = "|".join(_escape(p) for p in sorted(user, key=len, reverse=True))
        pre.append(pre_tokenizers.Split(Regex(pattern), behavior="isolated"))
    if pre:
        tok.pre_tokenizer = pre_tokenizers.Sequence(pre)
    steps = [replace] + ([decoders.ByteFallback()] if spm.byte_fallback else [])
    if spm.dummy_prefix:
        steps += [decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    elif spm.byte_fallback:
        steps.append(decoders.Fuse())
    tok.decoder = decoders.Sequence(steps)
    return tok


def _escape(text: str) -> str:
    """`text` as a regular expression (Oniguruma) that matches it literally."""
    return "".join(f"\\{c}" if c in r"\^$.|?*+()[]{}-/" else c for c in text)


def kind_of(folder: Path, model_type: str | None) -> tuple[dict, str]:
    """(tokenizer_config.json, the kind of tokenizer transformers builds from the folder's tokenizer.model)."""
    where = folder / CONFIG
    config = _json(where)
    named_class = config.get("tokenizer_class")
    short = named_class.removesuffix("Fast") if isinstance(named_class, str) else named_class
    kind = KINDS.get((model_type, short))
    if kind is None:
        supported = ", ".join(f"{m} with {c or 'no class'}" for m, c in KINDS)
        raise ImportRefusedError(f"{where if named_class else folder / 'config.json'}: tokenizer_class "
                                 f"{named_class!r} with model_type {model_type!r} is not built from {SPM} here "
                                 f"(supported: {supported})")
    return config, kind


def default_tokens(kind: str, spm: Spm) -> dict[str, str]:
    """The named special tokens of `kind`'s tokenizer where the config names none: its class's defaults, or for the
    generic backend the model's own unk, bos and eos pieces."""
    if kind == "generic":
        return {f"{n}_token": spm.names[n] for n in ("bos", "eos", "unk") if spm.ids[n] >= 0}
    return DEFAULTS.get(kind, {})


def named_tokens(folder: Path, model_type: str | None) -> dict[str, str]:
    """The named special tokens (bos_token, ...) of the tokenizer built from the folder's tokenizer.model, as
    transformers' tokenizer has them (its special_tokens_map): the strings a chat template is rendered with."""
    config, kind = kind_of(folder, model_type)
    _, named, _ = special_tokens(folder, config, default_tokens(kind, read_model(folder / SPM)))
    return {key: added.content for key, added in named.items()}


def sentencepiece(folder: Path, model_type: str | None) -> str:
    """tokenizer.json text for a folder whose tokenizer is its tokenizer.model."""
    where, path = folder / CONFIG, folder / SPM
    config, kind = kind_of(folder, model_type)
    spm = read_model(path)
    check(spm, path, kind)
    # transformers reads a legacy of null as false (the generic backend defaults an absent one to true)
    legacy = _flag(config, "legacy", kind == "generic", where) if config.get("legacy", 0) is not None else False
    prefix = _flag(config, "add_prefix_space", True, where)
    if config.get("added_tokens_decoder") is None and any(
            _json(folder / SPECIAL_MAP).get(k) for k in ("additional_special_tokens", "extra_special_tokens")):
        raise ImportRefusedError(f"{folder / SPECIAL_MAP}: additional_special_tokens beside {SPM} are not reproduced "
                                 f"here (name them in {CONFIG})")
    by_id, named, extra = special_tokens(folder, config, default_tokens(kind, spm))
    for index, added in by_id.items():
        if index < len(spm.pieces) and added.content != spm.pieces[index][0]:
            raise ImportRefusedError(f"{where}: added_tokens_decoder names id {index} {added.content!r}, but "
                                     f"{SPM} has {spm.pieces[index][0]!r} there (renamed pieces are not reproduced)")
    unk = named.get("unk_token")
    tok = backend(spm, kind, legacy, prefix, unk.content if unk is not None else "<unk>")
    user = {p for p, _, k in spm.pieces if k == USER_DEFINED}
    if kind == "generic" and user & {t.content for t in extra}:
        raise ImportRefusedError(f"{where}: additional_special_tokens names a user-defined piece of {SPM} "
                                 f"({sorted(user & {t.content for t in extra})[0]!r}), which is not reproduced here")
    # the model's control pieces (special) and user-defined pieces (not special, unless the config names them; the
    # generic backend keeps them whole in its pre-tokenizer instead) follow the config's own extra tokens
    named_extra = {t.content for t in extra}
    extra += [AddedToken(p, normalized=False, special=k == CONTROL) for p, _, k in spm.pieces
              if (k == CONTROL or (k == USER_DEFINED and kind != "generic")) and p not in named_extra]
    if kind == "generic" and spm.dummy_prefix:  # matched on the raw text: each chunk gets its own prefix
        by_id = {i: AddedToken(t.content, single_word=t.single_word, lstrip=t.lstrip, rstrip=t.rstrip,
                               normalized=False, special=t.special) for i, t in by_id.items()}
    add_tokens(tok, by_id, named, extra, where)
    tok.post_processor = post_processor(tok, named, _flag(config, "add_bos_token", False, where),
                                        _flag(config, "add_eos_token", False, where))
    return tok.to_str()
