"""The parts a block is built from, chosen by config values (never by a family's or a variant's name).

Parameter names are the checkpoint's: a LayerNorm has weight and bias, an RMSNorm only weight, the plain MLP keeps
nn.Sequential's 0/2 so checkpoints written before these choices existed still load.
"""

from __future__ import annotations

import torch
from torch import nn

from model.config import ModelConfig


class RMSNorm(nn.Module):
    """x * rsqrt(mean(x^2) + eps) * weight, computed in float32 (LLaMA's LlamaRMSNorm)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def make_norm(cfg: ModelConfig) -> nn.Module:
    if cfg.norm == "rmsnorm":
        return RMSNorm(cfg.d_model, cfg.layer_norm_eps)
    return nn.LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps, bias=cfg.norm_bias)


class PerHeadLayerNorm(nn.Module):
    """A bias-free LayerNorm over head_dim with its own weight per head (StableLM's qk_layernorm); x (..., H, Dh)."""

    def __init__(self, heads: int, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(heads, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.layer_norm(x, x.shape[-1:], eps=self.eps) * self.weight


def make_head_norm(cfg: ModelConfig, heads: int) -> nn.Module | None:
    """The norm of queries (heads = n_heads) or keys (kv_heads) cfg.qk_norm asks for, or None: per head over
    head_dim, or (rmsnorm_all_heads) over all the heads' heads * head_dim values together."""
    if cfg.qk_norm == "rmsnorm":
        return RMSNorm(cfg.head_dim, cfg.layer_norm_eps)
    if cfg.qk_norm == "rmsnorm_all_heads":
        return RMSNorm(heads * cfg.head_dim, cfg.layer_norm_eps)
    if cfg.qk_norm == "layernorm":
        return nn.LayerNorm(cfg.head_dim, eps=cfg.layer_norm_eps)
    if cfg.qk_norm == "layernorm_per_head":
        return PerHeadLayerNorm(heads, cfg.head_dim, cfg.layer_norm_eps)
    return None


def make_activation(name: str) -> nn.Module:
    return {"gelu": nn.GELU(), "gelu_tanh": nn.GELU(approximate="tanh"), "silu": nn.SiLU(), "relu": nn.ReLU()}[name]


class PlainMLP(nn.Sequential):
    """down(act(up(x))): GPT-2, GPT-NeoX, BLOOM and posenc's own models."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(nn.Linear(cfg.d_model, cfg.d_mlp, bias=cfg.mlp_bias), make_activation(cfg.activation),
                         nn.Linear(cfg.d_mlp, cfg.d_model, bias=cfg.mlp_bias))

    @property
    def down(self) -> nn.Linear:
        return self[2]


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)): SwiGLU when act is silu (LLaMA)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate = nn.Linear(cfg.d_model, cfg.d_mlp, bias=cfg.mlp_bias)
        self.up = nn.Linear(cfg.d_model, cfg.d_mlp, bias=cfg.mlp_bias)
        self.down = nn.Linear(cfg.d_mlp, cfg.d_model, bias=cfg.mlp_bias)
        self.act = make_activation(cfg.activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.act(self.gate(x)) * self.up(x))


def make_mlp(cfg: ModelConfig) -> nn.Module:
    return GatedMLP(cfg) if cfg.mlp == "gated" else PlainMLP(cfg)
