"""The generic import: a model_type no module in model/hf/families/ names, read from config.json's standard fields and
the tensors the folder holds.  LLaMA's projections and names, with what the tensors show (q/k/v and output biases, a
q/k norm per head or over all heads, a gated, fused or plain MLP, norm placements: pre-norm, OLMo 2's output norms,
Gemma 2's and HyperCLOVA X's sandwiches) and what the standard fields say (sizes, rope_parameters or rope_scaling
of every registered type, partial_rotary_factor, layer_types and sliding_window, no_rope_layers, norms and their
epsilon, the activation, tying, multipliers on embeddings, scores and logits, soft caps).

What it cannot place is refused by name: a config field it neither reads nor knows to be harmless (IGNORABLE; NEUTRAL
at its harmless value), custom code (auto_map), a norm layout it does not know, and (model.hf.load) a tensor no part
reads.  What the fields cannot say (a family's code that differs from LLaMA's) the proof at import catches
(export/proof.py): the generic import is never written without it.
"""

from __future__ import annotations

from typing import Any

import torch

from model.errors import ImportRefusedError
from model.hf.families.base import ATTENTION, Fields, Mapping, final_norm_and_head, separate_attention
from model.hf.files import Weights

# config.json fields that never change the computation of a forward pass (bookkeeping, training, generation, ids)
IGNORABLE = frozenset({
    "model_type", "architectures", "transformers_version", "_name_or_path", "torch_dtype", "dtype", "use_cache",
    "bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id", "decoder_start_token_id", "tokenizer_class",
    "initializer_range", "embedding_initializer_range", "attention_dropout", "hidden_dropout", "residual_dropout",
    "embedding_dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop", "dropout", "output_hidden_states",
    "output_attentions", "return_dict", "chunk_size_feed_forward", "is_encoder_decoder", "is_decoder",
    "problem_type", "id2label", "label2id", "task_specific_params", "finetuning_task", "prefix",
    "tie_encoder_decoder", "add_cross_attention", "cross_attention_hidden_size", "pruned_heads", "torchscript",
    "use_bfloat16", "tf_legacy_loss", "output_router_logits", "router_aux_loss_coef", "router_z_loss_coef",
    "max_position_embeddings", "use_return_dict", "keys_to_ignore_at_inference", "pretrained_config_archive_map",
    "sliding_window_pattern",  # a derivation of layer_types, which the import reads
    "router_jitter_noise",  # training only
})
# fields that change the computation unless they hold these values
NEUTRAL = {"pretraining_tp": (1,), "residual_multiplier": (1, 1.0), "clip_qkv": (None,), "rope_interleave": (False,),
           "use_bidirectional_attention": (False,), "mlp_layer_types": (None,), "num_nextn_predict_layers": (None, 0),
           "use_sliding_window": (True, False),
           "decoder_sparse_step": (1,), "mlp_only_layers": ([],)}
EPS = ("rms_norm_eps", "layer_norm_eps", "norm_eps", "layer_norm_epsilon")
# the norm names of layer 0 -> posenc's norms, per layout; "post_attention_layernorm" means the MLP's input norm in
# LLaMA's layout and the attention's output norm in OLMo 2's and Gemma 2's
LAYOUTS = (
    ({"input_layernorm": "ln1", "post_attention_layernorm": "ln2"}, {}),
    ({"post_attention_layernorm": "ln_attn_out", "post_feedforward_layernorm": "ln_mlp_out"},
     {"sandwich_norm": True, "pre_norm": False}),
    ({"input_layernorm": "ln1", "post_attention_layernorm": "ln_attn_out", "pre_feedforward_layernorm": "ln2",
      "post_feedforward_layernorm": "ln_mlp_out"}, {"sandwich_norm": True}),
    ({"input_layernorm": "ln1", "post_norm1": "ln_attn_out", "post_attention_layernorm": "ln2",
      "post_norm2": "ln_mlp_out"}, {"sandwich_norm": True}),
    ({"input_layernorm": "ln1", "post_self_attn_layernorm": "ln_attn_out", "post_attention_layernorm": "ln2",
      "post_mlp_layernorm": "ln_mlp_out"}, {"sandwich_norm": True}),
)
QK_NAMES = (("q_norm", "k_norm"), ("query_layernorm", "key_layernorm"))
LAYER = "model.layers.0."
# where a checkpoint keeps its experts, and each expert's gate, up and down projections' names
EXPERTS = (("mlp.", {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}),
           ("block_sparse_moe.", {"gate": "w1", "up": "w3", "down": "w2"}))


class Reader:
    """config.json's fields as the generic import reads them: each read is recorded, so that what is left unread is
    known and refused unless harmless."""

    def __init__(self, f: Fields):
        self.f, self.read = f, set()

    def __call__(self, *names: str, default: Any = None) -> Any:
        self.read.update(names)
        return self.f.get(*names, default=default)

    def int(self, *names: str, default: Any = None) -> int:
        self.read.update(names)
        return self.f.int(*names) if default is None else self.f.int(*names, default=default)

    def unread(self) -> None:
        for name, value in self.f.data.items():
            if name in self.read or name in IGNORABLE or name.endswith("_token_id") or value is None:
                continue
            if name in NEUTRAL and value in NEUTRAL[name]:
                continue
            raise_unknown(self.f, name, value)


class Shown(str):
    """A long value cut for a one-line refusal, shown without quotes."""

    def __repr__(self) -> str:
        return str(self)


def raise_unknown(f: Fields, name: str, value: Any) -> None:
    shown = value if len(repr(value)) <= 60 else Shown(repr(value)[:57] + "...")
    f.refuse(name, shown, "the generic import does not read this field, which may change the computation; "
             "a family module in model/hf/families/ can")


def family(f: Fields, w: Weights) -> tuple[dict[str, Any], Mapping]:
    """posenc's config values and the weight mapping of a folder whose model_type has no module."""
    if f.data.get("auto_map") is not None:
        f.refuse("auto_map", sorted(f.data["auto_map"]) if isinstance(f.data["auto_map"], dict) else
                 f.data["auto_map"], "custom code is never run; posenc imports only what transformers ships")
    f.refuse_quantized()
    r = Reader(f)
    heads, hidden, n = r.int("num_attention_heads"), r.int("hidden_size"), r.int("num_hidden_layers")
    d_head = r.int("head_dim", default=hidden // heads)
    cfg: dict[str, Any] = {
        "variant": "rope", "vocab_size": r.int("vocab_size"), "d_model": hidden, "n_layers": n, "n_heads": heads,
        "n_kv_heads": r.int("num_key_value_heads", default=heads), "d_head": d_head,
        "d_mlp": r.int("intermediate_size"), "context": f.int("max_position_embeddings", default=2048),
        "activation": f.activation(*r_names(r, "hidden_act", "hidden_activation"), default="silu"),
        "tie_head": bool(r("tie_word_embeddings", default=False)), **norms(f, r, w), **mlp(f, r, w),
        **attention(f, r, w), **multipliers(f, r), **positions(f, r, n)}
    qk = cfg.pop("qk_norm_names")
    layout, moe = cfg.pop("layout"), cfg.pop("experts_names")
    r.unread()

    def weights(c, w):
        D, F, Dh = c.d_model, c.d_mlp, c.head_dim
        yield "tok.weight", w.take("model.embed_tokens.weight", (c.vocab_size, D))
        for i in range(c.n_layers):
            h, b = f"model.layers.{i}.", f"blocks.{i}."
            yield from separate_attention(c, w, h, b)
            if qk:
                size = Dh if c.qk_norm in ("rmsnorm", "layernorm") else None
                for ours, theirs in zip(("q_norm", "k_norm"), qk, strict=True):
                    width = size or (c.n_heads if ours == "q_norm" else c.kv_heads) * Dh
                    yield f"{b}attn.{ours}.weight", w.take(f"{h}self_attn.{theirs}.weight", (width,))
                    if c.qk_norm == "layernorm":
                        yield f"{b}attn.{ours}.bias", w.take(f"{h}self_attn.{theirs}.bias", (width,))
            yield from mlp_weights(c, w, h, b, D, F, moe)
            for theirs, ours in layout.items():
                yield f"{b}{ours}.weight", w.take(f"{h}{theirs}.weight", (D,))
                if c.norm == "layernorm" and c.norm_bias:
                    yield f"{b}{ours}.bias", w.take(f"{h}{theirs}.bias", (D,))
        yield from final_norm_and_head(c, w, "model.norm")

    return cfg, weights


def r_names(r: Reader, *names: str) -> tuple[str, ...]:
    r.read.update(names)
    return names


def norms(f: Fields, r: Reader, w: Weights) -> dict[str, Any]:
    """The layout from layer 0's norm tensors, the kind from their bias and the config's epsilon field."""
    present = {name[len(LAYER):].rsplit(".", 1)[0] for name in w.where if name.startswith(LAYER)}
    found = {name for name in present if "norm" in name and "." not in name}
    layout, values = next(((lay, v) for lay, v in LAYOUTS if set(lay) == found), (None, None))
    if layout is None:
        raise ImportRefusedError(f"{w.folder}: layer 0's norms {sorted(found)} are in none of the {len(LAYOUTS)} "
                                 "layouts the generic import knows (docs/real-models.md)")
    eps_name = next((name for name in EPS if f.data.get(name) is not None), "rms_norm_eps")
    eps = float(r(eps_name, default=1e-6))
    bias = w.has(f"{LAYER}{next(iter(layout))}.bias")
    kind = "layernorm" if bias or eps_name != "rms_norm_eps" else "rmsnorm"
    return {"norm": kind, "norm_bias": bias, "layer_norm_eps": eps, "layout": layout, **values}


def mlp(f: Fields, r: Reader, w: Weights) -> dict[str, Any]:
    """Gated (gate_proj and up_proj, or one fused gate_up_proj) or plain (up_proj only), biases from the tensors; or
    experts in every layer as Mixtral's and Qwen3-MoE's checkpoints spell them (EXPERTS: a bias-free router `gate`,
    one gated MLP per expert), weighed by a softmax over the top num_experts_per_tok logits (norm_topk_prob, where
    the config has it, true)."""
    if moe := next((m for m in EXPERTS if w.has(f"{LAYER}{m[0]}experts.0.{m[1]['gate']}.weight")), None):
        experts, top_k = f.experts(r_names(r, "num_local_experts", "num_experts"), None, top_k_default=2)
        r("num_experts_per_tok", "moe_intermediate_size")
        if not r("norm_topk_prob", default=True):
            f.refuse("norm_topk_prob", False, "posenc's softmax router weighs the chosen experts to sum to 1")
        width = w.shape(f"{LAYER}{moe[0]}experts.0.{moe[1]['gate']}.weight")[0]
        return {"mlp": "gated", "mlp_bias": False, "n_experts": experts, "experts_top_k": top_k,
                "d_expert": width if width != f.int("intermediate_size") else 0, "experts_names": moe}
    gated = w.has(LAYER + "mlp.gate_proj.weight") or w.has(LAYER + "mlp.gate_up_proj.weight")
    return {"mlp": "gated" if gated else "plain", "mlp_bias": w.has(LAYER + "mlp.down_proj.bias"),
            "experts_names": None}


def expert_weights(c, w: Weights, h: str, b: str, D: int, moe):
    """posenc's experts apply x @ W (experts, in, out): each expert's Linear transposed, stacked."""
    E, F, (part, names) = c.n_experts, c.d_expert or c.d_mlp, moe
    yield b + "mlp.router.weight", w.take(f"{h}{part}gate.weight", (E, D))
    for ours, shape in (("gate", (F, D)), ("up", (F, D)), ("down", (D, F))):
        stacked = [w.take(f"{h}{part}experts.{j}.{names[ours]}.weight", shape).t() for j in range(E)]
        yield f"{b}mlp.{ours}.weight", torch.stack(stacked)


def mlp_weights(c, w: Weights, h: str, b: str, D: int, F: int, moe):
    if moe:
        yield from expert_weights(c, w, h, b, D, moe)
        return
    fused = w.has(h + "mlp.gate_up_proj.weight")
    if fused:  # [gate; up] stacked on the output axis (Phi-3's and GLM's layout)
        both = w.take(h + "mlp.gate_up_proj.weight", (2 * F, D))
        yield b + "mlp.gate.weight", both[:F]
        yield b + "mlp.up.weight", both[F:]
    names = (("down", (D, F)),) if fused else (("gate", (F, D)), ("up", (F, D)), ("down", (D, F))) if \
        c.mlp == "gated" else (("up", (F, D)), ("down", (D, F)))
    plain = {"up": "0", "down": "2"} if c.mlp == "plain" else {}
    for name, shape in names:
        yield f"{b}mlp.{plain.get(name, name)}.weight", w.take(f"{h}mlp.{name}_proj.weight", shape)
        if c.mlp_bias:
            yield f"{b}mlp.{plain.get(name, name)}.bias", w.take(f"{h}mlp.{name}_proj.bias", (shape[0],))


def attention(f: Fields, r: Reader, w: Weights) -> dict[str, Any]:
    """Biases and the q/k norm from the tensors; the config's bias fields, where present, must agree."""
    values: dict[str, Any] = {"qkv_bias": w.has(LAYER + "self_attn.q_proj.bias"),
                              "out_bias": w.has(LAYER + "self_attn.o_proj.bias"), "qk_norm_names": ()}
    for name in ("attention_bias", "use_bias", "attention_out_bias", "mlp_bias", "use_qk_norm", "qk_layernorm",
                 "use_post_norm"):
        r(name)  # each is read as the tensors show it (the proof at import holds the two to agree)
    names = next((pair for pair in QK_NAMES if w.has(f"{LAYER}self_attn.{pair[0]}.weight")), None)
    if names is not None:
        width = w.shape(f"{LAYER}self_attn.{names[0]}.weight")[0]
        heads, d_head = f.int("num_attention_heads"), f.int("head_dim", default=f.int("hidden_size") //
                                                            f.int("num_attention_heads"))
        biased = w.has(f"{LAYER}self_attn.{names[0]}.bias")
        per_head = width == d_head
        if not per_head and width != heads * d_head:
            f.refuse("head_dim", d_head, f"q norm width {width}: one head's or all heads' queries")
        values.update(qk_norm=("layernorm" if biased else "rmsnorm") if per_head else "rmsnorm_all_heads",
                      qk_norm_names=names)
    return values


def multipliers(f: Fields, r: Reader) -> dict[str, Any]:
    """Granite's and HyperCLOVA X's muP multipliers, Cohere's logit_scale, Gemma 2's score scale and soft caps."""
    values: dict[str, Any] = {"logit_scale": 1.0}
    if r("embedding_multiplier") is not None:
        values["embed_scale"] = f.number("embedding_multiplier", 1.0)
    if r("logits_scaling") is not None:  # Granite divides the logits by it
        values["logit_scale"] = 1.0 / f.number("logits_scaling", 1.0)
    if r("logit_scale") is not None:
        values["logit_scale"] *= f.number("logit_scale", 1.0)
    if r("attention_multiplier") is not None:  # the scores' scale itself: 1/sqrt(attn_scale_dim)
        values["attn_scale_dim"] = 1.0 / f.number("attention_multiplier", 1.0) ** 2
    if r("query_pre_attn_scalar") is not None:
        values["attn_scale_dim"] = f.number("query_pre_attn_scalar", 1.0)
    r("attn_logit_softcapping", "final_logit_softcapping")
    values["attn_softcap"] = f.number("attn_logit_softcapping", 0.0, zero=True)
    values["final_softcap"] = f.number("final_logit_softcapping", 0.0, zero=True)
    return values


def positions(f: Fields, r: Reader, n: int) -> dict[str, Any]:
    """RoPE (rope_parameters, one entry per layer type where they differ, or the older fields), which layers
    rotate (no_rope_layers), and each layer's attention (layer_types; sliding_window over every layer without it)."""
    for name in ("rope_parameters", "rope_scaling", "rope_theta", "partial_rotary_factor", "sliding_window",
                 "original_max_position_embeddings", "layer_types", "no_rope_layers", "no_rope_layer_interval",
                 "use_sliding_window", "max_window_layers", "attention_chunk_size", "rotary_emb_base"):
        r(name)
    params = f.data.get("rope_parameters")
    values: dict[str, Any] = {}
    per_type = isinstance(params, dict) and params and set(params) <= set(ATTENTION)
    encoding = ["model"] * n
    if per_type:
        kinds = list(params.values())
        glob = params.get("full_attention", kinds[0])
        values = Fields({**f.data, "rope_parameters": glob}, f.path, f.rope_override).rope()
        local = params.get("sliding_attention", glob)
        if local != glob:
            if local.get("rope_type", "default") != "default" or set(local) - {"rope_type", "rope_theta"}:
                f.refuse("rope_parameters.sliding_attention", local, "the sliding layers' RoPE unscaled")
            values["local_rope_base"] = float(local["rope_theta"])
            types = f.layer_types(n, ["full_attention"] * n)
            encoding = ["local" if t == "sliding_attention" else "model" for t in types]
    else:
        values = f.rope()
    if "no_rope_layers" in f.data or "no_rope_layer_interval" in f.data:
        encoding = [e if rotates else "none" for e, rotates in zip(encoding, f.rotating(n), strict=True)]
    if f.data.get("layer_types") is not None:
        types = f.layer_types(n, [], kinds=tuple(ATTENTION))
    else:
        switch = "use_sliding_window" if "use_sliding_window" in f.data else None
        window = f.window(n, switch=switch, per_layer=switch is not None)
        if encoding == ["model"] * n:
            return {**values, **window}
        types = [f"{spec.attention}_attention" for spec in window.get("layers", ())] or ["full_attention"] * n
    chunk = {"attention_chunk": f.int("attention_chunk_size")} if "chunked_attention" in types else {}
    return {**values, **chunk, **f.layers(types, encoding=encoding)}
