"""Recomputing a prefix when a damaged block is found after the prefill has started.

Reads run while the model computes, so a block can fail its checksum when the forward
is already past the point where the request could simply match a shorter prefix. The
file is quarantined, and the prefix's K/V are computed on the side with a plain forward
of the prefix tokens (what the store would have held: keys after RoPE, positions from
the attention mask as ``generate`` computes them); the remaining layers take their rows
from there. The request returns the right answer, later than usual.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicCache

from ..model_info import ModelSpec
from .compat import CACHE_KWARG
from .layers import to_stored


@torch.no_grad()
def recompute_prefix(
    model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, reused: int, spec: ModelSpec
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per stored layer, ``[batch, kv_heads, reused, head_dim]`` keys and values (the
    store's padded width) of the first ``reused`` columns of a left-padded prompt
    (padding columns zero)."""
    device = next(model.parameters()).device
    cols = mask[:, :reused].to(device)
    positions = (cols.long().cumsum(-1) - 1).clamp(min=0)
    decoder = model.get_decoder()
    # plain layers keep every row of window layers too; a model with state layers needs
    # its own layer kinds (its window layers then hold their last rows: zeros in front)
    cache = DynamicCache(config=model.config) if spec.state_layers else DynamicCache()
    decoder(
        input_ids=ids[:, :reused].to(device), attention_mask=cols.long(), position_ids=positions, use_cache=True,
        **{CACHE_KWARG: cache},
    )
    pad = ~cols.bool()[:, None, :, None]
    result = []
    for m in spec.stored_layers:
        layer = cache.layers[m]
        k, v = to_stored(spec, spec.model_layers[m], layer.keys, layer.values)
        if k.shape[2] < reused:
            k, v = (torch.nn.functional.pad(t, (0, 0, reused - t.shape[2], 0)) for t in (k, v))
        result.append((k.masked_fill(pad, 0), v.masked_fill(pad, 0)))
    return result
