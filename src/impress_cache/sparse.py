"""Sparse prefix loading for one layer and one batch row (IMPRESS "identify, then load").

Given the new tokens' queries, the compact probe keys of a stored prefix and a way to
read blocks, pick the prefix rows this layer attends to and return their K/V:

1. score prefix rows with the query heads of the probed KV groups
   (`attention_column_scores`, summed per KV head: with grouped-query attention a
   loaded "head" is a KV head);
2. per probed KV head top-k, mean pairwise Jaccard, threshold ``t = j ** alpha``;
3. agreement: one shared row set (``"token"``: vote; ``"block"``: whole units ranked by
   summed scores), read only the units holding it;
4. disagreement: read every unit of the layer, score all heads, and keep each KV head's
   own top-k.

No transformers here and no file handling: reads go through the ``read_units`` callable.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from .importance import (
    attention_column_scores,
    mean_pairwise_jaccard,
    select_units,
    similarity_threshold,
    topk_indices,
    vote,
)
from .layout import PrefixLayout

#: same-budget baselines for benchmarks: random rows; attention sinks + most recent rows
#: (StreamingLLM-like); all keys read, then each KV head's top-k by accumulated attention
#: (H2O-like)
BASELINES = ("random", "recent", "h2o")
SINK_TOKENS = 4

#: reads units (by index into ``layout.units``) of one layer, given the selected positions
#: (``[k]`` or ``[H, k]``, for the blocks' importance shares); returns ``[2, H, rows, D]``
#: blocks in the same order and the bytes read from disk for them
ReadUnits = Callable[[Sequence[int], torch.Tensor], tuple[list[torch.Tensor], int]]


@dataclass
class RowSelection:
    """What one layer of one batch row attends to in the prefix."""

    keys: torch.Tensor  # [H, k, D]
    values: torch.Tensor  # [H, k, D]
    similarity: float
    threshold: float
    fell_back: bool
    bytes_read: int
    bytes_used: int
    #: selected prefix positions: ``[k]`` shared by all heads, or ``[Hkv, k]`` on fallback
    rows: torch.Tensor


def _normalised_sum(scores: torch.Tensor) -> torch.Tensor:
    """``[H, P]`` -> ``[P]``: each head's scores divided by their sum, summed over heads."""
    s = scores.to(torch.float64)
    return (s / s.sum(dim=-1, keepdim=True).clamp_min(1e-30)).sum(dim=0)


def gather_all(layout: PrefixLayout, blocks: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Every row of the prefix, from the blocks of all its units (in unit order)."""
    return layout.gather(range(len(layout.units)), blocks)


def select_row(
    *,
    queries: torch.Tensor,
    new_keys: torch.Tensor,
    probe_keys: torch.Tensor | None,
    probe_kv_heads: Sequence[int],
    layout: PrefixLayout,
    k: int,
    read_units: ReadUnits,
    mode: str = "block",
    alpha: float = 0.6,
    fixed_threshold: float | None = None,
    seed: int = 0,
) -> RowSelection:
    """Select and load ``k`` prefix rows of one layer for one batch row.

    Parameters
    ----------
    queries:
        ``[Hq, n, D]`` post-RoPE queries of the new tokens (all query heads).
    new_keys:
        ``[Hkv, n, D]`` keys of the new tokens.
    probe_keys:
        ``[len(probe_kv_heads), P, D]`` decoded probe keys of the prefix.
    probe_kv_heads:
        The KV heads the probe copy holds (the groups of the configured probe query
        heads). Every query head of those groups scores the prefix.
    layout:
        Units of the prefix (``layout.length == P``).
    k:
        Rows to keep, ``1 <= k <= P``.
    read_units:
        Reads unit blocks of this layer (see `ReadUnits`).
    mode:
        ``"token"`` or ``"block"`` construction of the shared set, or one of the
        same-budget `BASELINES` (``"random"``, ``"recent"``, ``"h2o"``), which ignore
        the probe keys.
    alpha, fixed_threshold:
        Threshold ``t = j ** alpha`` unless ``fixed_threshold`` is given.
    seed:
        Seed of the ``"random"`` baseline (the cache passes the layer index).
    """
    hq, _, d = queries.shape
    hkv = new_keys.shape[0]
    group = hq // hkv
    p = layout.length
    if mode in BASELINES:
        return _baseline(mode, queries, new_keys, layout, k, read_units, seed)
    # Score with every query head of the probed KV groups: with grouped-query attention
    # the I/O cost is per KV head, and the extra query heads cost only compute. Each
    # probed KV head gets one score row (its group's column sums added up).
    # the query heads of each probed KV head, in probe-copy order (grouped: no key copies)
    q_heads = [h for kv in probe_kv_heads for h in range(kv * group, (kv + 1) * group)]
    nk = new_keys[list(probe_kv_heads)]
    per_q = attention_column_scores(queries[q_heads].unsqueeze(0), probe_keys.unsqueeze(0), nk.unsqueeze(0))[0]
    scores = per_q.view(len(probe_kv_heads), group, p).sum(dim=1)  # [probed KV heads, P]
    threshold = fixed_threshold if fixed_threshold is not None else similarity_threshold(k, p, alpha)
    per_head = topk_indices(scores.unsqueeze(0), k)  # [1, Hp, k]
    similarity = float(mean_pairwise_jaccard(per_head)[0])

    if similarity >= threshold:
        if mode == "block":
            rows = select_units(_normalised_sum(scores), layout.unit_of, k)
        else:
            rows = vote(scores.unsqueeze(0), k)[0]
        units = layout.units_for(rows)
        blocks, nbytes = read_units(units, rows)
        keys, values = layout.gather(units, blocks, rows)
        itemsize = blocks[0].element_size()
        used = 2 * hkv * k * d * itemsize
        return RowSelection(keys, values, similarity, threshold, False, nbytes, used, rows)

    # the probe heads disagree: every KV head chooses its own rows
    if list(probe_kv_heads) == list(range(hkv)):
        # the probe copy already holds every KV head's keys: their scores are known, read
        # only the union of the heads' choices
        kv_scores = scores
        if mode == "block":
            rows = torch.stack([select_units(kv_scores[h], layout.unit_of, k) for h in range(hkv)])
        else:
            rows = topk_indices(kv_scores.unsqueeze(0), k)[0]  # [Hkv, k]
        units = layout.units_for(rows.reshape(-1))
        blocks, nbytes = read_units(units, rows)
    else:
        # read the whole layer to get every KV head's keys
        units = list(range(len(layout.units)))
        blocks, nbytes = read_units(units, None)
        full_k, _ = gather_all(layout, blocks)
        kv_scores = _kv_head_scores(queries, full_k.float(), new_keys)
        rows = topk_indices(kv_scores.unsqueeze(0), k)[0]  # [Hkv, k]
    keys, values = layout.gather(units, blocks, rows)
    itemsize = blocks[0].element_size()
    used = 2 * hkv * k * d * itemsize
    return RowSelection(keys, values, similarity, threshold, True, nbytes, used, rows)


def _kv_head_scores(queries: torch.Tensor, prefix_keys: torch.Tensor, new_keys: torch.Tensor) -> torch.Tensor:
    """``[Hkv, P]`` scores: column sums of every query head, summed within its KV group."""
    hq = queries.shape[0]
    hkv, p = prefix_keys.shape[0], prefix_keys.shape[1]
    scores = attention_column_scores(
        queries.unsqueeze(0), prefix_keys.float().unsqueeze(0), new_keys.float().unsqueeze(0)
    )[0]  # [Hq, P]
    return scores.view(hkv, hq // hkv, p).sum(dim=1)


def _baseline(
    mode: str,
    queries: torch.Tensor,
    new_keys: torch.Tensor,
    layout: PrefixLayout,
    k: int,
    read_units: ReadUnits,
    seed: int,
) -> RowSelection:
    p = layout.length
    hkv, d = new_keys.shape[0], new_keys.shape[-1]
    if mode == "random":
        gen = torch.Generator().manual_seed(seed)
        rows = torch.sort(torch.randperm(p, generator=gen)[:k]).values
    elif mode == "recent":
        sink = min(SINK_TOKENS, k)
        rows = torch.cat([torch.arange(sink), torch.arange(p - (k - sink), p)]) if k > sink else torch.arange(sink)
    else:  # h2o
        units = list(range(len(layout.units)))
        blocks, nbytes = read_units(units, None)
        full_k, _ = gather_all(layout, blocks)
        rows = topk_indices(_kv_head_scores(queries, full_k.float(), new_keys).unsqueeze(0), k)[0]
        keys, values = layout.gather(units, blocks, rows)
        used = 2 * hkv * k * d * blocks[0].element_size()
        return RowSelection(keys, values, 0.0, 0.0, False, nbytes, used, rows)
    units = layout.units_for(rows)
    blocks, nbytes = read_units(units, rows)
    keys, values = layout.gather(units, blocks, rows)
    used = 2 * hkv * k * d * blocks[0].element_size()
    return RowSelection(keys, values, 1.0, 0.0, False, nbytes, used, rows)
