"""Computing a sparse prefill's new tokens again, against the whole prefix.

A sparse prefill computes the new tokens' K/V while every layer attends to only its
selected prefix rows. With ``decode="full"`` the rest of the prefix is restored before
the first decode step, but the new tokens' K/V would stay approximate and steer every
later token. Once the whole prefix is in memory, one forward of the new tokens over it
(a plain `DynamicCache` holding the prefix, positions from the attention mask as
``generate`` computes them) gives exactly the K/V dense reuse would hold, and the exact
next-token logits (what the uncertainty guard emits instead of the sparse ones).
The hooks ignore this forward: it carries no ImpressCache.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicCache

from .compat import CACHE_KWARG


@torch.no_grad()
def recompute_new_tokens(
    model: torch.nn.Module,
    ids: torch.Tensor,
    mask: torch.Tensor,
    reused: int,
    prefix: list[tuple[torch.Tensor, torch.Tensor]],
    dtype: torch.dtype,
    prefix_mask: torch.Tensor | None = None,
) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]:
    """Per layer the ``[batch, kv_heads, new, head_dim]`` keys and values of the columns
    after ``reused`` of a left-padded prompt, computed over ``prefix`` (per layer
    ``[batch, kv_heads, reused, head_dim]``), and the ``[batch, vocab]`` logits after the
    prompt's last token.

    With ``prefix_mask`` (``[batch, m]``), ``prefix`` holds only ``m`` of the prefix rows
    per layer (keys after RoPE keep their positions; the mask says which are held): the
    new tokens keep their positions in the prompt and attend to those rows only."""
    device = next(model.parameters()).device
    cache = DynamicCache()
    for i, (k, v) in enumerate(prefix):
        cache.update(k.to(device, dtype), v.to(device, dtype), i)
    mask = mask.to(device).long()
    positions = (mask.cumsum(-1) - 1).clamp(min=0)[:, reused:]
    if prefix_mask is not None:
        mask = torch.cat([prefix_mask.to(device).long(), mask[:, reused:]], dim=-1)
        reused = prefix_mask.shape[1]
    out = model(
        input_ids=ids[:, -positions.shape[1] :].to(device),
        attention_mask=mask,
        position_ids=positions,
        use_cache=True,
        logits_to_keep=1,
        **{CACHE_KWARG: cache},
    )
    new = [(layer.keys[:, :, reused:], layer.values[:, :, reused:]) for layer in cache.layers]
    return new, out.logits[:, -1]
