"""Registry: variant name -> class.  Adding an encoding is one module and one line here.

The registry is the one list of variant names: a config carries a name as plain data (model.config knows no
names), and building a model from it (`build_variant`, or `check_name` / `check_config` first where work would be
wasted) refuses a name the registry does not hold, listing those it does, and a config the named class cannot run.
What a variant supports (the compact layout, a RoPE scaling, a bound on positions) is declared on its class."""

from __future__ import annotations

from model.config import ModelConfig
from model.errors import UnknownVariantError
from model.variants.alibi import Alibi
from model.variants.base import PositionalVariant
from model.variants.cope import CoPE
from model.variants.cpe import ConvPositional
from model.variants.deberta import DeBERTa
from model.variants.fire import Fire
from model.variants.fope import FoPE
from model.variants.fox import Fox
from model.variants.kerple import KerpleLog, KerplePower
from model.variants.learned import Learned
from model.variants.none import NoPositions
from model.variants.p_rope import PRope
from model.variants.path import Path
from model.variants.rope import Rope
from model.variants.sandwich import Sandwich
from model.variants.shaw import Shaw
from model.variants.sinusoidal import Sinusoidal
from model.variants.ssmax import SSMax, SSMaxRope
from model.variants.t5 import T5Bias
from model.variants.xl import TransformerXL
from model.variants.xpos import XPos

REGISTRY: dict[str, type[PositionalVariant]] = {
    cls.name: cls for cls in (NoPositions, Sinusoidal, Learned, Shaw, T5Bias, Rope, Alibi, Fire, ConvPositional,
                              TransformerXL, DeBERTa, XPos, KerpleLog, KerplePower, Sandwich,
                              CoPE, FoPE, PRope, SSMax, SSMaxRope, Fox, Path)
}


VARIANT_NAMES: tuple[str, ...] = tuple(REGISTRY)  # display order


def check_name(name: str) -> str:
    """`name` when the registry holds it; UnknownVariantError listing the registered ones otherwise."""
    if name not in REGISTRY:
        raise UnknownVariantError(str(name), list(REGISTRY))
    return name


def check_config(cfg: ModelConfig) -> type[PositionalVariant]:
    """The config's variant class, once it has checked what its name requires of the config (its own fields, the
    RoPE scaling's); UnknownVariantError or ConfigError otherwise."""
    cls = REGISTRY[check_name(cfg.variant)]
    cls.check_config(cfg)
    return cls


def max_positions(cfg: ModelConfig) -> int | None:
    """How many positions (past + new) a model of this config accepts; None means unbounded."""
    return REGISTRY[check_name(cfg.variant)].max_positions(cfg)


def build_variant(cfg: ModelConfig) -> PositionalVariant:
    return check_config(cfg)(cfg)


__all__ = ["REGISTRY", "VARIANT_NAMES", "PositionalVariant", "build_variant", "check_config", "check_name",
           "max_positions"]
