"""One layer's record (ModelConfig.layers): what mixes its tokens, what kind of attention it has and which positional
encoding it applies, as kinds; the reading of older configs' per-layer lists into records; the records' checks
against the model-wide values they use, each layer's carried state and the plan model.json records.  Stdlib only, beside
model/config.py in the worker's image.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from model.errors import ConfigError

ATTENTIONS = ("full", "sliding", "chunked")
ENCODINGS = ("model", "local", "none")
# what mixes a layer's tokens: attention, LFM2's gated short convolution, a Mamba-2 state-space layer (SSD), a
# Gated DeltaNet layer (Qwen3-Next's linear attention), or nothing (a block that is its MLP alone: Nemotron-H's)
MIXERS = ("attention", "short_conv", "mamba2", "gated_deltanet", "none")
RECURRENT = ("mamba2", "gated_deltanet")  # the mixers that carry a recurrent state (and use the ssm_* sizes)
# what runs beside an attention layer's attention on the same normed input, their outputs summed: nothing, or a
# Mamba-2 layer (Falcon-H1's hybrid layers)
BESIDES = ("none", "mamba2")
# the per-layer lists older configs carry (checkpoints, model.json): ModelConfig.from_dict reads them into layers
OLD_LAYER_LISTS = ("window_layers", "chunk_layers", "nope_layers", "qk_norm_layers", "expert_layers", "dense_layers")


@dataclass(frozen=True)
class LayerSpec:
    """One layer as kinds (ModelConfig.layers); the sizes, bases and weights they use are the model's own values."""
    attention: str = "full"  # "full", "sliding" (keys < sliding_window back) or "chunked" (blocks of attention_chunk)
    # "model": the variant's (RoPE at rope_base, scaled); "local": RoPE at local_rope_base, unscaled (Gemma 3's
    # sliding layers); "none": no positional encoding (NoPE: SmolLM3, Llama 4, Cohere2)
    encoding: str = "model"
    qk_norm: bool = True  # the model's q/k norm (qk_norm) in this layer; false: none here (Llama 4's NoPE layers)
    experts: bool = True  # the model's experts (n_experts) in this layer; false: one dense d_mlp MLP here
    temperature: bool = False  # queries scaled by the position's temperature (temperature_floor, temperature_scale)
    # "short_conv": no attention in this layer but a gated causal convolution over conv_kernel tokens (LFM2's conv
    # layers); "mamba2": a Mamba-2 layer (Granite 4.0-H); "gated_deltanet": a Gated DeltaNet layer (Qwen3-Next); each
    # is where the layer's order comes from (model/mixers.py, model/ssm.py, model/deltanet.py); "none": no token
    # mixing at all (its maps are the identity)
    mixer: str = "attention"
    mlp: bool = True  # false: the layer is its mixer alone, no MLP branch (Nemotron-H's blocks)
    beside: str = "none"  # "mamba2": a Mamba-2 layer beside the attention, outputs summed (Falcon-H1)


def legacy_layers(values: dict[str, Any], old: dict[str, Any]) -> list[LayerSpec]:
    """Each layer's record from an older config's lists as they were read: window_layers, chunk_layers, qk_norm_layers
    (empty = every layer), nope_layers (tempered with temperature_floor), expert_layers (empty = from dense_layers)."""
    specs = []
    for i in range(values["n_layers"]):
        windowed = values["sliding_window"] > 0 and i in (old.get("window_layers") or [i])
        chunked = values["attention_chunk"] > 0 and i in (old.get("chunk_layers") or [i])
        nope = i in (old.get("nope_layers") or ())
        experts = i in old["expert_layers"] if old.get("expert_layers") else i >= (old.get("dense_layers") or 0)
        specs.append(LayerSpec("sliding" if windowed else "chunked" if chunked else "full",
                               "none" if nope else "local" if windowed and values["local_rope_base"] else "model",
                               i in (old.get("qk_norm_layers") or [i]) or values["qk_norm"] == "none",
                               experts or not values["n_experts"], nope and values["temperature_floor"] > 0))
    return specs


def check_layers(cfg: Any) -> tuple[LayerSpec, ...]:
    """cfg's records checked against the model-wide values each kind uses: () where every record is the uniform one
    (one spelling per model), else the records."""
    if not cfg.layers and cfg.sliding_window and cfg.attention_chunk:
        raise ConfigError("a layer is either windowed (sliding_window) or chunked (attention_chunk), not both: "
                          "layers says which")
    try:  # JSON gives objects
        specs = tuple(s if isinstance(s, LayerSpec) else LayerSpec(**s) for s in cfg.layers)
    except TypeError:
        raise ConfigError(f"layers must be records with LayerSpec's fields, got {cfg.layers!r}") from None
    if specs and len(specs) != cfg.n_layers:
        raise ConfigError(f"layers must hold one record per layer ({cfg.n_layers}), got {len(specs)}")
    for i, s in enumerate(specs):  # each kind a record names needs the model-wide value it uses
        needs = {"sliding_window": s.attention == "sliding", "attention_chunk": s.attention == "chunked",
                 "local_rope_base": s.encoding == "local", "temperature_floor": s.temperature is True,
                 "qk_norm": s.qk_norm is False, "n_experts": s.experts is False,
                 "conv_kernel": s.mixer in ("short_conv", *RECURRENT) or s.beside == "mamba2",
                 **dict.fromkeys(("ssm_heads", "ssm_head_dim", "ssm_state"),
                                 s.mixer in RECURRENT or s.beside == "mamba2")}
        if s.attention not in ATTENTIONS or s.encoding not in ENCODINGS or s.mixer not in MIXERS or \
                s.beside not in BESIDES or any(not isinstance(v, bool) for v in (s.qk_norm, s.experts,
                                                                                   s.temperature, s.mlp)):
            raise ConfigError(f"layers[{i}] needs attention in {ATTENTIONS}, encoding in {ENCODINGS}, mixer in "
                              f"{MIXERS}, beside in {BESIDES} and qk_norm, experts, temperature, mlp true or false, "
                              f"got {s}")
        if s.beside != "none" and s.mixer != "attention":
            raise ConfigError(f"layers[{i}] ({s}): a mixer runs beside an attention layer's attention only")
        for name in (n for n, used in needs.items() if used and getattr(cfg, n) in (0, "none")):
            raise ConfigError(f"layers[{i}] ({s}) needs {name}, which the model does not set")
    if specs and all(s.mixer != "attention" for s in specs):  # a cache's length is read from its keys
        raise ConfigError('a model needs at least one attention layer (a layer whose mixer is "attention")')
    return () if all(s == cfg.uniform_layer() for s in specs) else specs


def mixer_states(cfg: Any, i: int) -> list[tuple[str, tuple[int, ...]]]:
    """Layer i's fixed-size carried state, (name, shape past the batch) per tensor, its mixer's (or the one beside
    its attention): a convolution's last inputs, and a mamba2 layer's SSM state; none for attention alone."""
    kind = cfg.layer(i).beside if cfg.layer(i).mixer == "attention" else cfg.layer(i).mixer
    if kind in ("short_conv", "none"):
        return [("conv", (cfg.conv_kernel - 1, cfg.d_model))] if kind == "short_conv" else []
    width = cfg.ssm_heads * cfg.ssm_head_dim + 2 * cfg.ssm_groups * cfg.ssm_state
    if kind == "gated_deltanet":  # S per value head: (key dim, value dim)
        return [("conv", (cfg.conv_kernel - 1, width)), ("ssm", (cfg.ssm_heads, cfg.ssm_state, cfg.ssm_head_dim))]
    return [("conv", (cfg.conv_kernel - 1, width)), ("ssm", (cfg.ssm_heads, cfg.ssm_head_dim, cfg.ssm_state))]


def mixer_map_heads(cfg: Any, i: int) -> int:
    """How many exact matrices layer i's mixer (or the one beside its attention) has: one per channel of a short
    convolution, one per head of a mamba2 or gated_deltanet layer; 0 for attention alone and a layer with no
    mixing (the mixer maps of export/intervene.py's maps graph)."""
    kind = cfg.layer(i).beside if cfg.layer(i).mixer == "attention" else cfg.layer(i).mixer
    return {"short_conv": cfg.d_model, "mamba2": cfg.ssm_heads, "gated_deltanet": cfg.ssm_heads}.get(kind, 0)


def layer_plan(cfg: Any) -> list[dict[str, Any]]:
    """The records with the values they use, as model.json's "layers": attention "full", "sliding" with its window
    or "chunked" with its chunk, encoding "rope" with its base and scaling, "none" or the variant's name, the
    score soft-cap (null = none), sinks, query temperature (null = none), the mixer beside the attention (beside)."""
    plan = []
    for s in map(cfg.layer, range(cfg.n_layers)):
        if s.mixer != "attention":  # no attention: its order comes from its convolution (and recurrence)
            plan.append({"attention": "none", "mixer": s.mixer, "beside": "none",
                         "kernel": cfg.conv_kernel if s.mixer != "none"
                         else None, "encoding": {"short_conv": "convolution", "mamba2": "recurrence",
                                                 "gated_deltanet": "recurrence"}.get(s.mixer, "none")})
            continue
        entry: dict[str, Any] = {
            "mixer": "attention", "beside": s.beside, "kernel": None, "attention": s.attention,
            "window": cfg.sliding_window if s.attention == "sliding" else None,
            "softcap": cfg.attn_softcap or None, "sinks": cfg.attn_sinks,
            "encoding": "none" if s.encoding == "none" else cfg.variant,
            "chunk": cfg.attention_chunk if s.attention == "chunked" else None,
            "temperature": {"floor": cfg.temperature_floor, "scale": cfg.temperature_scale} if s.temperature
            else None}
        if s.beside != "none":  # its order comes from its attention's encoding and the recurrence beside it
            entry["kernel"] = cfg.conv_kernel
        if cfg.variant == "rope" and s.encoding == "local":
            entry["rope"] = {"base": cfg.local_rope_base, "scaling": "none", "factor": 1.0}
        elif cfg.variant == "rope" and s.encoding == "model":
            entry["rope"] = {"base": cfg.rope_base, "scaling": cfg.rope_scaling, "factor": cfg.rope_factor}
        plan.append(entry)
    return plan
