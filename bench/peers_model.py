"""The peer benchmark's model: a LLaMA with SmolLM-135M's shape and random weights (fp32), saved as a Hugging Face
folder every engine converts from, its tokenizer, the prompts, and transformers' greedy tokens (the reference).

The tokenizer is a byte-level BPE with the model's whole vocabulary (49,152 ids), trained here on CPython's
documentation and standard library sources, so every id the model can produce decodes to text in every engine.
"""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import numpy as np

SHAPE = {"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
         "num_key_value_heads": 3, "vocab_size": 49152, "max_position_embeddings": 2048, "rms_norm_eps": 1e-5,
         "rope_theta": 10000.0, "tie_word_embeddings": True, "bos_token_id": 0, "eos_token_id": 0}
PROMPT_TOKENS, NEW_TOKENS, N_PROMPTS = 128, 64, 32
# new prompt tokens one call may take, in every engine that has the setting (posenc --batch-tokens, OpenVINO
# GenAI's max_num_batched_tokens, vLLM's --max-num-batched-tokens): the 32 prompts in one call
BATCH_TOKENS = PROMPT_TOKENS * N_PROMPTS
SEED = 0


def corpus(limit: int = 12_000_000) -> list[str]:
    """pydoc's topics and the standard library's sources, in a fixed order, up to `limit` characters."""
    from pydoc_data.topics import topics

    lib = Path(sysconfig.get_paths()["stdlib"])
    texts, size = list(topics.values()), 0
    for p in sorted(lib.rglob("*.py")):
        if "site-packages" in p.parts or size > limit:
            continue
        texts.append(p.read_text(errors="replace"))
        size += len(texts[-1])
    return texts


def tokenizer_json(vocab: int) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<|endoftext|>"], show_progress=False)
    tok.train_from_iterator(corpus(), trainer)
    if tok.get_vocab_size() != vocab:
        raise RuntimeError(f"the BPE reached {tok.get_vocab_size()} ids, not {vocab}: the corpus is too small")
    return tok.to_str()


def prompts() -> np.ndarray:
    """N_PROMPTS prompts of PROMPT_TOKENS ids (seeded; ids that the tokenizer's merges produce: >= 257)."""
    return np.random.default_rng(SEED).integers(257, SHAPE["vocab_size"], (N_PROMPTS, PROMPT_TOKENS), dtype=np.int64)


def make_folder(folder: Path) -> dict:
    """folder <- config.json, model.safetensors, tokenizer.json (+ tokenizer_config.json, generation_config.json);
    a folder built before with the same shape is reused.  Returns the stamp (parameters, shape)."""
    stamp = folder / "posenc-peers.json"
    if stamp.is_file() and (folder / "model.safetensors").is_file():
        done = json.loads(stamp.read_text())
        if done.get("shape") == SHAPE and done.get("seed") == SEED:
            return done
    import torch
    import transformers as tf

    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(SEED)
    model = tf.LlamaForCausalLM(tf.LlamaConfig(**SHAPE, torch_dtype="float32")).eval()
    model.generation_config.do_sample = False
    model.save_pretrained(folder, safe_serialization=True)
    (folder / "tokenizer.json").write_text(tokenizer_json(SHAPE["vocab_size"]))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>",
        "unk_token": "<|endoftext|>", "add_bos_token": False, "add_prefix_space": False,
        "model_max_length": SHAPE["max_position_embeddings"]}))
    done = {"shape": SHAPE, "seed": SEED, "parameters": sum(p.numel() for p in model.parameters())}
    stamp.write_text(json.dumps(done))
    return done


def reference_tokens(folder: Path, ids: np.ndarray, new_tokens: int = NEW_TOKENS, threads: int = 2) -> list[list[int]]:
    """transformers' greedy generate() on each prompt (one at a time, no padding): the tokens every engine must
    reproduce.  Cached beside the weights."""
    cache = folder / f"reference-{len(ids)}x{ids.shape[1]}-{new_tokens}.json"
    if cache.is_file():
        return json.loads(cache.read_text())
    import torch
    import transformers as tf

    torch.set_num_threads(threads)
    model = tf.AutoModelForCausalLM.from_pretrained(folder).eval()
    out = []
    with torch.inference_mode():
        for row in ids:
            t = torch.from_numpy(row[None])
            seq = model.generate(t, attention_mask=torch.ones_like(t), max_new_tokens=new_tokens,
                                 min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
            out.append(seq[0, ids.shape[1]:].tolist())
    cache.write_text(json.dumps(out))
    return out
