"""Decoder-only transformer with explicit attention, KV cache and per-head attention probabilities.

Reads top-down in build order: attention, block, model.  The positional variant enters only through its three
hooks; nothing here branches on the variant name.  Positions always come from the attention mask
(cumsum - 1 over past + new), so a left-padded row, a cached decode step and an unpadded full forward see the
same positions.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from model.config import ModelConfig
from model.variants import PositionalVariant, build_variant

KV = tuple[torch.Tensor, torch.Tensor]


class ModelOutput(NamedTuple):
    logits: torch.Tensor  # (B, T, V)
    attentions: torch.Tensor | None  # (B, L, H, T, S) post-softmax probabilities, exactly 0 where masked
    presents: tuple[KV, ...]  # per layer (key, value), each (B, H, S, Dh); keys after rotation
    state: tuple[torch.Tensor, ...] = ()  # the variant's own decoding state after these tokens (cpe), if any


def positions_from_mask(mask: torch.Tensor) -> torch.Tensor:
    """Position of every slot: number of real tokens before it.  Pad slots get 0 (they are masked anyway)."""
    return (mask.cumsum(-1) - 1).clamp(min=0)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int = 0):
        super().__init__()
        self.n_heads, self.head_dim, self.layer = cfg.n_heads, cfg.head_dim, layer
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.out = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor, pos: PositionalVariant, q_pos: torch.Tensor, k_pos: torch.Tensor,
                allowed: torch.Tensor, past: KV, shared_bias: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
        B, T, D = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.n_heads, self.head_dim).permute(2, 0, 3, 1, 4)  # (B, H, T, Dh)
        q, k = pos.rotate(q, k, q_pos, q_pos)  # new keys are the new tokens: their positions are q_pos
        k = torch.cat((past[0], k), dim=2)  # (B, H, S, Dh)
        v = torch.cat((past[1], v), dim=2)

        scores = (q @ k.transpose(-1, -2)) / math.sqrt(self.head_dim)  # (B, H, T, S)
        if pos.content_scale != 1.0:  # a model constant (DeBERTa), not a branch on data
            scores = scores * pos.content_scale
        bias = shared_bias if shared_bias is not None else pos.score_bias(q, q_pos, k_pos, k=k, layer=self.layer)
        if bias is not None:
            scores = scores + bias
        # Replace (not add) masked scores with the most negative float: a row with no visible key (a pad query)
        # then gives a finite uniform row instead of NaN; `where` makes every masked probability exactly 0.
        scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
        probs = torch.where(allowed, F.softmax(scores, dim=-1), 0.0)
        y = (probs @ v).transpose(1, 2).reshape(B, T, D)  # (B, T, D)
        return self.out(y), probs, (k, v)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int = 0):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps)
        self.attn = Attention(cfg, layer)
        self.ln2 = nn.LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps)
        self.mlp = nn.Sequential(nn.Linear(cfg.d_model, cfg.d_mlp), nn.GELU(), nn.Linear(cfg.d_mlp, cfg.d_model))

    def forward(self, x, pos, q_pos, k_pos, allowed, past, shared_bias):
        a, probs, present = self.attn(self.ln1(x), pos, q_pos, k_pos, allowed, past, shared_bias)
        x = x + a
        x = x + self.mlp(self.ln2(x))
        return x, probs, present


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = build_variant(cfg)
        self.blocks = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps)
        self.apply(self._init)
        for block in self.blocks:  # GPT-2: scale residual projections by depth
            nn.init.normal_(block.attn.out.weight, std=0.02 / math.sqrt(2 * cfg.n_layers))
            nn.init.normal_(block.mlp[2].weight, std=0.02 / math.sqrt(2 * cfg.n_layers))

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding) and m.weight.shape[0] > 0:
            nn.init.normal_(m.weight, std=0.02)

    def empty_past(self, batch: int) -> tuple[KV, ...]:
        shape = (batch, self.cfg.n_heads, 0, self.cfg.head_dim)
        z = self.tok.weight.new_zeros(shape)
        return tuple((z, z) for _ in range(self.cfg.n_layers))

    def initial_state(self, batch: int) -> tuple[torch.Tensor, ...]:
        """The variant's decoding state before any token (zeros), one tensor per state_spec entry."""
        return tuple(self.tok.weight.new_zeros((batch, *shape)) for _, shape in self.pos.state_spec())

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                past_key_values: tuple[KV, ...] | None = None, output_attentions: bool = True,
                state: tuple[torch.Tensor, ...] | None = None) -> ModelOutput:
        B, T = input_ids.shape
        past = past_key_values if past_key_values is not None else self.empty_past(B)
        P = past[0][0].shape[2]
        if attention_mask is None:
            attention_mask = torch.ones(B, P + T, dtype=torch.int64, device=input_ids.device)
        if not torch.compiler.is_exporting():
            self.pos.check_length(P + T)
            if attention_mask.shape != (B, P + T):
                raise ValueError(f"attention_mask must be (batch, past + new) = ({B}, {P + T}), "
                                 f"got {tuple(attention_mask.shape)}")

        k_pos = positions_from_mask(attention_mask)  # (B, S)
        q_pos = k_pos[:, -T:]  # (B, T)
        # causal by slot index (new token t sits at slot P + t) and never onto a padded key
        q_idx = torch.arange(T, device=input_ids.device) + (attention_mask.shape[1] - T)
        k_idx = torch.arange(attention_mask.shape[1], device=input_ids.device)
        allowed = (k_idx[None, :] <= q_idx[:, None])[None, None] & attention_mask.bool()[:, None, None, :]

        x = self.pos.embed(self.tok(input_ids), q_pos)  # (B, T, D)
        new_state: tuple[torch.Tensor, ...] = ()
        if self.pos.state_spec():  # a model constant: only stateful variants (cpe) take this path
            state = state if state is not None else self.initial_state(B)
            x, new_state = self.pos.embed_state(x, attention_mask[:, -T:], state)
        # a bias that ignores the queries is the same in every layer: build it once
        shared_bias = None if self.pos.query_dependent_bias else self.pos.score_bias(None, q_pos, k_pos)
        all_probs, presents = [], []
        for block, layer_past in zip(self.blocks, past, strict=True):
            x, probs, present = block(x, self.pos, q_pos, k_pos, allowed, layer_past, shared_bias)
            all_probs.append(probs)
            presents.append(present)
        logits = self.ln_f(x) @ self.tok.weight.t()  # tied input/output embedding, (B, T, V)
        attentions = torch.stack(all_probs, dim=1) if output_attentions else None  # training skips the copy
        return ModelOutput(logits, attentions, tuple(presents), new_state)
