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

from collections.abc import Mapping

import torch
from transformers.cache_utils import DynamicCache

from .compat import CACHE_KWARG


@torch.no_grad()
def recompute_new_tokens(
    model: torch.nn.Module,
    ids: torch.Tensor,
    mask: torch.Tensor,
    reused: int,
    prefix: Mapping[int, tuple[torch.Tensor, torch.Tensor]] | list[tuple[torch.Tensor, torch.Tensor]],
    dtype: torch.dtype,
    prefix_mask: torch.Tensor | None = None,
) -> tuple[dict[int, tuple[torch.Tensor, torch.Tensor]], torch.Tensor]:
    """Per layer the ``[batch, kv_heads, new, head_dim]`` keys and values of the columns
    after ``reused`` of a left-padded prompt, computed over ``prefix`` (per layer
    ``[batch, kv_heads, reused, head_dim]``), and the ``[batch, vocab]`` logits after the
    prompt's last token.

    With ``prefix_mask`` (``[batch, m]``), ``prefix`` holds only ``m`` of the prefix rows
    per layer (keys after RoPE keep their positions; the mask says which are held): the
    new tokens keep their positions in the prompt and attend to those rows only.

    ``prefix`` is keyed by model layer (a list: layers ``0 ..``); layers without an entry
    (layers that use another layer's K/V) get none. The result is keyed the same way.
    A layer may hold zeros where its attention never looks (a window's hidden rows)."""
    device = next(model.parameters()).device
    rows = dict(enumerate(prefix)) if isinstance(prefix, list) else dict(prefix)
    cache = DynamicCache()  # plain layers keep every row: masks are built over all of them
    for i in sorted(rows):
        k, v = rows[i]
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
    new = {i: (cache.layers[i].keys[:, :, reused:], cache.layers[i].values[:, :, reused:]) for i in rows}
    return new, out.logits[:, -1]
