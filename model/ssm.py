"""A Mamba-2 layer (Dao and Gu 2024, "Transformers are SSMs", arXiv 2405.21060) as a block's token mixer: a layer
whose record says mixer "mamba2" (IBM's Granite 4.0-H).

in_proj makes the gate z, the convolution's input xBC and one time step per head; xBC goes through a causal
depthwise convolution of conv_kernel taps and SiLU, then splits into the values x (heads x head_dim), B and C (a
state of ssm_state per group of heads).  Per head h, with dt_t = softplus(dt_t + dt_bias) (clamped below at
ssm_dt_min) and a_t = A_h dt_t
(A_h = -exp(A_log_h) < 0), the state-space scan h_t = exp(a_t) h_{t-1} + dt_t x_t B_t^T, y_t = h_t C_t + D_h x_t
is, over a call's tokens, one matrix (the SSD form):

    y_i = sum_{j <= i} M[i, j] x_j + exp(a_1 + ... + a_i) (h_0 C_i),
    M[i, j] = (C_i . B_j) exp(a_{j+1} + ... + a_i) dt_j  (+ D_h where j = i)

which this module computes directly (prompts and decode steps alike; exact, as the chunked scan is), with h_0 the
carried state.  y is gated and normed as ssm_norm says (norm(y * silu(z)) by groups, a gated RMSNorm; norm(y) *
silu(z); or y * silu(z) alone), then out_proj.  The layer's
maps are M per head, averaged over n_heads equal groups of heads where the layer has more heads than the model's
maps: signed, and over the keys of the call only (what came before reaches a row through h_0, which has no keys).

Pads never act: their convolution inputs never enter a window (model.mixers.causal_windows) and their time steps
are 0 (no decay, no input), so a left-padded row, or a row whose new tokens are padded while it carries state, gives
what the row alone gives.  The carried state is (past_conv.{i}, past_ssm.{i}): the last conv_kernel - 1 inputs and
h (heads, head_dim, ssm_state).  Beside an attention (Falcon-H1's layers) it adds its output to the attention's, and
the layer's maps are the attention's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from model.config import ModelConfig
from model.errors import ConfigError
from model.mixers import causal_windows


def segment_sums(a: torch.Tensor) -> torch.Tensor:
    """(..., T) -> (..., T, T): [i, j] = a_{j+1} + ... + a_i for j <= i (0 on the diagonal), -inf above it; summed
    per segment (a cumulative sum down the masked columns), never as a difference of two long sums."""
    T = a.shape[-1]
    below = torch.tril(torch.ones(T, T, dtype=torch.bool, device=a.device), diagonal=-1)
    sums = a[..., :, None].expand(*a.shape, T).masked_fill(~below, 0.0).cumsum(-2)
    return sums.masked_fill(~torch.tril(torch.ones(T, T, dtype=torch.bool, device=a.device)), float("-inf"))


def head_group_maps(m: torch.Tensor, positions, map_heads: int) -> torch.Tensor:
    """A recurrent mixer's per-head matrices m (B, H, T, T) as the layer's maps (B, map_heads, T, S): heads averaged
    in map_heads equal groups, at the call's own key slots (0 on the rest), a pad query's row 0."""
    return placed(m.unflatten(1, (map_heads, m.shape[1] // map_heads)).mean(2), positions)


def placed(m: torch.Tensor, positions) -> torch.Tensor:
    """Matrices m (B, heads, T, T) over the call's own tokens as maps (B, heads, T, S): at the call's key slots (0
    on the past's), a pad query's row 0."""
    T = m.shape[-1]
    real = positions.slots[:, -T:].to(m.dtype)
    return F.pad(m * real[:, None, :, None], (positions.slots.shape[1] - T, 0))


def ablate_head_groups(y: torch.Tensor, positions, layer: int, map_heads: int) -> torch.Tensor:
    """y (B, T, channels) with the channels of each ablated map head's group zeroed (before out_proj)."""
    if positions.intervention is None:
        return y
    keep = positions.intervention.keep[:, layer]  # (B, map_heads)
    return y * keep.repeat_interleave(y.shape[-1] // map_heads, dim=-1)[:, None, :].to(y.dtype)


class Mamba2(nn.Module):
    """Granite's GraniteMoeHybridMambaLayer (transformers' torch path) as a block's token mixer; forward has
    Attention's signature and returns (output, the layer's maps (B, n_heads, T, S), (conv state, SSM state), every
    head's own matrix (B, heads, T, S) with exact_maps, else None)."""

    onnx_ops = False  # Transformer.use_onnx_ops sets it on every mixer; nothing here has an ONNX op to choose
    exact_maps = False  # Transformer.use_exact_maps: forward's fourth value is every head's matrix (B, heads, T, S)

    def __init__(self, cfg: ModelConfig, layer: int = 0, beside: bool = False):
        """beside: the layer runs beside an attention (Falcon-H1), whose maps and head ablations are the layer's;
        this one's are neither computed nor ablated."""
        super().__init__()
        self.beside, self.norm = beside, cfg.ssm_norm
        self.heads, self.head_dim, self.state, self.groups = cfg.ssm_heads, cfg.ssm_head_dim, cfg.ssm_state, \
            cfg.ssm_groups
        self.kernel, self.layer, self.map_heads, self.dt_min = cfg.conv_kernel, layer, cfg.n_heads, cfg.ssm_dt_min
        if self.heads % cfg.n_heads and not beside:
            raise ConfigError(f"a mamba2 layer's maps average its ssm_heads ({self.heads}) over the model's n_heads "
                              f"({cfg.n_heads}): it must be a multiple")
        inner = self.heads * self.head_dim
        self.width = inner + 2 * self.groups * self.state
        self.in_proj = nn.Linear(cfg.d_model, inner + self.width + self.heads, bias=False)
        self.conv = nn.Conv1d(self.width, self.width, self.kernel, groups=self.width, bias=cfg.conv_bias)
        self.dt_bias = nn.Parameter(torch.ones(self.heads))
        self.A_log = nn.Parameter(torch.log(torch.arange(1, self.heads + 1, dtype=torch.float32)))
        self.D = nn.Parameter(torch.ones(self.heads))
        if self.norm != "none":
            self.norm_weight = nn.Parameter(torch.ones(inner))
        self.eps = cfg.layer_norm_eps
        self.out = nn.Linear(inner, cfg.d_model, bias=False)

    def forward(self, hidden: torch.Tensor, positions, past: tuple[torch.Tensor, ...]):
        previous, h0 = past  # (B, K-1, width), (B, H, P, N)
        Bn, T, _ = hidden.shape
        H, P, N, G = self.heads, self.head_dim, self.state, self.groups
        real = positions.slots[:, -T:]  # (B, T) int64, 1 on a real token
        z, xbc, dt = self.in_proj(hidden).split([H * P, self.width, H], dim=-1)
        window, conv_state = causal_windows(previous, xbc * real[..., None].to(xbc.dtype), real, self.kernel)
        xbc = torch.einsum("btkd,dk->btd", window, self.conv.weight[:, 0].flip(-1))
        if self.conv.bias is not None:
            xbc = xbc + self.conv.bias
        x, b, c = F.silu(xbc).split([H * P, G * N, G * N], dim=-1)
        x = x.unflatten(-1, (H, P))  # (B, T, H, P)
        b = b.unflatten(-1, (G, N)).repeat_interleave(H // G, dim=2)  # (B, T, H, N)
        c = c.unflatten(-1, (G, N)).repeat_interleave(H // G, dim=2)
        dt = F.softplus(dt + self.dt_bias).clamp(min=self.dt_min) * real[..., None].to(dt.dtype)  # 0 on a pad
        a = (-torch.exp(self.A_log) * dt).transpose(1, 2)  # (B, H, T)
        decay = torch.exp(segment_sums(a))  # (B, H, T, T): exp(a_{j+1} + ... + a_i), 0 above the diagonal
        m = torch.einsum("bihn,bjhn->bhij", c, b) * decay * dt.transpose(1, 2)[:, :, None, :]
        m = m + torch.diag_embed(self.D[None, :, None].expand(Bn, H, T))  # the skip term on the diagonal
        start = torch.exp(a.cumsum(-1))  # (B, H, T): the carried state's decay up to each token
        y = torch.einsum("bhij,bjhp->bihp", m, x) + torch.einsum("bihn,bhpn->bihp", c, h0) * \
            start.transpose(1, 2)[..., None]
        to_end = decay[:, :, -1, :] * dt.transpose(1, 2)  # (B, H, T): token j's weight in the final state
        state = h0 * start[:, :, -1, None, None] + torch.einsum("bhj,bjhp,bjhn->bhpn", to_end, x, b)
        y = self.gate_and_norm(y.flatten(2), z)
        exact = placed(m, positions) if self.exact_maps else None
        if self.beside:
            return self.out(y), None, (conv_state, state), exact
        y = ablate_head_groups(y, positions, self.layer, self.map_heads)
        return self.out(y), head_group_maps(m, positions, self.map_heads), (conv_state, state), exact

    def gate_and_norm(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """y (B, T, heads x head_dim) gated by silu(z) and RMS-normed per group of heads as cfg.ssm_norm says."""
        if self.norm == "none":
            return y * F.silu(z)
        gated = (y * F.silu(z) if self.norm == "gated" else y).unflatten(-1, (self.groups, -1))
        normed = self.norm_weight * (gated * torch.rsqrt(gated.pow(2).mean(-1, keepdim=True) + self.eps)).flatten(2)
        return normed if self.norm == "gated" else normed * F.silu(z)

