"""The model configuration: one frozen, validated dataclass; presets are plain data.

The variant and the RoPE scaling type are stored by name (strings), never as booleans, so a config cannot ask for
two encodings at once.  The config knows no names: it checks what every model shares; what a name requires (an
even head dimension to rotate, a scaling's own parameters) is checked by the class the name stands for, when
model.variants.check_config or build_variant looks it up.  Stdlib only: the worker's image carries this file.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from model.errors import ConfigError
from model.layer_spec import (
    OLD_LAYER_LISTS,
    LayerSpec,
    check_layers,
    layer_plan,
    legacy_layers,
    mixer_map_heads,
    mixer_states,
)

# the RoPE scaling types whose pairs span the whole head (model/rope_scaling/ marks them whole_head; named here too
# so that this module stays free of torch, as the client and lab import it; a test holds the two equal)
WHOLE_HEAD_SCALINGS = frozenset({"proportional"})
NORMS = ("layernorm", "rmsnorm")
MLPS = ("plain", "gated", "clamped_swiglu")
ACTIVATIONS = ("gelu", "gelu_tanh", "silu", "relu", "relu2")
ROPE_PAIRINGS = ("half", "interleaved")
QK_NORMS = ("none", "rmsnorm", "layernorm_per_head", "rmsnorm_all_heads", "layernorm", "l2")
ROUTERS = ("softmax", "sigmoid", "topk_sigmoid")
# how a mamba2 layer norms and gates its output y with z: norm(y * silu(z)) by groups (Granite, Nemotron-H),
# norm(y) * silu(z) (Falcon-H1's norm_before_gate), or y * silu(z) with no norm (Falcon-H1 without mamba_rms_norm)
SSM_NORMS = ("gated", "norm_then_gate", "none")
@dataclass(frozen=True)
class ModelConfig:
    # --- which encoding -------------------------------------------------------------------------------
    variant: str = "rope"

    # --- sizes (docs/design.md, "Default model size") ------------------------------------------------------
    vocab_size: int = 256  # byte-level UTF-8
    d_model: int = 128
    n_heads: int = 4
    n_layers: int = 4
    d_mlp: int = 512
    context: int = 128  # trained context length; the learned variant's table has exactly this many rows
    layer_norm_eps: float = 1e-5  # the eps of every norm, LayerNorm or RMSNorm

    # --- architecture as data (defaults: posenc's own models; an imported family sets values, never a name) ----
    norm: str = "layernorm"  # "layernorm" (with bias) or "rmsnorm" (x * rsqrt(mean(x^2) + eps) * weight)
    mlp: str = "plain"  # "plain": down(act(up(x))); "gated": down(act(gate(x)) * up(x)) (SwiGLU with silu)
    activation: str = "gelu"  # "gelu" (exact erf), "gelu_tanh" (GPT-2's gelu_new), "silu"
    n_kv_heads: int = 0  # key/value heads; 0 = n_heads.  Fewer: grouped-query attention (kv head j serves
    #                      query heads j*g .. j*g+g-1, g = n_heads / n_kv_heads)
    d_head: int = 0  # per-head size; 0 = d_model / n_heads
    parallel_residual: bool = False  # x + attn(ln1(x)) + mlp(ln2(x)) instead of two residual steps (GPT-NeoX)
    qkv_bias: bool = True  # biases of the query/key/value projection, the attention's output and the MLP's
    out_bias: bool = True
    mlp_bias: bool = True
    tie_head: bool = True  # logits = final hidden @ token embedding^T; False: a separate head (no bias)
    embed_norm: bool = False  # a norm right after the token embedding (BLOOM's word_embeddings_layernorm)
    embed_scale: float = 1.0  # token embeddings are multiplied by this (Gemma: sqrt(d_model))
    norm_bias: bool = True  # LayerNorms carry a bias (MPT's have none)
    shared_norm: bool = False  # with parallel_residual: the MLP reads ln1's output too, there is no ln2 (GPT-J)
    post_norm: bool = False  # norm after each residual add, x = ln(x + f(x)), and no final norm (OPT-350m)
    head_bias: bool = False  # the untied output head has a bias (GPT-J)
    # per-head norm of queries and keys before RoPE, in the layers whose record says qk_norm: "rmsnorm" (one weight
    # over head_dim shared by the heads, Qwen3), "layernorm_per_head" (a LayerNorm weight per head, StableLM),
    # "layernorm" (one LayerNorm with bias over head_dim, Phi), "rmsnorm_all_heads" (one RMSNorm over all heads'
    # queries, another over the keys, OLMo 2) or "l2" (x * rsqrt(mean(x^2) + eps) per head, no weight: Llama 4)
    qk_norm: str = "none"
    v_norm: bool = False  # each head's values normed over head_dim with no weight, as "l2" (Gemma 4), every layer
    # each layer's record (LayerSpec: attention, positional encoding, q/k norm, experts, query temperature), read
    # once from a family's config; () = every layer alike, every model-wide value below applying (uniform_layer)
    layers: tuple[LayerSpec, ...] = ()
    # sliding-window attention in the "sliding" layers: a query sees keys at position distance < sliding_window
    sliding_window: int = 0  # 0 = none
    local_rope_base: float = 0.0  # the "local" layers' unscaled RoPE base (Gemma 3's rope_local_base_freq)
    # chunked attention in the "chunked" layers (Llama 4): a query at position i sees the keys j <= i of its own
    # block of attention_chunk positions (i // chunk == j // chunk; 0 = none)
    attention_chunk: int = 0
    # attention temperature in the layers whose record says so (Llama 4's NoPE layers): the query at position p is
    # multiplied by log1p(floor((p + 1) / temperature_floor)) * temperature_scale + 1 (temperature_floor 0 = none)
    temperature_floor: float = 0.0
    temperature_scale: float = 0.0
    # scores soft-capped as cap * tanh(s / cap) before the mask (Gemma 2; 0 = none), the same for the final logits,
    # scores scaled by 1/sqrt(attn_scale_dim) instead of 1/sqrt(head_dim) (query_pre_attn_scalar; 0 = head_dim)
    attn_softcap: float = 0.0
    final_softcap: float = 0.0
    attn_scale_dim: float = 0.0
    sandwich_norm: bool = False  # a norm on each branch's output before its residual add (Gemma 2 and 3)
    logit_scale: float = 1.0  # the final logits are multiplied by this (Cohere's logit_scale)
    pre_norm: bool = True  # a norm before each branch; false (needs sandwich_norm): x + ln(f(x)) only (OLMo 2)
    # attention sinks: a learned logit per head (every layer) that joins each softmax's denominator and takes
    # probability mass, with no value (gpt-oss); the maps then sum to 1 - the sink's mass
    attn_sinks: bool = False
    attn_gate: bool = False  # the heads' output times sigmoid(gate(x)) per channel before out (Qwen3-Next)
    # mixture of experts in the layers whose record says experts: n_experts experts of the `mlp` kind (0 = one dense
    # MLP); a biased router (mlp_bias) picks experts_top_k per token, weighed by a softmax over their logits (gpt-oss)
    n_experts: int = 0
    experts_top_k: int = 0
    # "clamped_swiglu" MLP: (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g), g = min(gate, limit) (gpt-oss)
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    # DeepSeek-V3's experts: "sigmoid" routing (each expert's score is sigmoid(logit); experts are chosen by score +
    # a learned bias within the expert_groups_top_k best of expert_groups groups, each group ranked by its two best;
    # the chosen scores, divided by their sum if router_norm, times router_scale, weigh them) instead of "softmax";
    # experts d_expert wide (0 = d_mlp), shared_experts x d_expert of one gated MLP every token takes
    router: str = "softmax"
    expert_groups: int = 0
    expert_groups_top_k: int = 0
    router_norm: bool = True
    router_scale: float = 1.0
    d_expert: int = 0
    shared_experts: int = 0
    shared_gate: bool = False  # the shared experts' output times sigmoid(a learned linear map of x) (Qwen3-Next)
    # Llama 4's experts: router weights that scale each expert's input instead of its output ("topk_sigmoid": the
    # top experts_top_k logits, each weighed by its sigmoid)
    router_scales_input: bool = False
    # multi-head latent attention (DeepSeek-V2/V3, model/mla.py) where mla_kv_rank > 0: keys and values expanded per
    # head from an RMS-normed latent of mla_kv_rank (eps mla_norm_eps), queries through one of mla_q_rank (0 = a plain
    # projection); RoPE on rope_dims of each head's key (shared by the heads) and query, values v_head_dim wide
    mla_kv_rank: int = 0
    mla_q_rank: int = 0
    mla_norm_eps: float = 1e-6
    rope_dims: int = 0  # dims of each head RoPE rotates; 0 = int(head_dim * rope_fraction)
    v_head_dim: int = 0  # per-head value size (multi-head latent attention only); 0 = head_dim
    # the mixer layers' causal depthwise convolution (short_conv: LFM2's, in_proj and out_proj biased too; mamba2: its
    # conv1d) over conv_kernel tokens, biased when conv_bias (model/mixers.py)
    conv_kernel: int = 0
    conv_bias: bool = False
    # the "mamba2" layers (model/ssm.py): ssm_heads heads of ssm_head_dim, a state of ssm_state per head, B and C
    # shared by the heads of each of ssm_groups groups
    ssm_heads: int = 0
    ssm_head_dim: int = 0
    ssm_state: int = 0
    ssm_groups: int = 1
    ssm_dt_min: float = 0.0  # the time steps are clamped below at this (Nemotron-H's time_step_min; 0 = none)
    ssm_norm: str = "gated"  # one of SSM_NORMS
    residual_scale: float = 1.0  # each branch's output is multiplied by this before its residual add (Granite)

    # --- variant knobs (ignored by variants that do not use them) ----------------------------------------
    rope_base: float = 10000.0  # RoPE: theta_k = base^(-2k/d_rot), d_rot = rotated dims per head
    rope_fraction: float = 1.0  # RoPE on the first int(head_dim * fraction) dims of each head; the rest pass
    rope_pairing: str = "half"  # "half": pairs (k, k + d_rot/2) (HF LLaMA, GPT-NeoX); "interleaved": (2k, 2k+1)
    # RoPE context extension (export rope-scale, an imported rope_scaling / rope_parameters): a type registered
    # in model/rope_scaling/, by rope_factor, relative to the context the weights were trained at
    # (rope_original_context; 0 = context).  The rest are the types' own parameters under transformers' names.
    rope_scaling: str = "none"
    rope_factor: float = 1.0
    rope_original_context: int = 0
    rope_attention_factor: float = 0.0  # multiplies cos and sin; 0 = the type's rule (yarn, longrope; else 1)
    rope_beta_fast: float = 32.0  # yarn: pairs turning more than beta_fast times over the original keep theta
    rope_beta_slow: float = 1.0  # yarn: pairs turning fewer than beta_slow times are interpolated by the factor
    rope_mscale: float = 0.0  # yarn: with rope_mscale_all_dim, the attention factor is their mscales' ratio
    rope_mscale_all_dim: float = 0.0
    rope_truncate: bool = True  # yarn: the ramp's ends rounded to whole pairs
    rope_low_freq_factor: float = 1.0  # llama3: wavelengths over original / low are interpolated
    rope_high_freq_factor: float = 4.0  # llama3: wavelengths under original / high are kept
    rope_short_factor: tuple[float, ...] = ()  # longrope: per-pair divisors up to the original length ...
    rope_long_factor: tuple[float, ...] = ()  # ... and past it
    alibi_bias_max: float = 8.0  # ALiBi: slope of head h (1-based) is 2^(-alibi_bias_max * h / n_heads) (MPT)
    alibi_scale: float = 1.0  # ALiBi: slopes multiplied by this (Falcon adds the bias before the 1/sqrt(Dh) scaling)
    shaw_clip: int = 16  # Shaw: relative distances clipped to [-k, k]
    t5_buckets: int = 32  # T5: causal buckets
    t5_max_distance: int = 128  # T5: distance at which the log buckets saturate
    fire_hidden: int = 32  # FIRE: width of the 1 -> hidden -> heads MLP
    fire_c_init: float = 0.1  # FIRE: psi(x) = log(c x + 1)
    fire_L_init: float = 512.0  # FIRE: normaliser floor L (learnable)
    cpe_kernel: int = 8  # CPE: width of the causal depthwise convolution over the token embeddings
    deberta_buckets: int = 32  # DeBERTa: causal log buckets of the relative distance (T5's bucketing)
    deberta_max_distance: int = 128  # DeBERTa: distance at which the buckets saturate

    def __post_init__(self) -> None:
        if not isinstance(self.variant, str) or not self.variant:  # its name is checked by the registry
            raise ConfigError(f"variant must be a variant's name, got {self.variant!r}")
        for name in ("vocab_size", "d_model", "n_heads", "n_layers", "d_mlp", "context", "shaw_clip", "ssm_groups",
                     "t5_buckets", "t5_max_distance", "fire_hidden", "cpe_kernel", "deberta_buckets",
                     "deberta_max_distance"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        for name in ("n_kv_heads", "d_head", "sliding_window", "attention_chunk", "n_experts", "experts_top_k",
                     "expert_groups", "expert_groups_top_k", "d_expert", "shared_experts", "mla_kv_rank", "mla_q_rank",
                     "rope_dims", "v_head_dim", "conv_kernel", "ssm_heads", "ssm_head_dim", "ssm_state"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                zero = "derived" if name in ("n_kv_heads", "d_head") else "none"
                raise ConfigError(f"{name} must be a non-negative integer (0 = {zero}), got {value!r}")
        for name in ("parallel_residual", "qkv_bias", "out_bias", "mlp_bias", "tie_head", "embed_norm",
                     "norm_bias", "shared_norm", "post_norm", "head_bias", "sandwich_norm", "pre_norm", "attn_sinks",
                     "router_scales_input", "v_norm", "conv_bias", "attn_gate", "shared_gate"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be true or false, got {getattr(self, name)!r}")
        for name, known in (("norm", NORMS), ("mlp", MLPS), ("activation", ACTIVATIONS),
                            ("rope_pairing", ROPE_PAIRINGS), ("qk_norm", QK_NORMS), ("ssm_norm", SSM_NORMS)):
            if getattr(self, name) not in known:
                raise ConfigError(f"{name} must be one of {', '.join(known)}, got {getattr(self, name)!r}")
        if not self.d_head and self.d_model % self.n_heads:
            raise ConfigError(f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})")
        if self.n_heads % self.kv_heads:
            raise ConfigError(f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.kv_heads})")
        if not 0 < self.rope_fraction <= 1:
            raise ConfigError(f"rope_fraction must be in (0, 1], got {self.rope_fraction}")
        if self.t5_buckets < 4 or self.t5_max_distance <= self.t5_buckets // 2:
            raise ConfigError("t5 needs t5_buckets >= 4 and t5_max_distance > t5_buckets / 2")
        if self.deberta_buckets < 4 or self.deberta_max_distance <= self.deberta_buckets // 2:
            raise ConfigError("deberta needs deberta_buckets >= 4 and deberta_max_distance > deberta_buckets / 2")
        if not isinstance(self.rope_scaling, str) or not self.rope_scaling:  # its name is checked by the factory
            raise ConfigError(f"rope_scaling must be a scaling type's name, got {self.rope_scaling!r}")
        if not self.rope_factor >= 1 or self.rope_original_context < 0:
            raise ConfigError("rope_factor must be >= 1 and rope_original_context >= 0")
        self._check_rope_scaling()
        self._check_family_fields()
        self._check_layers()
        if self.rope_base <= 1 or self.fire_c_init <= 0 or self.fire_L_init <= 0 or self.layer_norm_eps <= 0:
            raise ConfigError("rope_base must be > 1; fire_c_init, fire_L_init and layer_norm_eps must be > 0")

    def _check_family_fields(self) -> None:
        for name in ("local_rope_base", "attn_softcap", "final_softcap", "attn_scale_dim", "temperature_floor",
                     "temperature_scale", "ssm_dt_min"):
            if isinstance(getattr(self, name), bool) or not getattr(self, name) >= 0:
                raise ConfigError(f"{name} must be a number >= 0 (0 = none), got {getattr(self, name)!r}")
        if self.local_rope_base and not self.local_rope_base > 1:
            raise ConfigError(f"local_rope_base must be > 1 (or 0), got {self.local_rope_base}")
        if not self.embed_scale > 0 or not self.alibi_bias_max > 0 or not self.alibi_scale > 0 or \
                not self.logit_scale > 0 or not self.residual_scale > 0:
            raise ConfigError("embed_scale, alibi_bias_max, alibi_scale, logit_scale and residual_scale must be > 0")
        if self.ssm_heads % self.ssm_groups:
            raise ConfigError(f"ssm_groups ({self.ssm_groups}) must divide ssm_heads ({self.ssm_heads})")
        if self.head_bias and self.tie_head:
            raise ConfigError("head_bias needs an untied head (tie_head false)")
        if self.shared_norm and not self.parallel_residual:
            raise ConfigError("shared_norm applies to parallel blocks only (parallel_residual true)")
        if (self.n_experts > 0) != (self.experts_top_k > 0) or self.experts_top_k > self.n_experts:
            raise ConfigError(f"experts_top_k ({self.experts_top_k}) must be in 1..n_experts ({self.n_experts}), "
                              "both 0 for a dense MLP")
        if self.shared_gate and not (self.n_experts and self.shared_experts):
            raise ConfigError("shared_gate gates the shared experts: it needs n_experts and shared_experts")
        if isinstance(self.swiglu_alpha, bool) or not self.swiglu_alpha > 0 or not self.swiglu_limit > 0:
            raise ConfigError("swiglu_alpha and swiglu_limit must be > 0")
        if not self.pre_norm and (not self.sandwich_norm or self.parallel_residual or self.post_norm):
            raise ConfigError("pre_norm false needs sandwich_norm (each branch's output normed) in a sequential block")
        self._check_latent_and_routing()

    def _check_latent_and_routing(self) -> None:
        if self.router not in ROUTERS:
            raise ConfigError(f"router must be one of {', '.join(ROUTERS)}, got {self.router!r}")
        if self.router_scales_input and (self.mlp_bias or self.mlp != "gated"):
            raise ConfigError("router_scales_input needs bias-free gated experts (mlp gated, mlp_bias false)")
        if not isinstance(self.router_norm, bool) or isinstance(self.router_scale, bool) or \
                not self.router_scale > 0 or not self.mla_norm_eps > 0:
            raise ConfigError("router_norm must be true or false; router_scale and mla_norm_eps must be > 0")
        if self.expert_groups > 1 and (self.n_experts % self.expert_groups or self.n_experts // self.expert_groups < 2
                                       or not 0 < self.expert_groups_top_k <= self.expert_groups
                                       or self.experts_top_k > self.expert_groups_top_k * (
                                           self.n_experts // self.expert_groups)):
            raise ConfigError(f"expert_groups ({self.expert_groups}) must split n_experts ({self.n_experts}) in "
                              "groups of 2 or more, expert_groups_top_k in 1..expert_groups, holding experts_top_k")
        if self.rope_dims > self.head_dim:
            raise ConfigError("rope_dims must be <= head_dim")
        if not self.mla_kv_rank and (self.mla_q_rank or self.v_head_dim):
            raise ConfigError("mla_q_rank and v_head_dim need multi-head latent attention (mla_kv_rank > 0)")
        if self.mla_kv_rank and (self.kv_heads != self.n_heads or self.v_head_dim > self.head_dim
                                 or self.qk_norm != "none" or self.v_norm or self.attn_gate):
            raise ConfigError("multi-head latent attention expands keys and values to every head (n_kv_heads = "
                              "n_heads), values no wider than head_dim, no q/k/v norm, no output gate")

    def _check_layers(self) -> None:
        object.__setattr__(self, "layers", check_layers(self))

    def _check_rope_scaling(self) -> None:
        for name in ("rope_short_factor", "rope_long_factor"):  # JSON gives lists: stored as tuples
            value = getattr(self, name)
            if not isinstance(value, (list, tuple)) or not all(
                    isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 for v in value):
                raise ConfigError(f"{name} must be a list of positive numbers, got {value!r}")
            object.__setattr__(self, name, tuple(float(v) for v in value))
        if not isinstance(self.rope_truncate, bool):
            raise ConfigError(f"rope_truncate must be true or false, got {self.rope_truncate!r}")
        for name in ("rope_attention_factor", "rope_beta_fast", "rope_beta_slow", "rope_mscale",
                     "rope_mscale_all_dim"):
            if not getattr(self, name) >= 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)!r}")

    @property
    def head_dim(self) -> int:
        return self.d_head or self.d_model // self.n_heads

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def rope_dim(self) -> int:
        """Dims of each head RoPE rotates (GPT-NeoX: int(head_dim * rotary_pct); DeepSeek's qk_rope_head_dim)."""
        if not self.rope_dims and self.rope_scaling in WHOLE_HEAD_SCALINGS:
            # a type whose pairs span the whole head (proportional): rope_fraction is the share of them that turn
            return self.head_dim
        return self.rope_dims or int(self.head_dim * self.rope_fraction)

    def uniform_layer(self) -> LayerSpec:
        """Every layer's record where layers is () (records all equal to it are stored so: one spelling per model):
        each model-wide value applies (sliding_window else attention_chunk; local_rope_base in windows; temperature)."""
        attention = "sliding" if self.sliding_window else "chunked" if self.attention_chunk else "full"
        return LayerSpec(attention, "local" if attention == "sliding" and self.local_rope_base else "model",
                         temperature=self.temperature_floor > 0)

    def layer(self, i: int) -> LayerSpec:
        """Layer i's record."""
        return self.layers[i] if self.layers else self.uniform_layer()

    def attends(self, i: int) -> bool:
        """Whether layer i is an attention layer (keeps a KV cache; a mixer beside it keeps its state too), not a mixer
        (keeps a fixed-size state)."""
        return self.layer(i).mixer == "attention"

    def mixer_states(self, i: int) -> list[tuple[str, tuple[int, ...]]]:
        """Layer i's fixed-size carried state (model.layer_spec.mixer_states)."""
        return mixer_states(self, i)

    def mixer_map_heads(self, i: int) -> int:
        """Layer i's mixer's exact matrices (model.layer_spec.mixer_map_heads)."""
        return mixer_map_heads(self, i)

    def layer_plan(self) -> list[dict[str, Any]]:
        """The records with the values they use, as model.json's "layers" (model.layer_spec.layer_plan)."""
        return layer_plan(self)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        """A config from to_dict's data, or from an older one's per-layer lists (OLD_LAYER_LISTS)."""
        fields = {f.name: f.default for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - set(fields) - set(OLD_LAYER_LISTS))
        if unknown:
            raise ConfigError(f"unknown config fields: {', '.join(unknown)}")
        data = dict(data)
        old = {name: data.pop(name) for name in OLD_LAYER_LISTS if name in data}
        if any(old.values()) and data.get("layers"):
            raise ConfigError(f"layers and the older {', '.join(old)} describe the same layers: give layers only")
        if old and not data.get("layers"):
            data["layers"] = legacy_layers({**fields, **data}, old)
        return cls(**data)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)


# Presets are data: `default` is docs/design.md's "Default model size", `tiny` keeps tests fast.
PRESETS: dict[str, dict[str, Any]] = {
    "default": {},
    "tiny": {"d_model": 32, "n_heads": 4, "n_layers": 2, "d_mlp": 64, "context": 16, "shaw_clip": 4,
             "t5_buckets": 8, "t5_max_distance": 20, "fire_hidden": 8, "fire_L_init": 8.0, "cpe_kernel": 3,
             "deberta_buckets": 8, "deberta_max_distance": 20},
}


def preset(name: str, variant: str = "rope", **overrides: Any) -> ModelConfig:
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; known presets: {', '.join(PRESETS)}")
    return ModelConfig(variant=variant, **{**PRESETS[name], **overrides})
