"""Token mixers that are not attention, and the causal windows they read.

`ShortConv` is LFM2's gated short convolution (a layer whose record says mixer "short_conv"): in_proj makes three
d_model-wide streams B, C and x; the layer's output is out_proj(C * conv(B * x)), conv a causal depthwise convolution
over conv_kernel tokens.  The layer has no attention and no positional encoding: a token's order is the kernel's tap
it falls under, and the convolution's zero start tells the first token.  Its decoding state is the last
conv_kernel - 1 values B * x (past_conv.{i}, fixed-size, carried beside the attention layers' keys and values).

Its matrix form is exact.  Per channel d, the output before out_proj is y[t, d] = sum over s of
M_d[t, s] * v[s, d] with v = B * x (the convolution's input, its value) and M_d[t, s] = C[t, d] * w[d, K - 1 - j]
where key s is j real tokens before query t (0 <= j < K), 0 elsewhere.  A layer's map for "head" h is the mean of
M_d over the h-th of n_heads equal groups of channels: a signed banded matrix, not a probability distribution.

`causal_windows` is the convolution's reading of its inputs, shared with the cpe variant: pads never enter a
window, so a left-padded row (and a row whose new tokens are left-padded while it carries state) reads what the
row alone reads.
"""

from __future__ import annotations

import torch
from torch import nn

from model.config import ModelConfig
from model.errors import ConfigError


def causal_windows(previous: torch.Tensor, inputs: torch.Tensor, new_mask: torch.Tensor,
                   kernel: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each new token's window of `kernel` inputs, (B, T, kernel, D), tap j holding the input j real tokens back
    (tap 0 the token itself; zeros before the first), and the state after them: the last kernel - 1 real inputs.

    previous (B, kernel - 1, D): the real inputs before these tokens (zeros at the start); inputs (B, T, D), zero on
    pads; new_mask (B, T): 1 on the real tokens, which follow the row's pads."""
    B, T, D = inputs.shape
    keep = kernel - 1
    joined = torch.cat((previous, inputs), dim=1)  # (B, K-1+T, D)
    # `virtual` indexes [state, real tokens] as if contiguous; slots past the state move right by the row's pads
    pads = T - new_mask.sum(-1)  # (B,)
    taps = torch.arange(kernel, device=inputs.device)
    virtual = (torch.arange(T, device=inputs.device)[None, :, None] - pads[:, None, None]) + keep - taps  # (B,T,K)
    index = torch.where(virtual >= keep, virtual + pads[:, None, None], virtual).clamp(0, keep + T - 1)
    window = joined.gather(1, index.reshape(B, -1, 1).expand(-1, -1, D)).view(B, T, kernel, D)
    last = T - pads[:, None] + torch.arange(keep, device=inputs.device)  # (B, K-1): the last inputs, virtually
    last = torch.where(last >= keep, last + pads[:, None], last)
    return window, joined.gather(1, last[..., None].expand(-1, -1, D))


class ShortConv(nn.Module):
    """LFM2's Lfm2ShortConv as a block's token mixer; forward has Attention's signature and returns (output, the
    layer's maps (B, n_heads, T, S) as the module docstring defines them, (its new state,), every channel's own
    matrix (B, d_model, T, S) with exact_maps, else None)."""

    onnx_ops = False  # Transformer.use_onnx_ops sets it on every mixer; a convolution has no ONNX op to choose
    exact_maps = False  # Transformer.use_exact_maps sets it

    def __init__(self, cfg: ModelConfig, layer: int = 0):
        super().__init__()
        D, self.kernel, self.layer, self.heads = cfg.d_model, cfg.conv_kernel, layer, cfg.n_heads
        if D % cfg.n_heads:
            raise ConfigError(f"a short_conv layer's maps split d_model ({D}) into n_heads ({cfg.n_heads}) groups")
        self.in_proj = nn.Linear(D, 3 * D, bias=cfg.conv_bias)
        self.conv = nn.Conv1d(D, D, self.kernel, groups=D, bias=cfg.conv_bias)  # weight (D, 1, K), used as data
        self.out = nn.Linear(D, D, bias=cfg.conv_bias)

    def forward(self, x: torch.Tensor, positions, past: tuple[torch.Tensor, ...]):
        (previous,) = past
        B, T, D = x.shape
        new_mask = positions.slots[:, -T:]  # (B, T) int64, 1 on a real token
        b, c, h = self.in_proj(x).chunk(3, dim=-1)
        v = b * h * new_mask[..., None].to(x.dtype)
        window, state = causal_windows(previous, v, new_mask, self.kernel)
        taps = self.conv.weight[:, 0].flip(-1)  # (D, K): tap j = j tokens back (conv1d's kernel reads oldest first)
        y = torch.einsum("btkd,dk->btd", window, taps)
        if self.conv.bias is not None:
            y = y + self.conv.bias
        y = c * y
        if positions.intervention is not None:  # a head ablated: its group of channels zeroed before out_proj
            keep = positions.intervention.keep[:, self.layer]  # (B, H)
            y = y * keep.repeat_interleave(D // self.heads, dim=-1)[:, None, :].to(y.dtype)
        # with exact_maps, every channel's own matrix beside the maps (computed as without: the intervention graph
        # is the maps graph less this output, export/intervene.py)
        exact = self.maps(c, taps, positions, D) if self.exact_maps else None
        return self.out(y), self.maps(c, taps, positions, self.heads), (state,), exact

    def maps(self, c: torch.Tensor, taps: torch.Tensor, positions, heads: int) -> torch.Tensor:
        """(B, heads, T, S): each of `heads` channel groups' mean of C[t, d] * taps[d, j], placed at the key j real
        tokens back (heads = d_model: every channel's own matrix)."""
        B, T, D = c.shape
        slots = positions.slots  # (B, S) 1 on a real slot
        rank = slots.cumsum(-1) - 1  # a real slot's index among the row's real tokens
        j = rank[:, -T:, None] - rank[:, None, :]  # (B, T, S) real tokens between key and query
        inside = (j >= 0) & (j < self.kernel) & slots[:, None, :].bool() & slots[:, -T:, None].bool()
        groups = (c[..., None] * taps).unflatten(2, (heads, D // heads)).mean(3)  # (B, T, heads, K)
        rows = groups.permute(0, 2, 1, 3).gather(-1, j.clamp(0, self.kernel - 1)[:, None].expand(-1, heads, -1, -1))
        return rows * inside[:, None].to(rows.dtype)


class NoMixer(nn.Module):
    """A layer that mixes no tokens (its record's mixer "none": a block that is its MLP alone, Nemotron-H's): a zero
    branch, and maps that are the identity (each real token only itself), which is exactly what the layer moves."""

    onnx_ops = False

    def __init__(self, cfg: ModelConfig, layer: int = 0):
        super().__init__()
        self.heads = cfg.n_heads

    def forward(self, x: torch.Tensor, positions, past: tuple[torch.Tensor, ...]):
        B, T, _ = x.shape
        slots = positions.slots
        own = torch.arange(T, device=x.device)[:, None] + (slots.shape[1] - T) == torch.arange(slots.shape[1],
                                                                                                device=x.device)
        rows = own[None, None].to(x.dtype) * slots[:, None, -T:, None].to(x.dtype)  # (B, 1, T, S)
        return torch.zeros_like(x), rows.expand(B, self.heads, T, slots.shape[1]), (), None


class NoMLP(nn.Module):
    """The missing MLP branch of a layer whose record says mlp false: zero."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(x)
