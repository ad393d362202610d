"""RoPE (Su et al., RoFormer): rotate q and k by position; never v.

The first d_rot = int(Dh * rope_fraction) dims of each head rotate (GPT-NeoX rotates a quarter); the rest pass
through.  Pairs are half-split (k, k + d_rot/2) as in HF LLaMA and GPT-NeoX, or interleaved (2k, 2k+1) as in
RoFormer and Meta's LLaMA code (cfg.rope_pairing); theta_k = base^(-2k/d_rot).  Angles are computed in fp32 from
the positions each call (no cos/sin table for one length), and keys are cached after rotation.  Context
extension (linear, ntk, dynamic, yarn, llama3, longrope) changes the frequencies: model/rope_scaling/.  Per layer,
as its record's encoding says (cfg.layer(i)): "none" rotates nothing (NoPE), "local" rotates by cfg.local_rope_base
unscaled (Gemma 3's local layers), "model" by the model's base and scaling.
"""

from __future__ import annotations

import torch

from model import rope_scaling
from model.errors import ConfigError
from model.variants.base import PositionalVariant


def inv_freq(cfg, device=None) -> tuple[torch.Tensor, float]:
    """theta_k for k in [0, d_rot/2) after the config's scaling (model/rope_scaling/; dynamic and longrope at
    lengths up to the original context), and the factor cos and sin are multiplied by."""
    return rope_scaling.inv_freq(cfg, device=device), rope_scaling.attention_factor(cfg)


def pair_angles(positions: torch.Tensor, cfg, rope: tuple[torch.Tensor, ...] | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | float]:
    """Each pair's angle (B, T, d_rot/2) float32 and the factor cos and sin are multiplied by: the config's scaling,
    or per row where an intervention's `rope` (inv_freq (B, d_rot/2), factor (B,), use (B,)) says to use its own
    frequencies (the factor is then a (B, 1, 1) tensor)."""
    angles, scale = rope_scaling.angles(positions, cfg)
    if rope is None:
        return angles, scale
    inv, factor, use = rope
    theirs = positions.to(torch.float32)[..., None] * inv[:, None, :]
    chosen = use > 0
    angles = torch.where(chosen[:, None, None], theirs, angles)
    return angles, torch.where(chosen, factor, torch.full_like(factor, scale))[:, None, None]


def rope_angles(positions: torch.Tensor, cfg, rope: tuple[torch.Tensor, ...] | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape (B, 1, T, d_rot) for positions (B, T), computed in fp32, laid out like the pairs.  The
    length-dependent scalings (dynamic, longrope) take each row's length from its last position; `rope` as
    pair_angles takes it."""
    angles, scale = pair_angles(positions, cfg, rope)  # (B, T, d_rot/2)
    if cfg.rope_pairing == "interleaved":  # pair k is dims (2k, 2k+1)
        angles = torch.stack((angles, angles), dim=-1).flatten(-2)[:, None]  # (B, 1, T, d_rot)
    else:  # pair k is dims (k, k + d_rot/2)
        angles = torch.cat((angles, angles), dim=-1)[:, None]
    if isinstance(scale, torch.Tensor):
        scale = scale[:, None]  # (B, 1, 1, 1)
    elif scale == 1.0:
        return angles.cos(), angles.sin()
    return angles.cos() * scale, angles.sin() * scale


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2  # slices, not chunk: chunk exports as a sequence of tensors
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotate_every_two(x: torch.Tensor) -> torch.Tensor:
    """(a0, b0, a1, b1, ...) -> (-b0, a0, -b1, a1, ...): the interleaved pairs' quarter turn."""
    return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """Rotate the first cos.shape[-1] dims of x; the rest pass through unchanged."""
    d_rot = cos.shape[-1]
    turn = rotate_every_two if interleaved else rotate_half
    if d_rot == x.shape[-1]:
        return x * cos + turn(x) * sin
    head, rest = x[..., :d_rot], x[..., d_rot:]
    return torch.cat((head * cos + turn(head) * sin, rest), dim=-1)


def check_pairs(cfg, variant: str) -> None:
    """ConfigError unless the config's rotated dims (head_dim x rope_fraction) form whole pairs, at least one: every
    variant that turns pairs of dims (rope, xpos, fope) asks it."""
    if cfg.rope_dim % 2 or cfg.rope_dim == 0:
        raise ConfigError(f"{variant} needs an even head dimension to rotate, got {cfg.rope_dim} rotated dims "
                          f"(head_dim {cfg.head_dim} x rope_fraction {cfg.rope_fraction})")


class Rope(PositionalVariant):
    name = "rope"
    compact_layout = True
    rope_scaled = True

    @classmethod
    def check_config(cls, cfg):
        super().check_config(cfg)
        check_pairs(cfg, "rope")
        rope_scaling.get(cfg.rope_scaling).check(cfg)

    def __init__(self, cfg):
        super().__init__(cfg)
        local = cfg.replace(rope_base=cfg.local_rope_base, rope_scaling=rope_scaling.NONE, rope_factor=1.0,
                            rope_original_context=0, rope_attention_factor=0.0) if cfg.local_rope_base else cfg
        # each block's RoPE config, None where it rotates nothing (model constants: chosen while tracing)
        by_encoding = {"none": None, "local": local, "model": cfg}
        self.layer_cfgs = [by_encoding[cfg.layer(i).encoding] for i in range(cfg.n_layers)]

    def rotate_layer(self, q, k, positions, layer, rope=None):
        cfg = self.layer_cfgs[layer]
        if cfg is None:  # a NoPE layer
            return q, k
        if cfg is self.cfg:  # the model's scaling, or an intervention's frequencies in its place
            return self.rotate(q, k, positions) if rope is None else self._rotate(q, k, positions, cfg, rope)
        return self._rotate(q, k, positions, cfg)

    def rotate(self, q, k, positions):
        return self._rotate(q, k, positions, self.cfg)

    def _rotate(self, q, k, positions, cfg, rope=None):
        interleaved = cfg.rope_pairing == "interleaved"
        if self.onnx_ops:  # export option: ONNX RotaryEmbedding-23 with cos/sin computed here from the positions
            c, s = self._half_angles(positions, cfg, rope)
            partial = 0 if cfg.rope_dim == cfg.head_dim else cfg.rope_dim

            def op(x):  # a (B, T, heads * Dh) input names its head count (queries and grouped keys differ)
                heads = x.shape[-1] // cfg.head_dim if x.dim() == 3 else 0
                return torch.onnx.ops.rotary_embedding(x, c, s, interleaved=interleaved, num_heads=heads,
                                                       rotary_embedding_dim=partial)
            return op(q), op(k)
        c, s = rope_angles(positions, cfg, rope)  # queries and new keys share positions: one set of angles
        return apply_rope(q, c, s, interleaved), apply_rope(k, c, s, interleaved)

    def _half_angles(self, positions: torch.Tensor, cfg, rope=None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin (B, T, d_rot/2) for RotaryEmbedding-23, which takes them per row and position when no
        position_ids are given: computed from the positions, nothing tabled."""
        angles, scale = pair_angles(positions, cfg, rope)
        if not isinstance(scale, torch.Tensor) and scale == 1.0:
            return angles.cos(), angles.sin()
        return angles.cos() * scale, angles.sin() * scale
