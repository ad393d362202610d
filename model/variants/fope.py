"""FoPE (Hua et al. 2024, ICML 2025, "Fourier Position Embedding: Enhancing Attention's Periodic Extension for
Length Generalization", arXiv 2412.17739): RoPE whose lowest frequencies are clipped to zero and whose other pairs
each carry a Fourier series over all the kept frequencies instead of one.

From RoPE's omega_m = base^(-2m/d), m = 0 .. d/2 - 1 (d the rotated dims, cfg.rope_dim; base cfg.rope_base):

  1. clipping: omega_m < 2 pi / N (N = cfg.context, the pre-training length) has no full period inside the
     trained window and becomes 0.  The kept ones are the first D pairs (omega falls with m).
  2. Fourier series: pair j < D turns by the features
       C_j(n) = sum_i cos(omega_i n) A_ij,   S_j(n) = sum_i sin(omega_i n) B_ij,   i = 0 .. D - 1
     x -> x C(n) + turn(x) S(n) (RoPE's sign: turn = rotate_half or rotate_every_two as cfg.rope_pairing says), so
     pair j's own frequency carries weight ~1 and every other kept frequency a small one: the paper's
     h_m(n) = e^{i omega_m n} + sum_w a_w e^{i w n}.  A clipped pair (j >= D) takes C = S = 1 at every position:
     (a, b) -> (a - b, a + b), a turn by pi/4 and sqrt(2) longer, the same at every position, so its share of
     q.k is 2 (a_q a_k + b_q b_k) at any distance: frequency zero.
  A and B are fixed (not trained), drawn once at construction and saved with the weights (buffers, so checkpoints
  and exported graphs carry them; loading never draws them again): separate for cos and sin, one D x D pair per
  layer and per kv head, each identity + torch.nn.init.xavier_normal_(gain=SIGMA) on the (kv_heads, D, D) tensor,
  i.e. Gaussian noise of std SIGMA * sqrt(2 / (D*D + kv_heads*D)), drawn from torch's global generator like every
  other weight (so the training seed fixes them).

Source followed: the authors' code, TsinghuaC3I/Fourier-Position-Embedding olmo/model.py (FourierEmbedding) with
the flags of its released configs (rope_clamp_floor_freq and _to_zero with ratio 1, fourier_separate_basis,
fourier_separate_head, fourier_ignore_zero, fourier_init eye_xavier_norm, fourier_norm off, not learnable): its
half-split pairs, its sign (x cos + rotate_half(x) sin), its padding of the clipped pairs with 1 for both cos and
sin, one FourierEmbedding per block (so per layer).  Where sources differ or the code is silent (the paper's
appendix pseudo-code as ports of it reproduce it; its text not checked line by line):
  - normalisation: the released runs do not normalise A and B (fourier_norm defaults to off and no config sets
    it); the paper's appendix pseudo-code divides each column by its sum.  Not normalised here.
  - noise: the paper's text says N(0, sigma); its code and pseudo-code draw Xavier-normal with gain sigma (the std
    above).  The code's is used.
  - width: the code mixes into min(D, head_dim / 4) features and pads the rest with 1.  The paper's equations give
    every kept dimension its own series (width D), and so does this module; the two agree wherever D <= d/4, as in
    the paper's 512-token runs (60M: D = 16, d/4 = 16; 180M and 1.2B: D = 31, d/4 = 32) and posenc's presets (tiny:
    D = 1, d/4 = 2; default: D = 6, d/4 = 8), not in its 1024-token 60M runs (D = 18).  With width D, SIGMA = 0
    and nothing clipped is RoPE exactly.
  - the pseudo-code's sign is x cos - turn(x) sin (the inverse turn); the code's is RoPE's and is used.
  - grouped-query attention: the code runs multi-head attention only; here a kv head's A and B also serve its query
    heads, as vLLM's FoPE (FourierRotaryEmbedding, coefficients per kv head) has it.
Hyper-parameters (Table 3): sigma = 0.3 / 0.4 / 0.6 for the 60M / 180M / 1.2B models and D_freq = the head
dimension in all three (64 / 128 / 128); posenc's models are smaller than the smallest, so SIGMA takes its 0.3 and
the Fourier width is the rotated head width.  The clipping reads cfg.context.

Not relative: with several frequencies per pair the map is no rotation, and q.k depends on both positions, so
keys are cached after the transform (each by its own position, as RoPE's) and positions must count real tokens.
Features are computed from the positions in float32 each call (no table).  rotate() is layer 0's (the encoding
picture's); the model calls rotate_layer.  A RoPE scaling is refused (not `rope_scaled`), and the fused RoPE kernel
cannot apply per-head features (not `compact_layout`).
"""

from __future__ import annotations

import math

import torch

from model.variants.base import PositionalVariant
from model.variants.rope import apply_rope, check_pairs

SIGMA = 0.3  # Table 3's noise gain for its smallest (60M) model; 0.4 at 180M, 0.6 at 1.2B


def kept_frequencies(cfg) -> list[float]:
    """RoPE's omega_m = base^(-2m/d) over the rotated dims that are >= 2 pi / context (float64, model constants)."""
    d, floor = cfg.rope_dim, 2 * math.pi / cfg.context
    omegas = [cfg.rope_base ** (-2.0 * m / d) for m in range(d // 2)]
    return [w for w in omegas if w >= floor]


class FoPE(PositionalVariant):
    name = "fope"

    @classmethod
    def check_config(cls, cfg):
        super().check_config(cfg)
        check_pairs(cfg, "fope")

    def __init__(self, cfg):
        super().__init__(cfg)
        self.omegas = kept_frequencies(cfg)
        D, KVH = len(self.omegas), cfg.kv_heads
        # persistent: saved with the weights, so the graph's constant of D frequencies is read as one of them (D
        # may equal a length the graph check looks for in baked tables)
        self.register_buffer("omega", torch.tensor(self.omegas, dtype=torch.float32))
        for layer in range(cfg.n_layers):  # per layer, sin before cos (the authors' order)
            for kind in ("sin", "cos"):
                coef = torch.empty(KVH, D, D)
                if D:
                    torch.nn.init.xavier_normal_(coef, gain=SIGMA)
                    coef += torch.eye(D)
                self.register_buffer(f"{kind}_coef_{layer}", coef)  # persistent: saved with the weights

    def coefficients(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `layer`'s cos and sin mixing matrices A and B, (kv_heads, D, D): A[h, i, j] is frequency i's
        weight in pair j's cos feature."""
        return getattr(self, f"cos_coef_{layer}"), getattr(self, f"sin_coef_{layer}")

    def features(self, positions: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """C(n) and S(n) laid out like RoPE's cos and sin: (B, kv_heads, T, d_rot) float32, clipped pairs 1."""
        cfg, half = self.cfg, self.cfg.rope_dim // 2
        B, T = positions.shape
        ones = torch.ones(B, cfg.kv_heads, T, half - len(self.omegas), device=positions.device)
        if self.omegas:
            angles = positions.to(torch.float32)[:, None, :, None] * self.omega  # (B, 1, T, D)
            a, b = self.coefficients(layer)
            cos = torch.cat((angles.cos() @ a, ones), dim=-1)  # (B, kv_heads, T, d_rot/2)
            sin = torch.cat((angles.sin() @ b, ones), dim=-1)
        else:
            cos, sin = ones, ones
        if cfg.rope_pairing == "interleaved":  # pair j is dims (2j, 2j+1)
            return torch.stack((cos, cos), dim=-1).flatten(-2), torch.stack((sin, sin), dim=-1).flatten(-2)
        return torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)  # pair j is dims (j, j + d_rot/2)

    def pair_frequencies(self, positions: torch.Tensor) -> torch.Tensor:
        """Each pair's own frequency (d_rot/2,), the one its series weights ~1: omega_j for a kept pair, 0 for a
        clipped one (the encoding graph's rotary_frequencies, a graph output: it reads the positions' device)."""
        half = self.cfg.rope_dim // 2
        zeros = torch.zeros(half - len(self.omegas), device=positions.device)
        return torch.cat((self.omega.to(positions.device), zeros)) + 0 * positions.reshape(-1)[:1].to(torch.float32)

    def note(self) -> str:
        """model.json's line for people (export.encoding.describe)."""
        cfg, half = self.cfg, self.cfg.rope_dim // 2
        return (f"FoPE: {half - len(self.omegas)} of {half} pairs clipped to frequency 0 (below 2 pi / "
                f"{cfg.context}), the other {len(self.omegas)} each a fixed Fourier series over the kept frequencies "
                f"(per layer and kv head, noise gain {SIGMA}); the pictures show layer 0, kv head 0")

    def rotate(self, q, k, positions):
        return self.rotate_layer(q, k, positions, 0)

    def rotate_layer(self, q, k, positions, layer, rope=None):
        cos, sin = self.features(positions, layer)
        return self._turn(q, cos, sin), self._turn(k, cos, sin)

    def _turn(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x C + turn(x) S on (B, heads, T, Dh), or on the (B, T, heads * Dh) the export's Attention-23 graph
        passes; query heads take their kv head's features (kv head j serves query heads j*g .. j*g+g-1), and one
        head (the encoding picture's probe) broadcasts to every kv head's."""
        cfg = self.cfg
        interleaved = cfg.rope_pairing == "interleaved"
        heads = x.shape[1] if x.dim() == 4 else x.shape[-1] // cfg.head_dim
        if heads > cfg.kv_heads:  # a model constant: the queries of grouped-query attention
            cos, sin = (t.repeat_interleave(heads // cfg.kv_heads, dim=1) for t in (cos, sin))
        if x.dim() == 4:
            return apply_rope(x, cos, sin, interleaved)
        B, T, _ = x.shape
        out = apply_rope(x.reshape(B, T, heads, cfg.head_dim), cos.transpose(1, 2), sin.transpose(1, 2), interleaved)
        return out.reshape(B, T, -1)
