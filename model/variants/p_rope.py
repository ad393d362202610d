"""p-RoPE (Barbero et al. 2024, "Round and Round We Go! What makes Rotary Positional Encodings useful?", arXiv
2410.06205): RoPE over the whole head of d dims in which only the highest-frequency fraction p of the pairs turns.
With theta_i = base^(-2i/d) over the whole head (i = 0 .. d/2 - 1, i = 0 the fastest), the first int(p d / 2) pairs
rotate by position x theta_i as in RoPE and the others get frequency 0: they pass unrotated, so those dims carry
content alone, never position.  p = 1 is RoPE, p = 0 is NoPE (no positional encoding at all); the paper's best,
p = 0.75 (`P`), is the one posenc trains.  The paper's argument: the lowest frequencies barely turn over a trained
context, so the model uses them as "semantic channels" that are nonetheless not robust far beyond it; removing them
keeps those channels free of position.

The frequency rule is the `proportional` RoPE scaling type (model/rope_scaling/types.py, transformers' name for it,
which Gemma 4's global layers use with p = partial_rotary_factor); this variant rotates every layer with it at
p = 0.75 and factor 1, reusing RoPE's rotation (model.variants.rope: both pairings, float32 angles from the
positions each call, keys cached after rotation, RotaryEmbedding-23 when exported, so the compact fast graph and
its rotary folding take it as they take RoPE).  The variant's own config (`self.cfg`) is the model's with that
scaling in place: the encoding picture and its note show the proportional frequencies.

What a model config may say: p is fixed here (no config field), so rope_fraction must stay 1 (the pairs span the
whole head; another fraction would mean a partial rotation or another p, neither of which is p-RoPE at 0.75) and
rope_dims 0; a rope_scaling, a local RoPE base or per-layer encodings are refused (the frequencies are p-RoPE's own,
and an intervention's RoPE frequencies (export/intervene.py) are not offered: a request's scaling is computed
without p).  An intervention's positional_off removes the rotation of that layer (p = 0 there).
"""

from __future__ import annotations

from model import rope_scaling
from model.errors import ConfigError
from model.variants.rope import Rope

P = 0.75  # the fraction of pairs that turn: Barbero et al.'s best (Table 2, 0.75-RoPE)
PROPORTIONAL = "proportional"  # model/rope_scaling's type with p-RoPE's frequency rule


def rotation_config(cfg):
    """The model's config with p-RoPE's frequencies as its RoPE scaling: proportional at p = P, factor 1."""
    return cfg.replace(rope_scaling=PROPORTIONAL, rope_fraction=P, rope_factor=1.0)


class PRope(Rope):
    name = "p_rope"
    rope_scaled = False  # its frequencies are p-RoPE's own: no scaling from the config or from a request

    @classmethod
    def check_config(cls, cfg):
        if cfg.rope_scaling != rope_scaling.NONE:
            raise ConfigError(f"p_rope turns the fastest {P:g} of the pairs (its own frequencies): rope_scaling "
                              f"must be none, got {cfg.rope_scaling}")
        if cfg.rope_fraction != 1.0 or cfg.rope_dims:
            raise ConfigError(f"p_rope rotates the whole head with p = {P:g} fixed: rope_fraction must be 1 and "
                              f"rope_dims 0, got {cfg.rope_fraction} and {cfg.rope_dims}")
        super().check_config(cfg)
        rope_scaling.get(PROPORTIONAL).check(rotation_config(cfg))

    def __init__(self, cfg):
        super().__init__(rotation_config(cfg))

    def rotate(self, q, k, positions):
        """RoPE's rotation at the proportional frequencies (self.cfg is the rotation's config)."""
        return self._rotate(q, k, positions, self.cfg)
