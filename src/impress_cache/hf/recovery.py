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


@torch.no_grad()
def recompute_prefix(
    model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, reused: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, ``[batch, kv_heads, reused, head_dim]`` keys and values of the first
    ``reused`` columns of a left-padded prompt (padding columns zero)."""
    device = next(model.parameters()).device
    cols = mask[:, :reused].to(device)
    positions = (cols.long().cumsum(-1) - 1).clamp(min=0)
    decoder = model.get_decoder()
    out = decoder(input_ids=ids[:, :reused].to(device), attention_mask=cols.long(), position_ids=positions, use_cache=True)
    cache = out.past_key_values
    pad = ~cols.bool()[:, None, :, None]
    result = []
    for layer in cache.layers:
        result.append((layer.keys.masked_fill(pad, 0), layer.values.masked_fill(pad, 0)))
    return result
