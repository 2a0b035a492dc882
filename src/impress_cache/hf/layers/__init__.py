"""One cache layer per model layer, chosen by what transformers says the layer is.

`LAYER_CLASSES` maps each kind of `model_info.LayerInfo` to the layer class an
`ImpressCache` builds for it; `transformers`' own `DummyLayer` stands for layers that
store nothing (they use another layer's K/V, or have no attention).
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import DummyLayer

from ...model_info import LayerInfo, ModelSpec
from .full import ImpressLayer
from .window import ImpressWindowLayer

LAYER_CLASSES: dict[str, type] = {"full": ImpressLayer, "window": ImpressWindowLayer, "shared": DummyLayer}


def make_layers(spec: ModelSpec) -> list[Any]:
    """The cache layers of one request, one per model layer."""
    out: list[Any] = []
    stored = {m: s for s, m in enumerate(spec.stored_layers)}
    for m, info in enumerate(spec.model_layers):
        cls = LAYER_CLASSES[info.kind]
        out.append(cls() if cls is DummyLayer else cls(info=info, padded=spec.padded(stored[m])))
    return out


def to_stored(spec: ModelSpec, info: LayerInfo, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[..., heads, rows, dim]`` keys and values of one layer, padded with zeros to the
    store's width (unchanged when the layer has it)."""
    h, d = spec.num_kv_heads, spec.head_dim
    if (info.k_heads, info.k_dim, info.v_heads, info.v_dim) == (h, d, h, d):
        return keys, values
    out = []
    for t in (keys, values):
        p = t.new_zeros((*t.shape[:-3], h, t.shape[-2], d))
        p[..., : t.shape[-3], :, : t.shape[-1]] = t
        out.append(p)
    return out[0], out[1]


__all__ = ["LAYER_CLASSES", "ImpressLayer", "ImpressWindowLayer", "make_layers", "to_stored"]
