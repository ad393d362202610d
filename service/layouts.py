"""The cache layouts this worker serves, by the name model.json's `fast.layout` gives (service/kvcache.py).

Adding a layout is its Codec and KVCache subclasses and its line here: the artifact check (service/artifacts.py)
accepts its name and the inputs it declares, and the model's record carries the layout its fast graph has, resolved
once at load, which the executor and the decode batch use without asking which.
"""

from __future__ import annotations

from service.compact import CompactCache, CompactCodec
from service.kvcache import Layout
from service.padded import PaddedCache, PaddedCodec

PADDED = Layout(PaddedCodec, PaddedCache)  # every exact graph's (and the calls that want attention maps)
LAYOUTS: dict[str, Layout] = {layout.name: layout for layout in (PADDED, Layout(CompactCodec, CompactCache))}
