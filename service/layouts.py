"""The cache layouts this worker serves, by the name model.json's `fast.layout` gives (service/kvcache.py).

Adding a layout is one KVCache subclass and its line here: the artifact check (service/artifacts.py) accepts its
name and the inputs it declares, and the executor and the decode loop use whichever the model's graph has.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from service.compact import CompactCache
from service.kvcache import KVCache
from service.padded import PaddedCache

if TYPE_CHECKING:
    from service.artifacts import LoadedModel

LAYOUTS: dict[str, type[KVCache]] = {cls.name: cls for cls in (PaddedCache, CompactCache)}


def layout_of(model: LoadedModel) -> type[KVCache]:
    """The layout of the graph a model's decode steps and plain prompts run on: its fast graph's, else padded (the
    exact graph's, which also serves every call that wants attention maps)."""
    return LAYOUTS[model.layout] if model.fast is not None else PaddedCache
