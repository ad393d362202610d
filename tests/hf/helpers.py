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
                              head_dim=48, intermediate_size=96, max_position_embeddings=256, rms_norm_eps=1e-6,
                              rope_theta=500.0, tie_word_embeddings=False, **common)
    if family == "bloom":
        return tf.BloomConfig(hidden_size=64, n_layer=2, n_head=4, **common)
    return more_config(tf, family, common)


# transformers' eager Falcon adds the ALiBi bias twice (once in the mask it builds, once in the scores; 5.24), its SDPA
# path once, as Falcon's own code does: the SDPA model is that family's reference, for logits (it returns no maps)
REFERENCE_ATTENTION = {"falcon_alibi": "sdpa"}
WINDOW = 7  # the tiny sliding-window families' window: the parity lengths 1, 7 and 200 are below, at and past it
CHUNK = 8  # the tiny Llama 4's attention chunk: the lengths 1, 7 and 200 are inside the first chunk and past it
# one shape for the ten further families: hidden 32, 2 layers, 4 query heads (2 key/value heads where grouped)
LLAMA_SHAPED = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                "intermediate_size": 64, "max_position_embeddings": 256, "tie_word_embeddings": False}


def more_config(tf, family: str, common: dict):
    if family == "nemotron_h":  # one-part blocks from the pattern: Mamba-2, MLP, NoPE attention, experts, Mamba-2
        # (time_step_min at its default; tests/hf/test_mixers.py raises it until it binds); 8 squared-ReLU experts
        # in 2 groups, top 2 from the best group, beside a shared expert of twice an expert's width
        return tf.NemotronHConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                                  head_dim=8, intermediate_size=48, hybrid_override_pattern="M-*EM",
                                  n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
                                  moe_shared_expert_intermediate_size=32, n_group=2, topk_group=1,
                                  routed_scaling_factor=2.5,
                                  mamba_num_heads=8, mamba_head_dim=8, ssm_state_size=16, n_groups=2, conv_kernel=4,
                                  chunk_size=4, max_position_embeddings=256, pad_token_id=0,
                                  **common)
    if family == "granitemoehybrid":  # Mamba-2 layers 0 and 2 (8 heads in 2 groups, scanned by transformers in
        # chunks of 4) around a NoPE attention layer; 4 experts, top 2, beside the shared MLP; Granite's multipliers
        return tf.GraniteMoeHybridConfig(**{**LLAMA_SHAPED, "num_hidden_layers": 3, "intermediate_size": 16},
                                         shared_intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
                                         layer_types=["linear_attention", "full_attention", "linear_attention"],
                                         mamba_n_heads=8, mamba_d_head=8, mamba_d_state=16, mamba_n_groups=2,
                                         mamba_d_conv=4, mamba_chunk_size=4, embedding_multiplier=2.0,
                                         residual_multiplier=0.5, attention_multiplier=0.3, logits_scaling=2.0,
                                         position_embedding_type=None, **common)
    if family == "falcon_h1":  # every layer a Mamba-2 layer (8 heads in 2 groups, chunks of 4) beside GQA attention
        # with RoPE; every maximal-update multiplier away from 1
        return tf.FalconH1Config(**LLAMA_SHAPED, mamba_d_ssm=64, mamba_n_heads=8, mamba_d_state=16, mamba_n_groups=2,
                                 mamba_d_conv=4, mamba_chunk_size=4, embedding_multiplier=2.0, lm_head_multiplier=0.5,
                                 key_multiplier=0.7, attention_in_multiplier=1.3, attention_out_multiplier=0.8,
                                 ssm_in_multiplier=1.2, ssm_out_multiplier=0.9, mlp_multipliers=[1.5, 0.6],
                                 ssm_multipliers=[0.5, 1.5, 0.8, 1.25, 2.0], rope_theta=1e3, pad_token_id=0, **common)
    if family == "qwen3_next":  # Gated DeltaNet layers 0 and 2 (8 value heads on 4 key heads; transformers' chunks
        # of 64) around a gated attention layer with RoPE on a quarter of each head; experts on layers 0 and 2
        return tf.Qwen3NextConfig(**{**LLAMA_SHAPED, "num_hidden_layers": 3, "intermediate_size": 48},
                                  head_dim=16, layer_types=["linear_attention", "full_attention", "linear_attention"],
                                  linear_num_value_heads=8, linear_num_key_heads=4, linear_key_head_dim=8,
                                  linear_value_head_dim=8, linear_conv_kernel_dim=4, num_experts=4,
                                  num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=32,
                                  mlp_only_layers=[1], pad_token_id=0, **common)
    if family == "lfm2":  # short-convolution layers 0 and 2 around an attention layer; the MLP's width rounded to 16
        return tf.Lfm2Config(**{**LLAMA_SHAPED, "num_hidden_layers": 3, "tie_word_embeddings": True},
                             layer_types=["conv", "full_attention", "conv"], conv_L_cache=3, block_multiple_of=16,
                             block_ffn_dim_multiplier=1.0, pad_token_id=0, **common)
    if family == "qwen2":  # windowed from layer 1 on (max_window_layers), layer 0 full
        return tf.Qwen2Config(**LLAMA_SHAPED, rope_theta=1e6, use_sliding_window=True, sliding_window=WINDOW,
                              max_window_layers=1, **common)
    if family == "mistral":
        return tf.MistralConfig(**LLAMA_SHAPED, head_dim=12, sliding_window=WINDOW, **common)
    if family == "qwen3":
        return tf.Qwen3Config(**LLAMA_SHAPED, head_dim=16, attention_bias=True, rope_theta=1e6, **common)
    if family == "gemma":  # tied head, GeGLU, head_dim apart from hidden / heads
        return tf.GemmaConfig(**{**LLAMA_SHAPED, "tie_word_embeddings": True}, head_dim=12, **common)
    if family == "stablelm":  # parallel block with one norm, per-head q/k LayerNorm, q/k/v biases, rotary on 1/4
        return tf.StableLmConfig(**LLAMA_SHAPED, use_qkv_bias=True, qk_layernorm=True, use_parallel_residual=True,
                                 **common)
    if family == "gptj":  # interleaved rotary on half of each head, parallel block, head with a bias
        return tf.GPTJConfig(n_embd=32, n_layer=2, n_head=4, rotary_dim=4, n_positions=256, **common)
    if family == "mpt":  # 12 heads: ALiBi slopes for a head count that is not a power of two
        return tf.MptConfig(d_model=48, n_layers=2, n_heads=12, max_seq_len=256, **common)
    if family == "falcon":  # new architecture: grouped key/value heads, two norms in the parallel block, rotary
        return tf.FalconConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_kv_heads=2,
                               new_decoder_architecture=True, bias=False, max_position_embeddings=256, **common)
    if family == "falcon_alibi":  # the old one: multi-query, one norm in the parallel block, ALiBi, biases
        return tf.FalconConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, multi_query=True,
                               parallel_attn=True, alibi=True, bias=True, **common)
    if family == "falcon_sequential":  # old architecture: per-head fused q/k/v, sequential block, rotary
        return tf.FalconConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, multi_query=False,
                               parallel_attn=False, bias=True, max_position_embeddings=256, **common)
    if family == "phi3":  # LongRoPE switched at 64 (200 is past it), a window over every layer
        rope = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0, 1.1, 1.3, 1.6],
                "long_factor": [1.0, 2.0, 3.5, 6.0]}
        return tf.Phi3Config(**LLAMA_SHAPED, original_max_position_embeddings=64, rope_parameters=rope,
                             sliding_window=WINDOW, pad_token_id=0, **common)
    if family in ("opt", "opt_post_norm"):  # learned positions offset by 2, ReLU; LayerNorm before or after
        return tf.OPTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, ffn_dim=64,
                            max_position_embeddings=256, word_embed_proj_dim=32,
                            do_layer_norm_before=family == "opt", **common)
    if family in BLOCK_FAMILIES:
        return block_config(tf, family, common)
    return per_layer_config(tf, family, common)


def per_layer_config(tf, family: str, common: dict):
    """The families whose layers differ in their positions or attention (issue 33), 2 layers each, one of each
    kind: layer 0 sliding or RoPE, layer 1 full or NoPE."""
    if family == "smollm3":  # NoPE every 2nd layer (no_rope_layers derived from the interval), tied head
        return tf.SmolLM3Config(**{**LLAMA_SHAPED, "tie_word_embeddings": True}, head_dim=16,
                                no_rope_layer_interval=2, pad_token_id=0, **common)
    if family == "ministral":  # the window on the layers layer_types marks
        return tf.MinistralConfig(**LLAMA_SHAPED, head_dim=12, sliding_window=WINDOW,
                                  layer_types=["sliding_attention", "full_attention"], **common)
    gemma = {**LLAMA_SHAPED, "tie_word_embeddings": True, "head_dim": 12, "sliding_window": WINDOW}
    if family == "gemma2":  # caps low enough to bend the scores and logits; a query scale apart from head_dim
        return tf.Gemma2Config(**gemma, query_pre_attn_scalar=10, attn_logit_softcapping=4.0,
                               final_logit_softcapping=3.0, **common)
    if family == "gemma3":  # local base 100 on the sliding layer, the global layer's 1e6 stretched by linear x 4
        rope = {"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}}
        return tf.Gemma3TextConfig(**gemma, sliding_window_pattern=2, rope_parameters=rope, **common)
    if family == "cohere2":  # RoPE (interleaved) on the sliding layer only, the global one NoPE; logits scaled
        return tf.Cohere2Config(**{**LLAMA_SHAPED, "tie_word_embeddings": True}, sliding_window=WINDOW,
                                sliding_window_pattern=2, logit_scale=0.5, **common)
    if family == "gpt_oss":  # sinks; sliding layer 0, full layer 1; YaRN past 64 untruncated; 4 experts, top 2,
        # the SwiGLU's clamp low enough to bite
        rope = {"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                "original_max_position_embeddings": 64, "rope_theta": 150000.0}
        return tf.GptOssConfig(**{**LLAMA_SHAPED, "intermediate_size": 16}, head_dim=8, sliding_window=WINDOW,
                               rope_parameters=rope, num_local_experts=4, num_experts_per_tok=2, swiglu_alpha=1.5,
                               swiglu_limit=1.0, **common)
    if family in ("deepseek_v3", "deepseek_v3_forms"):
        return deepseek_config(tf, family, common)
    if family in ("gemma4_text", "gemma4_text_forms"):
        return gemma4_config(tf, family, common)
    if family == "llama4":  # iRoPE: layer 0 RoPE (llama3-scaled past 64, interleaved) chunked by 8 with the L2 q/k
        # norm, layer 1 NoPE, full, its queries tempered every 4 positions; layer 0 dense, layer 1 4 experts, top 2
        rope = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64, "rope_theta": 500.0}
        return tf.Llama4TextConfig(**{**LLAMA_SHAPED, "intermediate_size": 16}, head_dim=8, intermediate_size_mlp=64,
                                   no_rope_layers=[1, 0], attention_chunk_size=CHUNK, floor_scale=4, attn_scale=0.5,
                                   num_local_experts=4, num_experts_per_tok=2, interleave_moe_layer_step=2,
                                   rope_parameters=rope, **common)
    raise ValueError(family)


def deepseek_config(tf, family: str, common: dict):
    """Multi-head latent attention with values (8) narrower than the keys (8 + 8 for RoPE), YaRN past 64 whose
    mscale_all_dim scales the scores; layer 0 dense, layer 1 of 8 experts in 4 groups (2 kept), top 3, one shared.
    The forms: queries through q_proj (no q latent), half-split RoPE, biases, unscaled RoPE, one group, no norm."""
    sizes = {**LLAMA_SHAPED, "num_key_value_heads": 4, "moe_intermediate_size": 8, "n_routed_experts": 8,
             "num_experts_per_tok": 3, "first_k_dense_replace": 1, "kv_lora_rank": 16, "qk_rope_head_dim": 8,
             "qk_nope_head_dim": 8, "v_head_dim": 8}
    if family == "deepseek_v3_forms":
        return tf.DeepseekV3Config(**sizes, q_lora_rank=None, rope_interleave=False, attention_bias=True,
                                   n_group=1, topk_group=1, norm_topk_prob=False, n_shared_experts=2,
                                   routed_scaling_factor=1.5, rope_parameters={"rope_type": "default",
                                                                               "rope_theta": 500.0}, **common)
    rope = {"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0,
            "mscale_all_dim": 0.707, "original_max_position_embeddings": 64, "rope_theta": 10000.0}
    return tf.DeepseekV3Config(**sizes, q_lora_rank=12, n_group=4, topk_group=2, rope_parameters=rope, **common)


def gemma4_config(tf, family: str, common: dict):
    """Gemma 4's text model, per-layer inputs off (0) and the full layers' head size the sliding ones' (posenc
    refuses both otherwise): layer 0 sliding with default RoPE at 100, layer 1 full with proportional RoPE (half of
    the pairs turn, at 1000) and its values from the key projection (attention_k_eq_v), the logits capped.  The
    forms: Gemma4TextConfig's own layer types (3 layers: the last made full) and RoPE (proportional over a quarter,
    1e6; 1e4), attention biases, every layer its own value projection."""
    sizes = {**LLAMA_SHAPED, "tie_word_embeddings": True, "head_dim": 16, "global_head_dim": 16,
             "sliding_window": WINDOW, "hidden_size_per_layer_input": 0}
    if family == "gemma4_text_forms":
        return tf.Gemma4TextConfig(**{**sizes, "num_hidden_layers": 3}, attention_bias=True, **common)
    rope = {"full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.5, "rope_theta": 1000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}}
    return tf.Gemma4TextConfig(**sizes, layer_types=["sliding_attention", "full_attention"], rope_parameters=rope,
                               attention_k_eq_v=True, final_logit_softcapping=3.0, **common)


BLOCK_FAMILIES = ("olmo2", "starcoder2", "phi", "codegen", "gpt_bigcode", "gpt_bigcode_mha")


def block_config(tf, family: str, common: dict):
    """The families that differ in their blocks (norm placement, q/k norm kinds, MLP kinds, fused layouts)."""
    if family == "olmo2":  # q/k RMSNorm over all heads at once, norms on the branches' outputs only
        return tf.Olmo2Config(**LLAMA_SHAPED, rope_theta=500.0, **common)
    if family == "starcoder2":  # LayerNorms, biases, a plain GELU MLP, a window over every layer
        return tf.Starcoder2Config(**LLAMA_SHAPED, sliding_window=WINDOW, **common)
    if family == "phi":  # parallel block, RoPE on half of each head (the default), q/k LayerNorm, biased head
        return tf.PhiConfig(**LLAMA_SHAPED, qk_layernorm=True, **common)
    if family == "codegen":  # 2 heads of 16 over qkv_proj's 4 shards of 8: a head spans two shards
        return tf.CodeGenConfig(n_embd=32, n_layer=2, n_head=2, rotary_dim=8, n_inner=64, n_positions=256, **common)
    if family in ("gpt_bigcode", "gpt_bigcode_mha"):  # learned positions; one key/value head, or per-head c_attn
        mha = family == "gpt_bigcode_mha"  # with the scores unscaled too
        return tf.GPTBigCodeConfig(n_embd=32, n_layer=2, n_head=4, n_inner=64, n_positions=256, multi_query=not mha,
                                   scale_attn_weights=not mha, **common)
    raise ValueError(family)


MIXER_TYPES = {"conv", "mamba", "linear_attention", "mlp", "moe"}  # transformers' layer_types without attention


def attending(config) -> list[int]:
    """The layers transformers returns attention maps for: every layer but its mixers."""
    types = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
    return [i for i, t in enumerate(types) if t not in MIXER_TYPES]


def per_layer_maps(config, out):
    """transformers' output with one entry of attentions per layer, None at a mixer layer (transformers returns the
    attention layers' maps alone)."""
    layers = attending(config)
    if out.attentions is not None and len(layers) != config.num_hidden_layers:
        maps = dict(zip(layers, out.attentions, strict=True))
        out.attentions = tuple(maps.get(i) for i in range(config.num_hidden_layers))
    return out


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
    model = tf.AutoModelForCausalLM.from_config(hf_config(family), attn_implementation=REFERENCE_ATTENTION.get(
        family, "eager")).eval()
    perturb(model, seed)
    if hasattr(model.config, "num_local_experts") or getattr(model.config, "num_experts", 0):  # gpt-oss, Qwen3-Next:
        # transformers' own experts loop, not grouped_mm
        model.set_experts_implementation("eager")
    with torch.no_grad():  # sinks that take from a few percent to most of a row
        for name, p in model.named_parameters():
            if name.endswith(".sinks"):
                p.mul_(15)
        for name, b in model.named_buffers():  # DeepSeek-V3's choice-only router bias, large enough to change choices
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.3 * torch.randn(b.shape, generator=torch.Generator().manual_seed(seed)))
    model.save_pretrained(folder, safe_serialization=True)
    tok = tf.PreTrainedTokenizerFast(tokenizer_object=__import__("tokenizers").Tokenizer.from_str(tokenizer_json()))
    tok.save_pretrained(folder)
    return model
