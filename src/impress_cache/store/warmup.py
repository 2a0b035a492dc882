"""Warming a store up: reading the stored prefixes of known prompts once, so their blocks
enter the memory tiers and the policy has statistics for them."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import torch

from ..storage.base import KV

log = logging.getLogger(__name__)


def warmup(store: Any, prompts: Iterable[Any], tokenizer: Any = None) -> dict[str, int]:
    """Each prompt (token ids: list, tuple, 1-D or ``[1, n]`` tensor; or a string with
    ``tokenizer``) is matched and every K/V block of its stored prefix is read once
    through `ImpressStore.read_blocks` with the block's current average importance share,
    so the blocks enter the memory tiers within their budgets and the policy has
    statistics for them. Returns ``prompts`` (matched), ``matched_tokens``, ``blocks``
    and ``bytes_read_disk``."""
    summary = {"prompts": 0, "matched_tokens": 0, "blocks": 0, "bytes_read_disk": 0}
    for prompt in prompts:
        m = store.match(_as_tokens(prompt, tokenizer))
        if m.length == 0:
            continue
        with store.lease([m]):
            lay = store.layout(m.segments)
            for layer in range(store.spec.num_layers):
                keys = sorted(set(lay.keys(range(len(lay.units)), KV, layer)))
                read = store.read_blocks(keys, [store.tiers.importance_share(k) for k in keys])
                summary["blocks"] += len(keys)
                summary["bytes_read_disk"] += read.stats.disk_bytes
        summary["prompts"] += 1
        summary["matched_tokens"] += m.length
    log.info("warm-up: %s", summary)
    return summary


def _as_tokens(prompt: Any, tokenizer: Any) -> list[int]:
    if isinstance(prompt, str):
        if tokenizer is None:
            raise TypeError("warmup got a string prompt; pass tokenizer=... or token ids")
        return [int(t) for t in tokenizer(prompt)["input_ids"]]
    if isinstance(prompt, torch.Tensor):
        if prompt.dim() == 2 and prompt.shape[0] == 1:
            prompt = prompt[0]
        if prompt.dim() != 1:
            raise ValueError(f"warmup takes one prompt per item: 1-D or [1, n] token tensors, got shape {tuple(prompt.shape)}")
        return [int(t) for t in prompt.tolist()]
    return [int(t) for t in prompt]
