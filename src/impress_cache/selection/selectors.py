"""Sparse prefix loading for one layer and one batch row (IMPRESS "identify, then load").

Given the new tokens' queries, the compact probe keys of a stored prefix and a way to
read blocks, pick the prefix rows this layer attends to and return their K/V:

1. score prefix rows with the query heads of the probed KV groups
   (`attention_column_scores`, summed per KV head: with grouped-query attention a
   loaded "head" is a KV head);
2. per probed KV head top-k, mean pairwise Jaccard, threshold ``t = j ** alpha``;
3. agreement: one shared row set (``"token"``: vote; ``"block"``: whole units ranked by
   summed scores), read only the units holding it;
4. disagreement: every KV head chooses its own rows (from the probe copy when it holds
   every KV head, otherwise after reading every unit of the layer).

No transformers here and no file handling: reads go through the ``read_units`` callable.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ..store.blockset import BlockSet, ReadStats
from ..store.layout import LayerView
from .bounds import BlockSummaries, block_summaries, take_units, unit_row_scores, unit_scores, units_taken
from .modes import BASELINES
from .scores import column_sums, select_units, similarity_threshold, top_jaccard, topk_indices, vote

#: reads units (indices into ``layout.units``) of one layer, given the selected positions
#: (``[k]`` or ``[H, k]``, for the blocks' importance shares; ``None``: all rows used)
ReadUnits = Callable[[Sequence[int], "torch.Tensor | None"], BlockSet]


@dataclass
class RowSelection:
    """What one layer of one batch row attends to in the prefix."""

    keys: torch.Tensor  # [H, k, D]
    values: torch.Tensor  # [H, k, D]
    similarity: float
    threshold: float
    fell_back: bool
    #: selected prefix positions: ``[k]`` shared by all heads, or ``[Hkv, k]`` per head
    rows: torch.Tensor
    #: what reading the blocks cost
    read: ReadStats
    #: ``[P]`` combined probe scores: the positions ranking in their top ``k`` are what
    #: the reorganiser accumulates (`top_masks`, once per request, off the per-layer
    #: path); ``None`` when the selection had no scores; or a function that makes them
    #: when asked (`row_ranking`: bounds spread their units' scores over the rows then)
    ranking: torch.Tensor | Callable[[], torch.Tensor] | None = None
    #: how many units (blocks) hold ``rows`` (``None``: not counted)
    units: int | None = None

    def row_ranking(self) -> torch.Tensor | None:
        """`ranking` as ``[P]`` scores."""
        return self.ranking() if callable(self.ranking) else self.ranking


def normalised_sum(scores: torch.Tensor) -> torch.Tensor:
    """``[H, P]`` -> ``[P]``: each head's scores divided by their sum, summed over heads."""
    s = scores.to(torch.float64)
    return (s / s.sum(dim=-1, keepdim=True).clamp_min(1e-30)).sum(dim=0)


def kv_head_scores(queries: torch.Tensor, prefix_keys: torch.Tensor, new_keys: torch.Tensor) -> torch.Tensor:
    """``[Hkv, P]`` scores of every KV head (from its full keys): `probe_scores` over all
    KV heads."""
    return probe_scores(queries, new_keys.float(), prefix_keys.float(), range(prefix_keys.shape[0]))


def load_rows(
    layout: LayerView,
    rows: torch.Tensor,
    read_units: ReadUnits,
    sim: float,
    thr: float,
    fell_back: bool,
    ranking: torch.Tensor | Callable[[], torch.Tensor] | None = None,
    units: list[int] | None = None,
    out: torch.Tensor | None = None,
) -> RowSelection:
    """Read the units holding ``rows`` (``units``, when known) and gather their K/V (into
    ``out``, a ``[2, H, k, D]`` tensor or view, when given: see `LayerView.gather`)."""
    if units is None:
        units = layout.units_for(rows.reshape(-1))
    blocks = read_units(units, rows)
    keys, values = layout.gather(units, blocks, rows, out=out)
    return RowSelection(keys, values, sim, thr, fell_back, rows, blocks.stats, ranking, len(units))


def top_masks(scores: torch.Tensor, k: int) -> torch.Tensor:
    """``[..., P]`` float: 1 at the ``k`` highest of each row of ``scores``, 0 elsewhere."""
    out = torch.zeros(scores.shape, dtype=torch.float32)
    out.scatter_(-1, torch.topk(scores, k, dim=-1, sorted=False).indices, 1.0)
    return out


@functools.lru_cache(maxsize=64)
def kept_rows(p: int, sinks: int, recent: int) -> torch.Tensor | None:
    """The rows of a ``p``-row prefix always kept: the first ``sinks`` and the last
    ``recent`` (``None``: none). Cached and shared: index with it, never modify it."""
    sinks, recent = min(sinks, p), min(recent, p)
    if sinks + recent == 0:
        return None
    with torch.inference_mode(False):  # a normal tensor, usable later with or without grad
        return torch.unique(torch.cat([torch.arange(sinks), torch.arange(p - recent, p)]))


def read_all(layout: LayerView, read_units: ReadUnits) -> tuple[list[int], BlockSet, torch.Tensor]:
    """Every unit of the layer: the units, their blocks and the prefix's keys ``[H, P, D]``."""
    units = layout.units_all()
    blocks = read_units(units, None)
    return units, blocks, layout.gather(units, blocks)[0]


def probe_scores(
    queries: torch.Tensor, new_keys: torch.Tensor, probe_keys: torch.Tensor, probe_kv_heads: Sequence[int]
) -> torch.Tensor:
    """``[len(probe_kv_heads), P]`` scores of the prefix rows from ``[Hq, n, D]`` queries,
    ``[Hkv, n, D]`` new keys and ``[len(probe_kv_heads), P, D]`` probe keys.

    Every query head of the probed KV groups scores: with grouped-query attention the I/O
    cost is per KV head, and the extra query heads cost only compute. Each probed KV
    head gets one score row (its group's column sums added up)."""
    group = queries.shape[0] // new_keys.shape[0]
    p = probe_keys.shape[1]
    q_heads = [h for kv in probe_kv_heads for h in range(kv * group, (kv + 1) * group)]
    nk = new_keys[list(probe_kv_heads)]
    # the argument checks of attention_column_scores hold by construction here
    per_q = column_sums(queries[q_heads].unsqueeze(0), probe_keys.unsqueeze(0), nk.unsqueeze(0))[0]
    return per_q.view(len(probe_kv_heads), group, p).sum(dim=1)


def bound_unit_scores(
    queries: torch.Tensor, kv_heads: int, probe_keys: torch.Tensor | None, probe_kv_heads: Sequence[int],
    layout: LayerView, summaries: BlockSummaries | None = None,
) -> torch.Tensor:
    """``[len(probe_kv_heads), units]`` scores of the layer's units from the key bounds
    (`selection.bounds`) for ``[Hq, n, D]`` queries of a model with ``kv_heads`` KV heads.
    The summaries are computed from ``probe_keys`` when not given."""
    if summaries is None:
        assert probe_keys is not None
        summaries = block_summaries(probe_keys, *layout.unit_table())
    group = queries.shape[0] // kv_heads
    heads = list(probe_kv_heads)
    if heads == list(range(heads[0], heads[0] + len(heads))):  # a run of KV heads: a view
        return unit_scores(queries[heads[0] * group : (heads[-1] + 1) * group], summaries)
    q_heads = [h for kv in heads for h in range(kv * group, (kv + 1) * group)]
    return unit_scores(queries[q_heads], summaries)


def select_by_bounds(
    *,
    queries: torch.Tensor,
    new_keys: torch.Tensor,
    probe_keys: torch.Tensor | None,
    probe_kv_heads: Sequence[int],
    layout: LayerView,
    k: int,
    read_units: ReadUnits,
    threshold: tuple[float, float | None],
    forced: torch.Tensor | None,
    summaries: BlockSummaries | None,
    out: torch.Tensor | None = None,
) -> RowSelection:
    """``mode="block"`` with ``block_scores="bounds"``: everything on unit scores. The
    agreement of the probe heads is the Jaccard similarity of their top units (as many as
    ``k`` rows take), against the threshold of that many of the present units."""
    hkv = new_keys.shape[0]
    p = layout.length
    count = layout.unit_count
    scores = bound_unit_scores(queries, hkv, probe_keys, probe_kv_heads, layout, summaries)  # [H, U]
    present = layout.present_units
    k_u = min(present, max(1, math.ceil(k * present / p)))
    alpha, fixed = threshold
    thr = fixed if fixed is not None else similarity_threshold(k_u, present, alpha)
    sim = top_jaccard(scores, k_u)
    ranking_u = normalised_sum(scores)  # [U]
    # the rows' ranking is spread out of the units' when the reorganiser's record needs it
    ranking = functools.partial(_spread, ranking_u, layout.unit_of, count)
    combined = ranking_u
    forced_units = None if forced is None else layout.units_of_kept(forced)
    if forced_units is not None:
        combined = ranking_u.clone()
        combined[forced_units] += 1e9
    if sim >= thr:
        rows, units = units_taken(combined, layout.unit_of, count, k)
        return load_rows(layout, rows, read_units, sim, thr, False, ranking, units, out)
    if forced_units is not None:
        scores = scores.clone()
        scores[:, forced_units] += 1e9
    if list(probe_kv_heads) == list(range(hkv)):
        rows = torch.stack([take_units(scores[h], layout.unit_of, count, k) for h in range(hkv)])
        return load_rows(layout, rows, read_units, sim, thr, True, ranking, out=out)
    return _own_rows_from_full(layout, read_units, queries, new_keys, forced, k, sim, thr, ranking, out)


def _spread(ranking_u: torch.Tensor, unit_of: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """``[P]`` row ranking of ``[U]`` unit scores (`unit_row_scores`)."""
    return unit_row_scores(ranking_u.unsqueeze(0), unit_of, count)[0]


def _own_rows_from_full(
    layout: LayerView, read_units: ReadUnits, queries: torch.Tensor, new_keys: torch.Tensor,
    forced: torch.Tensor | None, k: int, similarity: float, threshold: float, ranking: torch.Tensor | None,
    out: torch.Tensor | None = None,
) -> RowSelection:
    """The probe heads disagree and the probe copy lacks some KV heads: read the whole
    layer and let every KV head choose its own ``k`` rows."""
    units, blocks, full_k = read_all(layout, read_units)
    full_scores = kv_head_scores(queries, full_k, new_keys)  # [Hkv, P]
    if forced is not None:
        full_scores[:, forced] += 1e9
    rows = topk_indices(full_scores.unsqueeze(0), k)[0]  # [Hkv, k]
    keys, values = layout.gather(units, blocks, rows, out=out)
    return RowSelection(keys, values, similarity, threshold, True, rows, blocks.stats, ranking)


def select_row(
    *,
    queries: torch.Tensor,
    new_keys: torch.Tensor,
    probe_keys: torch.Tensor | None,
    probe_kv_heads: Sequence[int],
    layout: LayerView,
    k: int,
    read_units: ReadUnits,
    mode: str = "block",
    alpha: float = 0.6,
    fixed_threshold: float | None = None,
    seed: int = 0,
    keep: tuple[int, int] = (0, 0),
    block_scores: str = "rows",
    summaries: BlockSummaries | None = None,
    out: torch.Tensor | None = None,
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
        Where the prefix's positions live in this layer (``layout.length == P``; a view
        from `PrefixLayout.at`).
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
    keep:
        ``(sinks, recent)``: the first ``sinks`` and last ``recent`` rows are always
        selected (they rank above every scored row; they count against ``k``); the
        baselines ignore it.
    block_scores:
        ``"rows"``: score every prefix row with the probed query heads (`probe_scores`);
        ``"bounds"``: score each unit by the per-channel bounds of its probe keys
        (`bound_unit_scores`; in block mode the whole selection works on units,
        `select_by_bounds`; in token mode the rows share their unit's score).
    summaries:
        With ``"bounds"``: the units' key bounds, if already computed (for example by the
        probe loader); otherwise they are computed from ``probe_keys``.
    out:
        Where the selected keys and values go, ``[2, Hkv, k, D]`` (for example the
        layer's buffer): the returned ``keys`` and ``values`` are then ``out[0]`` and
        ``out[1]`` (the baselines ignore it).
    """
    if mode in BASELINES:
        from .baselines import select_baseline

        return select_baseline(mode, queries, new_keys, layout, k, read_units, seed)
    hkv = new_keys.shape[0]
    p = layout.length
    if not 1 <= k <= p:
        raise ValueError(f"k={k} must be in [1, P={p}]")
    if block_scores == "bounds" and mode == "block":
        return select_by_bounds(
            queries=queries, new_keys=new_keys, probe_keys=probe_keys, probe_kv_heads=probe_kv_heads, layout=layout,
            k=k, read_units=read_units, threshold=(alpha, fixed_threshold), forced=kept_rows(p, *keep),
            summaries=summaries, out=out,
        )
    if block_scores == "bounds":  # token mode: the units' scores shared by their rows
        per_unit = bound_unit_scores(queries, hkv, probe_keys, probe_kv_heads, layout, summaries)
        scores = unit_row_scores(per_unit, layout.unit_of, layout.unit_count)
    else:
        scores = probe_scores(queries, new_keys, probe_keys, probe_kv_heads)  # [probed KV heads, P]
    threshold = fixed_threshold if fixed_threshold is not None else similarity_threshold(k, p, alpha)
    similarity = top_jaccard(scores, k)
    ranking = normalised_sum(scores)
    combined = ranking
    forced = kept_rows(p, *keep)
    if forced is not None:
        # above every scored row (a row's score is at most the number of new tokens x heads)
        scores = scores.clone()
        scores[:, forced] += 1e9
        combined = ranking.clone()
        combined[forced] += 1e9

    if similarity >= threshold:
        if mode == "block":
            rows = select_units(combined, layout.unit_of, k)
        else:
            rows = vote(scores.unsqueeze(0), k)[0]
        return load_rows(layout, rows, read_units, similarity, threshold, False, ranking, out=out)

    # the probe heads disagree: every KV head chooses its own rows
    if list(probe_kv_heads) == list(range(hkv)):
        # the probe copy already holds every KV head's keys: their scores are known, read
        # only the union of the heads' choices
        if mode == "block":
            rows = torch.stack([select_units(scores[h], layout.unit_of, k) for h in range(hkv)])
        else:
            rows = topk_indices(scores.unsqueeze(0), k)[0]  # [Hkv, k]
        return load_rows(layout, rows, read_units, similarity, threshold, True, ranking, out=out)
    # read the whole layer to get every KV head's keys
    return _own_rows_from_full(layout, read_units, queries, new_keys, forced, k, similarity, threshold, ranking, out)
