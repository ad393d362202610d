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

from model.mixers import causal_windows
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
        window, new_state = causal_windows(previous, x * new_mask[..., None].to(x.dtype), new_mask, self.cfg.cpe_kernel)
        out = torch.einsum("btkd,dk->btd", window, self.weight[:, 0].flip(-1)) + self.bias  # conv1d's kernel order
        return x + out, (new_state,)
