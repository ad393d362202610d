"""A Gated DeltaNet layer (Yang, Kautz and Hatamizadeh 2025, "Gated Delta Networks", arXiv 2412.06464) as a block's
token mixer: a layer whose record says mixer "gated_deltanet" (Qwen3-Next's linear-attention layers).

in_proj makes the queries and keys (ssm_groups key heads of ssm_state), the values and the output gate z (ssm_heads
value heads of ssm_head_dim), and per value head a write strength b and a decay input a.  q, k and v go through a
causal depthwise convolution of conv_kernel taps and SiLU; q and k are L2-normalized per head, q scaled by
ssm_state ** -0.5, and each key head serves ssm_heads / ssm_groups consecutive value heads.  With beta_t = sigmoid(b_t)
and alpha_t = exp(g_t), g_t = -exp(A_log) softplus(a_t + dt_bias), each value head's state S (ssm_state x
ssm_head_dim) follows the gated delta rule

    S_t = alpha_t S_{t-1} + k_t beta_t (v_t - alpha_t S_{t-1}^T k_t)^T,    o_t = S_t^T q_t,

which over a call's tokens is one matrix (the paper's UT form): with Gamma[i, j] = alpha_{j+1} ... alpha_i (j <= i)
and L = strictly-lower(diag(beta) (Gamma * K K^T)),

    O = W V + (a term of the carried state S_0 alone),    W = (Gamma * Q K^T, j <= i) (I + L)^{-1} diag(beta).

This module computes that form directly, for prompts and decode steps alike.  W is lower-triangular, signed, and its
rows need not sum to 1: it is the layer's map (value heads averaged in n_heads equal groups), over the call's own
keys.  (I + L)^{-1} is a unit lower-triangular inverse: torch.linalg.solve_triangular here, onnxruntime's
com.microsoft Inverse in an exported graph (ONNX has no triangular solve).  o is RMS-normed per head (one weight of
ssm_head_dim shared by the heads) and gated, norm(o) * silu(z), then out_proj.

Pads never act: their convolution inputs never enter a window (model.mixers.causal_windows), their beta is 0 (no
write) and their g is 0 (no decay), so a padded row gives what the row alone gives.  The carried state is
(past_conv.{i}, past_ssm.{i}): the last conv_kernel - 1 inputs and S (ssm_heads, ssm_state, ssm_head_dim).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from model.config import ModelConfig
from model.errors import ConfigError
from model.mixers import causal_windows
from model.ssm import ablate_head_groups, head_group_maps, placed, segment_sums


def unit_lower_inverse(a: torch.Tensor) -> torch.Tensor:
    """(..., T, T) unit lower-triangular -> its inverse: onnxruntime's Inverse contrib op in an exported graph."""
    if torch.onnx.is_in_onnx_export():
        return torch.onnx.ops.symbolic("com.microsoft::Inverse", (a,), {}, dtype=a.dtype, shape=a.shape, version=1)
    eye = torch.eye(a.shape[-1], dtype=a.dtype, device=a.device).expand_as(a)
    return torch.linalg.solve_triangular(a, eye, upper=False, unitriangular=True)


def l2_normalized(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x * rsqrt(sum(x^2) + eps) over the last dim (the FLA library's l2norm, transformers' l2norm)."""
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


class GatedDeltaNet(nn.Module):
    """Qwen3-Next's Qwen3NextGatedDeltaNet (transformers' torch path) as a block's token mixer; forward has
    Attention's signature and returns (output, the layer's maps (B, n_heads, T, S), (conv state, delta state), every
    value head's own matrix (B, heads, T, S) with exact_maps, else None)."""

    onnx_ops = False  # Transformer.use_onnx_ops sets it on every mixer; the inverse is an ONNX op in any export
    exact_maps = False  # Transformer.use_exact_maps sets it

    def __init__(self, cfg: ModelConfig, layer: int = 0):
        super().__init__()
        self.heads, self.dv, self.dk, self.k_heads = cfg.ssm_heads, cfg.ssm_head_dim, cfg.ssm_state, cfg.ssm_groups
        self.kernel, self.layer, self.map_heads, self.eps = cfg.conv_kernel, layer, cfg.n_heads, cfg.layer_norm_eps
        if self.heads % cfg.n_heads:
            raise ConfigError(f"a gated_deltanet layer's maps average its ssm_heads ({self.heads}) over the model's "
                              f"n_heads ({cfg.n_heads}): it must be a multiple")
        H, K = self.heads, self.k_heads * self.dk
        self.width = 2 * K + H * self.dv
        self.in_proj = nn.Linear(cfg.d_model, self.width + H * self.dv + 2 * H, bias=False)  # q k v | z | b a
        self.conv = nn.Conv1d(self.width, self.width, self.kernel, groups=self.width, bias=cfg.conv_bias)
        self.dt_bias = nn.Parameter(torch.ones(H))
        self.A_log = nn.Parameter(torch.log(torch.linspace(1.0, 16.0, H)))
        self.norm_weight = nn.Parameter(torch.ones(self.dv))
        self.out = nn.Linear(H * self.dv, cfg.d_model, bias=False)

    def forward(self, hidden: torch.Tensor, positions, past: tuple[torch.Tensor, ...]):
        previous, s0 = past  # (B, K-1, width), (B, H, dk, dv)
        Bn, T, _ = hidden.shape
        H, dk, dv, r = self.heads, self.dk, self.dv, self.heads // self.k_heads
        slots = positions.slots[:, -T:]  # (B, T) int64, 1 on a real token
        real = slots.to(hidden.dtype)
        qkv, z, b, a = self.in_proj(hidden).split([self.width, H * dv, H, H], dim=-1)
        window, conv_state = causal_windows(previous, qkv * real[..., None], slots, self.kernel)
        qkv = torch.einsum("btkd,dk->btd", window, self.conv.weight[:, 0].flip(-1))
        if self.conv.bias is not None:
            qkv = qkv + self.conv.bias
        q, k, v = F.silu(qkv).split([self.k_heads * dk, self.k_heads * dk, H * dv], dim=-1)
        q = l2_normalized(q.unflatten(-1, (self.k_heads, dk))).repeat_interleave(r, dim=2) * dk ** -0.5
        k = l2_normalized(k.unflatten(-1, (self.k_heads, dk))).repeat_interleave(r, dim=2)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.unflatten(-1, (H, dv)).transpose(1, 2)  # (B, H, T, .)
        beta = (torch.sigmoid(b) * real[..., None]).transpose(1, 2)  # (B, H, T): 0 on a pad (no write)
        g = (-torch.exp(self.A_log) * F.softplus(a + self.dt_bias) * real[..., None]).transpose(1, 2)  # 0: no decay
        gamma = torch.exp(segment_sums(g))  # (B, H, T, T): alpha_{j+1} ... alpha_i, 0 above the diagonal
        eye = torch.eye(T, dtype=hidden.dtype, device=hidden.device)
        strict = gamma * (k @ k.transpose(-1, -2)) * (1.0 - eye) * beta[..., None]  # L, row i scaled by beta_i
        solve = unit_lower_inverse(eye + strict)  # (I + L)^{-1}
        qk = gamma * (q @ k.transpose(-1, -2))  # (B, H, T, T), 0 above the diagonal
        start = torch.exp(g.cumsum(-1))[..., None]  # (B, H, T, 1): alpha_1 ... alpha_i, the carried state's decay
        u = solve @ (beta[..., None] * (v - start * (k @ s0)))  # each token's write, (B, H, T, dv)
        o = qk @ u + start * (q @ s0)
        state = start[:, :, -1:] * s0 + k.transpose(-1, -2) @ (gamma[:, :, -1, :, None] * u)
        y = o.transpose(1, 2)  # (B, T, H, dv)
        y = self.norm_weight * (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps))
        y = y.flatten(2) * F.silu(z)
        y = ablate_head_groups(y, positions, self.layer, self.map_heads)
        w = qk @ solve * beta[:, :, None, :]  # the map W per value head
        exact = placed(w, positions) if self.exact_maps else None
        return self.out(y), head_group_maps(w, positions, self.map_heads), (conv_state, state), exact
