"""Same-budget baselines for benchmarks: which rows a method without probe heads keeps.

Each baseline picks ``k`` prefix rows of one layer for one batch row and is one small
function in `BASELINE_ROWS`; ``"h2o"`` reads every key first (that is its cost).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..store.layout import LayerView
from .scores import topk_indices
from .selectors import ReadUnits, RowSelection, kv_head_scores, load_rows, read_all

#: attention sinks always kept by the ``"recent"`` baseline (StreamingLLM)
SINK_TOKENS = 4


def random_rows(p: int, k: int, seed: int) -> torch.Tensor:
    """``k`` distinct rows drawn uniformly (seeded per layer)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.sort(torch.randperm(p, generator=gen)[:k]).values


def recent_rows(p: int, k: int, seed: int) -> torch.Tensor:
    """The first `SINK_TOKENS` rows plus the most recent ones (StreamingLLM-like)."""
    sink = min(SINK_TOKENS, k)
    return torch.cat([torch.arange(sink), torch.arange(p - (k - sink), p)]) if k > sink else torch.arange(sink)


#: baselines that choose rows without reading anything
BASELINE_ROWS: dict[str, Callable[[int, int, int], torch.Tensor]] = {"random": random_rows, "recent": recent_rows}


def select_baseline(
    mode: str,
    queries: torch.Tensor,
    new_keys: torch.Tensor,
    layout: LayerView,
    k: int,
    read_units: ReadUnits,
    seed: int,
) -> RowSelection:
    """Rows of one baseline, loaded like IMPRESS's (``"h2o"``: all keys read, then each
    KV head's top-k by accumulated attention)."""
    if mode == "h2o":
        units, blocks, full_k = read_all(layout, read_units)
        rows = topk_indices(kv_head_scores(queries, full_k, new_keys).unsqueeze(0), k)[0]
        keys, values = layout.gather(units, blocks, rows)
        return RowSelection(keys, values, 0.0, 0.0, False, rows, blocks.stats)
    return load_rows(layout, BASELINE_ROWS[mode](layout.length, k, seed), read_units, 1.0, 0.0, False)
