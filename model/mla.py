"""Multi-head latent attention (DeepSeek-V2 and V3): queries, keys and values made from low-rank latents.

Per token, kv_down maps the hidden state to a latent of mla_kv_rank values and one key part of rope_dims values
shared by every head; the latent is RMS-normed and kv_up expands it to each head's key part without positions
(head_dim - rope_dims) and its value (v_head_dim).  Queries come from the hidden state through a normed latent of
mla_q_rank (q_down, q_norm, q_up) or one projection (q_up alone).  RoPE rotates only the shared key part and each
query's rope_dims, so a head's scores are q_nope . k_nope + rot(q_rope) . rot(k_rope).

The attention itself is posenc's (Attention's forward: masks, sinks, Attention-23 on export, the KV cache): this
module only makes q, k and v, and reads the output.  Each head's query and key are laid out [rope | nope] (DeepSeek's
order is [nope | rope]; a score is the same dot product either way) because the RoPE variant rotates a head's first
rope_dims dims.  What the cache keeps is the expanded per-head keys and values, not the latent: exact, and a cache of
the same (batch, heads, length, head_dim) shape as every other model, which the worker's layouts and onnxruntime's
GroupQueryAttention take as they are.  Values narrower than the key's head_dim are cached zero-padded to it (their
pad stays 0 through the attention's weighted sum and is dropped before the output projection); a latent cache of
mla_kv_rank + rope_dims per token is what DeepSeek's own inference keeps instead.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from model.attention import Attention
from model.config import ModelConfig
from model.layers import RMSNorm


class LatentAttention(Attention):
    """Attention whose q, k and v come from latents (the config's mla_* fields); the same outputs as Attention:
    (output, probabilities (B, H, T, S), present (k, v) each (B, H, S, head_dim))."""

    def projections(self, cfg: ModelConfig) -> None:
        D, H, Dh = cfg.d_model, cfg.n_heads, cfg.head_dim
        self.rope, self.value_dim = cfg.rope_dims or cfg.rope_dim, cfg.v_head_dim or Dh
        self.nope = Dh - self.rope
        self.q_latent = bool(cfg.mla_q_rank)
        if self.q_latent:
            self.q_down = nn.Linear(D, cfg.mla_q_rank, bias=cfg.qkv_bias)
            self.q_latent_norm = RMSNorm(cfg.mla_q_rank, cfg.mla_norm_eps)
        self.q_up = nn.Linear(cfg.mla_q_rank or D, H * Dh, bias=False)
        self.kv_down = nn.Linear(D, cfg.mla_kv_rank + self.rope, bias=cfg.qkv_bias)
        self.kv_norm = RMSNorm(cfg.mla_kv_rank, cfg.mla_norm_eps)
        self.kv_up = nn.Linear(cfg.mla_kv_rank, H * (self.nope + self.value_dim), bias=False)
        self.out = nn.Linear(H * self.value_dim, D, bias=cfg.out_bias)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        B, T, _ = x.shape
        H, Dh, R = self.n_heads, self.head_dim, self.rope
        latent_q = self.q_latent_norm(self.q_down(x)) if self.q_latent else x
        q = self.q_up(latent_q).view(B, T, H, Dh)  # each head [nope | rope]
        kv = self.kv_down(x)
        latent, k_rope = kv[..., :-R], kv[..., -R:]
        kv = self.kv_up(self.kv_norm(latent)).view(B, T, H, self.nope + self.value_dim)  # each head [k_nope | v]
        q = torch.cat((q[..., self.nope:], q[..., :self.nope]), dim=-1)  # [rope | nope]
        k = torch.cat((k_rope[:, :, None].expand(B, T, H, R), kv[..., :self.nope]), dim=-1)
        v = F.pad(kv[..., self.nope:], (0, Dh - self.value_dim))  # zeros past value_dim
        return q.reshape(B, T, H * Dh), k.reshape(B, T, H * Dh), v.reshape(B, T, H * Dh)

    def output(self, y: torch.Tensor) -> torch.Tensor:
        B, T, _ = y.shape
        y = y.reshape(B, T, self.n_heads, self.head_dim)[..., :self.value_dim]  # the values' pad dropped
        return self.out(y.reshape(B, T, self.n_heads * self.value_dim))
