"""Registry: variant name -> class.  Adding an encoding is one module and one line here."""

from __future__ import annotations

from model.config import ModelConfig
from model.errors import UnknownVariantError
from model.variants.alibi import Alibi
from model.variants.base import PositionalVariant
from model.variants.cpe import ConvPositional
from model.variants.deberta import DeBERTa
from model.variants.fire import Fire
from model.variants.learned import Learned
from model.variants.none import NoPositions
from model.variants.rope import Rope
from model.variants.shaw import Shaw
from model.variants.sinusoidal import Sinusoidal
from model.variants.t5 import T5Bias
from model.variants.xl import TransformerXL

REGISTRY: dict[str, type[PositionalVariant]] = {
    cls.name: cls for cls in (NoPositions, Sinusoidal, Learned, Shaw, T5Bias, Rope, Alibi, Fire, ConvPositional,
                              TransformerXL, DeBERTa)
}


def build_variant(cfg: ModelConfig) -> PositionalVariant:
    if cfg.variant not in REGISTRY:
        raise UnknownVariantError(cfg.variant, list(REGISTRY))
    return REGISTRY[cfg.variant](cfg)


__all__ = ["REGISTRY", "PositionalVariant", "build_variant"]
