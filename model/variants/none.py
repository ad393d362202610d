"""NoPE: nothing added; the causal mask alone carries order (Haviv et al. 2022; Kazemnejad et al. 2023)."""

from model.variants.base import PositionalVariant


class NoPositions(PositionalVariant):
    name = "none"
    compact_layout = True
    index_positions = False  # no position at all
