"""Reading every K/V row of a matched prefix into ``[layers, kv_heads, tokens, head_dim]``."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..model_info import ModelSpec
from ..storage.base import KV
from .layout import PrefixLayout


@dataclass
class LoadedPrefix:
    """K/V rows of one matched prefix: ``keys[layer]`` is ``[kv_heads, tokens, head_dim]``."""

    keys: torch.Tensor
    values: torch.Tensor
    bytes_read: int
    blocks_read: int


def load_layout(
    spec: ModelSpec,
    lay: PrefixLayout,
    start: Callable[..., Any],
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
    known: Mapping[int, torch.Tensor] | None = None,
    decode: bool = False,
    layers: Sequence[int] | None = None,
) -> LoadedPrefix:
    """`ImpressStore.load` for the layout ``lay``; ``start`` is the store's `start_layout`."""
    shape = (spec.num_layers, spec.num_kv_heads, lay.length, spec.head_dim)
    if out is None:
        out = (torch.empty(shape, dtype=spec.torch_kv_dtype), torch.empty(shape, dtype=spec.torch_kv_dtype))
    keys, values = out
    if tuple(keys.shape) != shape or tuple(values.shape) != shape:
        raise ValueError(f"out tensors must have shape {shape}, got {tuple(keys.shape)}")
    nbytes = nblocks = 0
    wanted = list(range(spec.num_layers)) if layers is None else sorted(set(layers))
    # one read for every layer when the layers share their units (prompt order)
    groups = ([wanted] if wanted else []) if lay.in_order else [[layer] for layer in wanted]
    for group in groups:
        units = lay.at(group[0]).units_all()
        blocks = start(lay, KV, group, units, decode=decode, known=known).result()
        for i, layer in enumerate(group):
            k, v = lay.at(layer).gather(units, blocks, offset=i * len(units))
            keys[layer].copy_(k)
            values[layer].copy_(v)
        nbytes += blocks.stats.disk_bytes
        nblocks += blocks.stats.disk_blocks
    return LoadedPrefix(keys, values, nbytes, nblocks)
