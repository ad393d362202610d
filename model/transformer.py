"""Decoder-only transformer with explicit attention, KV cache and per-head attention probabilities.

Reads top-down in build order: block, model; the attention is model/attention.py's (model/mla.py's where the
config has a latent).  The positional variant enters only through its hooks; nothing here branches on the variant
name.  Positions always come from the attention mask (cumsum - 1 over past + new), so a left-padded row, a cached
decode step and an unpadded full forward see the same positions.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import nn
from torch.nn import functional as F

from model.attention import KV, Attention, Intervention, Positions, positions_from_mask
from model.config import ModelConfig
from model.deltanet import GatedDeltaNet
from model.errors import ConfigError
from model.layers import make_mlp, make_norm
from model.mixers import NoMixer, NoMLP, ShortConv
from model.mla import LatentAttention
from model.ssm import Mamba2
from model.variants import build_variant


class ModelOutput(NamedTuple):
    logits: torch.Tensor  # (B, T, V)
    attentions: torch.Tensor | None  # (B, L, H, T, S) post-softmax probabilities, exactly 0 where masked
    presents: tuple[tuple[torch.Tensor, ...], ...]  # per attention layer (key, value), each (B, H, S, Dh), keys
    #                                                 after rotation; per mixer layer its fixed-size state (after
    #                                                 the key and value where the mixer is beside the attention)
    state: tuple[torch.Tensor, ...] = ()  # the variant's own decoding state after these tokens (cpe), if any
    # with use_exact_maps: (B, M, heads, T, S) the exact matrices of the M layers with a mixer (in layer order, a
    # mixer beside an attention included), each layer's mixer_map_heads of them first, zeros after
    mixer_maps: torch.Tensor | None = None


def make_attention(cfg: ModelConfig, layer: int) -> nn.Module:
    """A block's token mixer: a gated short convolution, a Mamba-2 or a Gated DeltaNet layer where the layer's record
    says so (model/mixers.py, model/ssm.py, model/deltanet.py), else
    multi-head latent attention where the config has a latent (mla_kv_rank), else Attention."""
    if not cfg.attends(layer):
        return {"mamba2": Mamba2, "gated_deltanet": GatedDeltaNet, "short_conv": ShortConv,
                "none": NoMixer}[cfg.layer(layer).mixer](cfg, layer)
    return LatentAttention(cfg, layer) if cfg.mla_kv_rank else Attention(cfg, layer)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int = 0):
        super().__init__()
        self.parallel, self.shared, self.post = cfg.parallel_residual, cfg.shared_norm, cfg.post_norm
        self.residual = cfg.residual_scale
        spec = cfg.layer(layer)  # a branch the record leaves out (Nemotron-H's one-part blocks) has no norm either
        if (spec.mixer == "none" or not spec.mlp) and (self.parallel or self.post or cfg.sandwich_norm):
            raise ConfigError(f"layers[{layer}] leaves a branch out, which only a sequential pre-norm block can")
        self.ln1 = make_norm(cfg) if cfg.pre_norm and spec.mixer != "none" else nn.Identity()  # OLMo 2: no pre-norm
        self.attn = make_attention(cfg, layer)
        self.mixes = not cfg.attends(layer)
        if not self.shared:
            self.ln2 = make_norm(cfg) if cfg.pre_norm and spec.mlp else nn.Identity()
        self.mlp = make_mlp(cfg, layer) if spec.mlp else NoMLP()
        # Falcon-H1: a Mamba-2 layer reads the same normed input as the attention; their outputs are summed
        self.beside = Mamba2(cfg, layer, beside=True) if spec.beside == "mamba2" else None
        if self.beside is not None and (self.parallel or self.post or cfg.sandwich_norm):
            raise ConfigError(f"layers[{layer}] has a mixer beside its attention, which only a sequential pre-norm "
                              "block can")
        if cfg.sandwich_norm:  # Gemma 2: each branch's output normed before its residual add
            self.ln_attn_out, self.ln_mlp_out = make_norm(cfg), make_norm(cfg)

    def mix(self, h: torch.Tensor, positions: Positions, past: KV) -> tuple[torch.Tensor, ...]:
        """The token-mixing branch: (output, maps, carried tensors, the mixer's exact matrices or None)."""
        if self.mixes:  # a mixer layer: its fourth value is its exact matrices (with exact_maps)
            return self.attn(h, positions, past)
        if self.beside is None:
            return (*self.attn(h, positions, past), None)
        # the carried tensors are the attention's (key, value), then the mixer's state
        a, probs, present = self.attn(h, positions, past[:2])
        s, _, state, exact = self.beside(h, positions, past[2:])
        return a + s, probs, (*present, *state), exact

    def forward(self, x: torch.Tensor, positions: Positions, past: KV) -> tuple[torch.Tensor, ...]:
        """(output, maps, carried tensors, the layer's mixer's exact matrices or None)."""
        if self.post:  # OPT-350m: x = ln(x + f(x)) around each branch
            a, probs, present, exact = self.mix(x, positions, past)
            x = self.ln1(x + a)
            return self.ln2(x + self.mlp(x)), probs, present, exact
        h = self.ln1(x)
        a, probs, present, exact = self.mix(h, positions, past)
        if self.parallel:  # GPT-NeoX: both branches read the block's input (GPT-J: the same normed input)
            return x + a + self.mlp(h if self.shared else self.ln2(x)), probs, present, exact
        if hasattr(self, "ln_attn_out"):
            x = x + self.ln_attn_out(a)
            return x + self.ln_mlp_out(self.mlp(self.ln2(x))), probs, present, exact
        if self.residual != 1.0:  # a model constant (Granite's residual_multiplier)
            x = x + a * self.residual
            return x + self.mlp(self.ln2(x)) * self.residual, probs, present, exact
        x = x + a
        x = x + self.mlp(self.ln2(x))
        return x, probs, present, exact


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = build_variant(cfg)
        if cfg.embed_norm:
            self.ln_emb = make_norm(cfg)
        self.blocks = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
        self.ln_f = nn.Identity() if cfg.post_norm else make_norm(cfg)  # post-norm blocks end normed
        if not cfg.tie_head:
            self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=cfg.head_bias)
        self.apply(self._init)
        for part in (p for block in self.blocks for p in (block.attn, block.mlp)):  # GPT-2: residual projections
            if hasattr(part, "out") or hasattr(part, "down"):  # scaled by depth
                projection = part.out if hasattr(part, "out") else part.down
                nn.init.normal_(projection.weight, std=0.02 / math.sqrt(2 * cfg.n_layers))

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding) and m.weight.shape[0] > 0:
            nn.init.normal_(m.weight, std=0.02)

    def use_onnx_ops(self, on: bool = True) -> Transformer:
        """Write attention (and RoPE's rotation) with torch.onnx.ops for export (Attention-23, RotaryEmbedding-23);
        see Attention.onnx_ops.  Returns the model."""
        for block in self.blocks:
            block.attn.onnx_ops = on
        self.pos.onnx_ops = on
        return self

    def use_exact_maps(self, on: bool = True) -> Transformer:
        """Make forward return every mixer's exact matrices (ModelOutput.mixer_maps; the maps graph,
        export/intervene.py).  Returns the model."""
        for block in self.blocks:
            for part in (block.attn, block.beside):
                if hasattr(part, "exact_maps"):
                    part.exact_maps = on
        return self

    def empty_past(self, batch: int) -> tuple[tuple[torch.Tensor, ...], ...]:
        """Each layer's carried tensors before any token: an attention layer's empty keys and values, a mixer's
        zero state (both where a mixer runs beside the attention)."""
        z = self.tok.weight.new_zeros((batch, self.cfg.kv_heads, 0, self.cfg.head_dim))
        return tuple(((z, z) if self.cfg.attends(i) else ()) +
                     tuple(self.tok.weight.new_zeros((batch, *shape)) for _, shape in self.cfg.mixer_states(i))
                     for i in range(self.cfg.n_layers))

    def initial_state(self, batch: int) -> tuple[torch.Tensor, ...]:
        """The variant's decoding state before any token (zeros), one tensor per state_spec entry."""
        return tuple(self.tok.weight.new_zeros((batch, *shape)) for _, shape in self.pos.state_spec())

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                past_key_values: tuple[tuple[torch.Tensor, ...], ...] | None = None, output_attentions: bool = True,
                state: tuple[torch.Tensor, ...] | None = None,
                position_ids: torch.Tensor | None = None, intervention: Intervention | None = None) -> ModelOutput:
        """position_ids (B, past + new) int64, when given, replace the mask's count as every slot's position
        (training on randomized positions, model/train.py's random_positions; a request's own positions);
        None: cumsum(mask) - 1.  intervention: per-row switches of each layer's encoding, head ablations and RoPE
        frequencies (model.attention.Intervention; the intervention graph's inputs)."""
        B, T = input_ids.shape
        past = past_key_values if past_key_values is not None else self.empty_past(B)
        P = past[next(i for i in range(self.cfg.n_layers) if self.cfg.attends(i))][0].shape[2]  # cached positions
        if attention_mask is None:
            attention_mask = torch.ones(B, P + T, dtype=torch.int64, device=input_ids.device)
        if not torch.compiler.is_exporting():
            self.pos.check_length(P + T)
            if attention_mask.shape != (B, P + T):
                raise ValueError(f"attention_mask must be (batch, past + new) = ({B}, {P + T}), "
                                 f"got {tuple(attention_mask.shape)}")

        k_pos = positions_from_mask(attention_mask) if position_ids is None else position_ids  # (B, S)
        q_pos = k_pos[:, -T:]  # (B, T)
        # causal by slot index (new token t sits at slot P + t) and never onto a padded key
        q_idx = torch.arange(T, device=input_ids.device) + (attention_mask.shape[1] - T)
        k_idx = torch.arange(attention_mask.shape[1], device=input_ids.device)
        allowed = (k_idx[None, :] <= q_idx[:, None])[None, None] & attention_mask.bool()[:, None, None, :]
        masked = torch.zeros(allowed.shape, dtype=self.tok.weight.dtype, device=input_ids.device)
        window, chunk, temperature = None, None, None
        if self.cfg.attention_chunk:  # a model constant: a query sees only the keys of its own block of positions
            C = self.cfg.attention_chunk
            same = (torch.div(q_pos, C, rounding_mode="floor")[:, :, None] ==
                    torch.div(k_pos, C, rounding_mode="floor")[:, None, :])[:, None]  # (B, 1, T, S)
            chunk = masked.masked_fill(~(allowed & same), torch.finfo(masked.dtype).min)
        if self.cfg.temperature_floor:  # a model constant: log1p(floor((p + 1) / floor)) * scale + 1 per query
            steps = torch.floor((q_pos.to(torch.float32) + 1.0) / self.cfg.temperature_floor)
            temperature = (torch.log1p(steps) * self.cfg.temperature_scale + 1.0)[..., None].to(masked.dtype)
        if self.cfg.sliding_window:  # a model constant: keys at position distance >= the window are hidden too
            inside = (q_pos[:, :, None] - k_pos[:, None, :] < self.cfg.sliding_window)[:, None]  # (B, 1, T, S)
            window = masked.masked_fill(~(allowed & inside), torch.finfo(masked.dtype).min)
        masked = masked.masked_fill(~allowed, torch.finfo(masked.dtype).min)  # (B, 1, T, S), added to scores
        real = attention_mask[:, None, -T:, None].to(masked.dtype)  # (B, 1, T, 1): 0 on a pad query's row

        tokens = self.tok(input_ids)
        if self.cfg.embed_scale != 1.0:  # a model constant (Gemma: sqrt(d_model))
            tokens = tokens * self.cfg.embed_scale
        x = self.pos.embed(tokens, q_pos)  # (B, T, D)
        if self.cfg.embed_norm:
            x = self.ln_emb(x)
        new_state: tuple[torch.Tensor, ...] = ()
        if self.pos.state_spec():  # a model constant: only stateful variants (cpe) take this path
            state = state if state is not None else self.initial_state(B)
            x, new_state = self.pos.embed_state(x, attention_mask[:, -T:], state)
        # a bias that ignores the queries is the same in every layer: folded into the mask once
        apart = None  # under an intervention the query-free bias stays apart: each layer adds it where it is on
        if not self.pos.query_dependent_bias:
            bias = self.pos.score_bias(None, q_pos, k_pos)
            if intervention is not None:
                apart = bias
            elif bias is not None:
                masked = masked + bias
                window = None if window is None else window + bias
                chunk = None if chunk is None else chunk + bias
        positions = Positions(self.pos, q_pos, k_pos, masked, real, window, chunk, temperature, apart, intervention,
                              attention_mask)
        all_probs, presents, exact = [], [], []
        for block, layer_past in zip(self.blocks, past, strict=True):
            x, probs, present, rows = block(x, positions, layer_past)
            all_probs.append(probs)
            presents.append(present)
            if rows is not None:
                exact.append(rows)
        h = self.ln_f(x)
        logits = h @ self.tok.weight.t() if self.cfg.tie_head else self.head(h)  # (B, T, V)
        if self.cfg.logit_scale != 1.0:  # a model constant (Cohere)
            logits = logits * self.cfg.logit_scale
        if self.cfg.final_softcap:  # a model constant (Gemma 2's final_logit_softcapping)
            logits = torch.tanh(logits / self.cfg.final_softcap) * self.cfg.final_softcap
        attentions = torch.stack(all_probs, dim=1) if output_attentions else None  # training skips the copy
        mixer_maps = None
        if exact:  # each layer's matrices, zero-padded to the most any layer has
            most = max(r.shape[1] for r in exact)
            mixer_maps = torch.stack([F.pad(r, (0, 0, 0, 0, 0, most - r.shape[1])) for r in exact], dim=1)
        return ModelOutput(logits, attentions, tuple(presents), new_state, mixer_maps)
