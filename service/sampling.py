"""Next-token distributions: log-softmax, top candidates, sampling, and the divergences Compare reports."""

from __future__ import annotations

import math

import numpy as np


def permute_default(text: str | None, ids: list[int] | None) -> tuple[str | None, list[int] | None]:
    """The prompt's words in reverse order ("dog bites man" -> "man bites dog"); ids reversed."""
    if text is not None:
        return " ".join(reversed(text.split(" "))), None
    return None, list(reversed(ids or []))


def divergences(logp: np.ndarray, logq: np.ndarray) -> tuple[float, float, float]:
    """Total variation, KL(p || q) and Jensen-Shannon between two next-token distributions (log space)."""
    p, q = np.exp(logp), np.exp(logq)
    m = 0.5 * (p + q)
    logm = np.log(np.maximum(m, 1e-300))
    kl = float(np.sum(p * (logp - logq)))
    js = float(0.5 * np.sum(p * (logp - logm)) + 0.5 * np.sum(q * (logq - logm)))
    return float(0.5 * np.abs(p - q).sum()), kl, js


def top_of(logp: np.ndarray, k: int) -> list[tuple[int, float, float]]:
    order = np.argsort(-logp, kind="stable")[:k]
    return [(int(i), float(math.exp(logp[i])), float(logp[i])) for i in order]


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def pick(logp: np.ndarray, temperature: float, top_k: int, top_p: float, rng: np.random.Generator) -> int:
    if temperature == 0:
        return int(np.argmax(logp))
    scaled = logp / temperature
    order = np.argsort(-scaled, kind="stable")
    if top_k:
        order = order[:top_k]
    probs = np.exp(scaled[order] - scaled[order].max())
    probs /= probs.sum()
    if 0 < top_p < 1:
        keep = int(np.searchsorted(np.cumsum(probs), top_p) + 1)
        order, probs = order[:keep], probs[:keep] / probs[:keep].sum()
    return int(order[rng.choice(len(order), p=probs)])
