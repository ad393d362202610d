"""Tiny random-weight Hugging Face models built locally with transformers (from configs: nothing is downloaded),
saved with save_pretrained (safetensors) beside a small BPE tokenizer.json trained here: the independent reference
the importer is checked against."""

from __future__ import annotations

import functools
from pathlib import Path

import torch

VOCAB = 320  # embedding rows; the tokenizer is trained to fewer ids (rows may exceed the tokenizer's vocabulary)
TOKENIZER_VOCAB = 300


@functools.cache
def tokenizer_json() -> str:
    """A byte-level BPE tokenizer trained on CPython's own documentation text, as tokenizer.json text."""
    from pydoc_data.topics import topics

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TOKENIZER_VOCAB, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    text = list(topics.values())[:200]
    tok.train_from_iterator(text, trainer)
    return tok.to_str()


def hf_config(family: str):
    import transformers as tf

    common = {"vocab_size": VOCAB, "bos_token_id": 0, "eos_token_id": 0}
    if family == "gpt2":
        return tf.GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=256, **common)
    if family == "gpt_neox":
        return tf.GPTNeoXConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                                max_position_embeddings=256, rotary_pct=0.25, rotary_emb_base=10000,
                                use_parallel_residual=True, tie_word_embeddings=False, **common)
    if family == "llama":
        return tf.LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                              head_dim=24, intermediate_size=96, max_position_embeddings=256, rms_norm_eps=1e-6,
                              rope_theta=500.0, tie_word_embeddings=False, **common)
    if family == "bloom":
        return tf.BloomConfig(hidden_size=64, n_layer=2, n_head=4, **common)
    raise ValueError(family)


def perturb(model: torch.nn.Module, seed: int, scale: float = 0.15) -> None:
    """Weights far from init (attention far from uniform; norms' scales and biases non-trivial)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if p.dim() == 1 and ("norm" in name or "ln" in name) and name.endswith("weight"):
                p.copy_(1 + 0.2 * noise)
            else:
                p.copy_(scale * noise)


def save_family(family: str, folder: Path, seed: int = 0):
    """folder <- config.json, model.safetensors, tokenizer.json; returns the transformers model (eager, eval)."""
    import transformers as tf

    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(hf_config(family), attn_implementation="eager").eval()
    perturb(model, seed)
    model.save_pretrained(folder, safe_serialization=True)
    tok = tf.PreTrainedTokenizerFast(tokenizer_object=__import__("tokenizers").Tokenizer.from_str(tokenizer_json()))
    tok.save_pretrained(folder)
    return model
