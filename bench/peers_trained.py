"""The model the 8-bit and 4-bit forms' accuracy is judged on (bench/peers_accuracy.py): a LLaMA trained here, saved
as a Hugging Face folder that every engine converts with the same tools and options as the peer model.

The peer model's weights are random, so its next-token scores are near ties everywhere and a quantized form's top-1
agreement would say little; this one is trained on the first 90% of the built-in corpus (model/corpus.py), the
held-out 10% scores it.  Its widths are multiples of 256, so llama.cpp's k-quants (Q4_K_M) apply to every matrix as
they do on a real model, and its 512-id byte-level BPE is small enough that an engine answering the top 512
log-probabilities gives the whole distribution.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from lab.experiments.lm_train import train_causal_lm
from model.corpus import train_text

SHAPE = {"hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 4, "num_attention_heads": 4,
         "num_key_value_heads": 2, "max_position_embeddings": 1024, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
         "tie_word_embeddings": True, "bos_token_id": 0, "eos_token_id": 0}
VOCAB, CONTEXT, STEPS, BATCH, SEED = 512, 128, 600, 16, 0


def tokenizer(text: str):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([text], trainer)
    return tok


def make_trained(folder: Path, steps: int = STEPS, threads: int = 2) -> dict:
    """folder <- the trained LLaMA (config.json, model.safetensors, tokenizer files); a folder trained before with
    the same shape and steps is reused.  Returns its stamp (steps, held-out loss, seconds)."""
    stamp = folder / "posenc-trained.json"
    want = {"shape": SHAPE, "vocab": VOCAB, "context": CONTEXT, "steps": steps, "batch": BATCH, "seed": SEED}
    if stamp.is_file() and (folder / "model.safetensors").is_file():
        done = json.loads(stamp.read_text())
        if {k: done.get(k) for k in want} == want:
            return done
    import torch
    import transformers as tf

    torch.set_num_threads(threads)
    torch.manual_seed(SEED)
    text = train_text()
    tok = tokenizer(text)
    ids = torch.tensor(tok.encode(text).ids, dtype=torch.int64)
    model = tf.LlamaForCausalLM(tf.LlamaConfig(vocab_size=tok.get_vocab_size(), **SHAPE))
    start = time.monotonic()
    losses = train_causal_lm(model, ids, steps, BATCH, CONTEXT, SEED, label="trained model: ")
    folder.mkdir(parents=True, exist_ok=True)
    model.generation_config.do_sample = False
    model.save_pretrained(folder, safe_serialization=True)
    tf.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|endoftext|>",
                               unk_token="<|endoftext|>").save_pretrained(folder)
    done = {**want, "final_train_loss": round(sum(losses[-50:]) / len(losses[-50:]), 4),
            "parameters": model.num_parameters(), "train_seconds": round(time.monotonic() - start, 1)}
    stamp.write_text(json.dumps(done))
    return done

