"""Tolerances for a float32 graph (onnxruntime) against transformers' float32 forward, derived from the computation.

Two float32 implementations of the same network round apart.  A dot product of n terms rounds by about
sqrt(n) u of its terms' size (u = 2^-24, rounding errors adding like a random walk: Higham and Mary 2019, "A new
approach to probabilistic rounding error analysis"), and each of a model's layers adds its own, so the two sides'
logits differ by about sqrt(n) (L + 1) u of the logits' size, n the longest sum either side takes (the MLP's inner
width, four times the hidden size in these families, or the keys a query attends to) and L the layers (+1: the
embedding and the head).  The tolerance is 8 times that: the constant such sums carry and two sides that each round
on their own CPU's kernels.  Attention probabilities are at most 1: the same figure without the logits' size.
"""

from __future__ import annotations

import math

import torch

U32 = 2.0 ** -24
SAFETY = 8


def tolerances(config, logits: torch.Tensor, keys: int) -> tuple[float, float]:
    """(logits, attention probabilities) tolerances for a float32 comparison of a model with transformers' `config`
    at `keys` positions attended (the whole length, past included)."""
    n = max(4 * config.hidden_size, keys)
    rounding = SAFETY * U32 * math.sqrt(n) * (config.num_hidden_layers + 1)
    return rounding * max(1.0, logits.abs().max().item()), rounding
