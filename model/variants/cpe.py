"""Convolutional position encoding (Chu et al. 2021, "Conditional Positional Encodings", arXiv 2102.10882): a
causal depthwise convolution over the token embeddings, x + DWConv(x), as the only positional signal.

Order and absolute position both come from the convolution: a token sees the kernel-1 inputs before it, and the
zero padding before the first token tells the start.  Padded tokens (mask 0) are zeroed before the convolution, so
a left-padded row sees exactly the zeros an unpadded row starts with.  Cached decoding needs the last kernel-1
(masked) inputs: they are this variant's decoding state (past_conv_state -> present_conv_state, [batch,
kernel-1, d_model]), carried like the key/value cache but of fixed size.
"""

from __future__ import annotations

import torch
from torch import nn

from model.variants.base import PositionalVariant


class ConvPositional(PositionalVariant):
    index_positions = False  # a convolution over neighbouring tokens: no position index to give
    name = "cpe"

    def __init__(self, cfg):
        super().__init__(cfg)
        self.weight = nn.Parameter(torch.randn(cfg.d_model, 1, cfg.cpe_kernel) * 0.02)  # depthwise: one filter per dim
        self.bias = nn.Parameter(torch.zeros(cfg.d_model))

    def state_spec(self) -> list[tuple[str, tuple[int, ...]]]:
        return [("conv_state", (self.cfg.cpe_kernel - 1, self.cfg.d_model))]

    def embed_state(self, x: torch.Tensor, new_mask: torch.Tensor,
                    state: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        (previous,) = state  # (B, K-1, D): the inputs before the new tokens, zeros at the start
        B, T, D = x.shape
        keep = self.cfg.cpe_kernel - 1
        inputs = torch.cat((previous, x * new_mask[..., None].to(x.dtype)), dim=1)  # (B, K-1+T, D)
        # A row's new tokens may be left-padded (a batch mixing lengths) while it carries state: its window must
        # skip the pads, reading [state, real tokens] as if contiguous.  `virtual` indexes that contiguous
        # sequence; slots past the state move right by the row's pad count.
        pads = T - new_mask.sum(-1)  # (B,)
        taps = torch.arange(self.cfg.cpe_kernel, device=x.device)  # 0 = the token itself, j = j tokens back
        virtual = (torch.arange(T, device=x.device)[None, :, None] - pads[:, None, None]) + keep - taps  # (B,T,K)
        index = torch.where(virtual >= keep, virtual + pads[:, None, None], virtual).clamp(0, keep + T - 1)
        window = inputs.gather(1, index.reshape(B, -1, 1).expand(-1, -1, D)).view(B, T, -1, D)  # (B, T, K, D)
        out = torch.einsum("btkd,dk->btd", window, self.weight[:, 0].flip(-1)) + self.bias  # conv1d's kernel order
        last = T - pads[:, None] + torch.arange(keep, device=x.device)  # (B, K-1): the last inputs, virtually
        last = torch.where(last >= keep, last + pads[:, None], last)
        new_state = inputs.gather(1, last[..., None].expand(-1, -1, D))
        return x + out, (new_state,)
