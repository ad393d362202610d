"""Small real tokenizers of the three kinds served models use, trained here with the `tokenizers` library on
CPython's own documentation text (nothing downloaded): a SentencePiece-style BPE (Metaspace, byte fallback, the
Llama-2 decoder; "sentencepiece-bos" is the same with Llama-2's post-processor, which puts <s> before every
encoding), a GPT-2-style ByteLevel BPE, and a BERT-style WordPiece."""

from __future__ import annotations

import functools
import json

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

KINDS = ["sentencepiece", "sentencepiece-bos", "bytelevel", "wordpiece"]


def _text() -> list[str]:
    from pydoc_data.topics import topics

    return list(topics.values())[:200]


@functools.cache
def sentencepiece(vocab: int = 420) -> str:
    """Llama-2's layout: <unk> <s> </s>, the 256 byte pieces <0x00>..<0xFF>, then BPE pieces over ASCII with ▁ for
    a space; characters outside the vocabulary fall back to their UTF-8 bytes."""
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=True)
    trainer = trainers.BpeTrainer(vocab_size=vocab - 256, special_tokens=["<unk>", "<s>", "</s>"],
                                  limit_alphabet=60, show_progress=False)
    tok.train_from_iterator(_text(), trainer)
    spec = json.loads(tok.to_str())
    learned = sorted(spec["model"]["vocab"].items(), key=lambda kv: kv[1])
    specials = [(p, i) for p, i in learned if i < 3]
    rest = [p for p, i in learned if i >= 3]
    vocab_map = {p: i for p, i in specials}
    for b in range(256):
        vocab_map[f"<0x{b:02X}>"] = len(vocab_map)
    for p in rest:
        vocab_map[p] = len(vocab_map)
    spec["model"]["vocab"] = vocab_map
    spec["model"]["byte_fallback"] = True
    for added in spec["added_tokens"]:
        added["id"] = vocab_map[added["content"]]
    spec["decoder"] = json.loads(decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                                    decoders.Fuse(), decoders.Strip(" ", 1, 0)]).__getstate__())
    spec["post_processor"] = None
    # served as Llama-2's tokenizer.json is: the spaces become ▁ in the normalizer, no pre-tokenizer
    spec["normalizer"] = json.loads(normalizers.Sequence([normalizers.Prepend("▁"),
                                                          normalizers.Replace(" ", "▁")]).__getstate__())
    spec["pre_tokenizer"] = None
    return Tokenizer.from_str(json.dumps(spec)).to_str()


@functools.cache
def sentencepiece_bos() -> str:
    """sentencepiece() as Llama-2's tokenizer.json serves it: encode() starts every sequence with <s>."""
    spec = json.loads(sentencepiece())
    spec["post_processor"] = json.loads(processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", spec["model"]["vocab"]["<s>"])]).__getstate__())
    return Tokenizer.from_str(json.dumps(spec)).to_str()


@functools.cache
def bytelevel(vocab: int = 300) -> str:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_text(), trainer)
    return tok.to_str()


@functools.cache
def wordpiece(vocab: int = 300) -> str:
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=False)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=True)
    trainer = trainers.WordPieceTrainer(vocab_size=vocab, special_tokens=["[UNK]", "[SEP]"], show_progress=False)
    tok.train_from_iterator(_text() + ["中文 漢字 日本語 🙂 é ü"], trainer)
    return tok.to_str()


def tokenizer_json(kind: str) -> str:
    return {"sentencepiece": sentencepiece, "sentencepiece-bos": sentencepiece_bos, "bytelevel": bytelevel,
            "wordpiece": wordpiece}[kind]()


def save_model(family: str, kind: str, folder, seed: int = 0, eos: list[int] | None = None):
    """A tiny random transformers model of `family` with a tokenizer of `kind`, saved as a Hugging Face folder
    (config.json, generation_config.json, model.safetensors, tokenizer.json); returns the model (eager, eval).
    eos: generation_config.json's eos_token_id (a list), config.json keeping its one id."""
    import torch
    import transformers as tf

    from tests.hf.helpers import hf_config, perturb

    text = tokenizer_json(kind)
    tok = Tokenizer.from_str(text)
    cfg = hf_config(family)
    cfg.vocab_size = max(cfg.vocab_size, tok.get_vocab_size())
    special = "</s>" if kind.startswith("sentencepiece") else "<|endoftext|>" if kind == "bytelevel" else "[SEP]"
    bos = "<s>" if kind == "sentencepiece-bos" else special
    cfg.eos_token_id, cfg.bos_token_id = tok.token_to_id(special), tok.token_to_id(bos)
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
    perturb(model, seed)
    model.generation_config.eos_token_id = eos if eos is not None else cfg.eos_token_id
    model.generation_config.pad_token_id = cfg.eos_token_id
    model.save_pretrained(folder, safe_serialization=True)
    tf.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=special, bos_token=bos).save_pretrained(folder)
    return model
