"""posenc's PyTorch model against transformers' in float64, where rounding cannot decide the verdict.

In float32 the two implementations round apart by about 1e-5 in a tiny model's logits at 200 positions, and by how
much depends on the CPU's kernels (AVX2 and AVX-512 sum in other orders): a float32 tolerance there says little and
flips between machines.  In float64 every operation both sides compute in the model's dtype rounds 1e-16 apart, so
what is left is the computation itself.  Two things stand in the way, both transformers' own:

- Its eager attention gives a left-padded row's pad queries no key at all in float64 (the mask's minimum overflows to
  -inf, softmax makes NaN), and the NaN reaches real rows through the pad keys' values.  So transformers runs each
  row alone, unpadded, and posenc the left-padded batch: the real rows must agree, which also proves padding changes
  nothing.
- Most of its families keep parts in float32 whatever the model's dtype (the eager softmax's
  `dtype=torch.float32`, the rotary angles, RMSNorm's `.to(torch.float32)`, ALiBi's slopes and biases).  Their
  rounding, about u = 2^-24 of each value, is what the float64 comparison is left with there, and the values that
  grow with the position (an angle, a bias) round by more at longer lengths: those families are held to
  64 u (1 + T/64) of the largest logit and on attention probabilities, T the length (a few units of rounding through
  two layers, with room for another CPU's float32 kernels).  The families whose forward follows the model's dtype
  throughout are held to 1e-10, which only the same computation meets.
"""

from __future__ import annotations

import copy

import torch

U32 = 2.0 ** -24  # float32's unit roundoff
EXACT = 1e-10  # a float64 computation against itself: 1e-16 per operation, far below any real difference
# the families whose transformers forward computes in the model's dtype throughout (every other keeps a float32 part)
IN_DTYPE = {"gpt2", "falcon", "gpt_oss"}


def tolerances(family: str, logits: torch.Tensor, length: int) -> tuple[float, float]:
    """(logits, attention probabilities) tolerances for the family's float64 comparison at `length` tokens."""
    scale = max(1.0, logits.abs().max().item())
    if family in IN_DTYPE:
        return EXACT * scale, EXACT
    rounding = 64 * U32 * (1 + length / 64)
    return rounding * scale, rounding


def double(model: torch.nn.Module) -> torch.nn.Module:
    """A float64 copy: the session's shared model stays float32."""
    return copy.deepcopy(model).to(torch.float64)


def rows_alone(forward, hf64, ids: torch.Tensor, mask: torch.Tensor) -> list:
    """transformers' float64 output for each row of a left-padded batch alone (its real tokens, positions 0..n-1)."""
    out = []
    for row, m in zip(ids, mask, strict=True):
        real = row[m.bool()][None]
        out.append(forward(hf64, real, torch.ones_like(real)))
    return out


def compare(family: str, refs: list, logits: torch.Tensor, attentions: torch.Tensor | None,
            mask: torch.Tensor) -> tuple[float, float]:
    """Each row's real positions of posenc's float64 batch (logits (B, T, V), attentions (B, L, H, T, T)) against
    transformers' row alone; asserts within the family's tolerances and returns the largest differences."""
    d_logits = d_attn = 0.0
    width = mask.shape[1]
    for b, ref in enumerate(refs):
        n = int(mask[b].sum())
        d_logits = max(d_logits, (ref.logits[0] - logits[b, width - n:]).abs().max().item())
        for layer, a in enumerate(ref.attentions or ()):  # none from an SDPA reference, None at a mixer layer
            if a is None:
                continue
            ours = attentions[b, layer, :, width - n:]
            assert torch.count_nonzero(ours[..., :width - n]) == 0  # no weight on the pad keys
            d_attn = max(d_attn, (a[0] - ours[..., width - n:]).abs().max().item())
    tol_logits, tol_attn = tolerances(family, torch.stack([r.logits[0].abs().max() for r in refs]), width)
    assert d_logits <= tol_logits and d_attn <= tol_attn, (family, d_logits, tol_logits, d_attn, tol_attn)
    return d_logits, d_attn
