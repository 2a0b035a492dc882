"""Block-level scoring by per-channel key bounds (Quest-style).

Scoring every prefix row with every probed query head costs about what the layer's
attention costs. A block of rows can instead be scored by an upper bound of what any of
its keys can give a query: with ``lo`` and ``hi`` the per-channel minimum and maximum of
the block's keys,

    q . k  <=  sum_c max(q_c * lo_c, q_c * hi_c)  =  q+ . hi  +  q- . lo

for every key ``k`` of the block (``q+ = max(q, 0)``, ``q- = min(q, 0)``): one small
product of ``[q+, q-]`` against ``[hi; lo]`` (`BlockSummaries.stacked`) over ``P /
chunk_tokens`` summaries instead of one against ``P`` rows.

* `block_summaries` computes the ``lo``/``hi`` summaries of a layer's probe keys, per unit
  (the part of one stored block a prefix covers; see `store.layout`);
* `bound_logits` gives the bounds themselves;
* `unit_scores` turns them into one score per probed KV head and unit, in the spirit of
  the row scores (per query head and new token a softmax over the units, summed);
* `unit_row_scores` spreads unit scores over the unit's rows, so that the rest of the
  selection (agreement, block or token sets) works on them unchanged.

Pure tensor code, no I/O.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

import torch
from torch import Tensor

from . import small

__all__ = [
    "BlockSummaries", "block_summaries", "bound_logits", "take_units", "units_taken", "unit_row_scores", "unit_scores",
]


@dataclass(frozen=True)
class BlockSummaries:
    """Per-channel key bounds of the units of one layer, per probed KV head."""

    #: ``[H, U, D]`` per-channel minimum of the unit's keys (0 for an empty unit)
    lo: Tensor
    #: ``[H, U, D]`` per-channel maximum (0 for an empty unit)
    hi: Tensor
    #: ``[U]`` bool: the unit holds at least one position of the layer
    present: Tensor

    @cached_property
    def stacked(self) -> Tensor:
        """``[H, 2 D, U]``: ``hi`` over ``lo`` along the channels, transposed, so that one
        batched product with ``[q+, q-]`` gives the bounds (`unit_scores`); made once per
        layer (the probe loader makes it off the layers' path)."""
        return torch.cat([self.hi, self.lo], dim=-1).transpose(-1, -2).contiguous()

    @cached_property
    def all_present(self) -> bool:
        """Every unit holds a position of the layer (no logit to mask)."""
        return bool(self.present.all())


def block_summaries(keys: Tensor, table: Tensor, present: Tensor) -> BlockSummaries:
    """Bounds of ``[H, P, D]`` keys over the units of ``table`` (``[U, S]`` positions of
    every unit, ``present``: ``[U]`` bool; `LayerView.unit_table`)."""
    h, p, d = keys.shape
    u, s = table.shape
    if p == 0:
        zeros = keys.new_zeros(h, u, d, dtype=torch.float32)
        return BlockSummaries(zeros, zeros, present)
    flat = table.reshape(-1)
    if flat.numel() == p and bool(torch.equal(flat, torch.arange(p))):
        grouped = keys.float().view(h, u, s, d)  # whole blocks in prompt order: no copy
    else:
        grouped = keys.float().index_select(1, flat).view(h, u, s, d)
    lo, hi = grouped.amin(dim=2), grouped.amax(dim=2)  # (torch.aminmax over a middle dim is far slower)
    if not bool(present.all()):
        lo = lo * present[None, :, None]
        hi = hi * present[None, :, None]
    return BlockSummaries(lo.contiguous(), hi.contiguous(), present)


def bound_logits(queries: Tensor, lo: Tensor, hi: Tensor) -> Tensor:
    """``[..., n, U]`` upper bounds of ``q . k`` over each unit's keys, for ``[..., n, D]``
    queries and ``[..., U, D]`` bounds (broadcast over the leading dimensions)."""
    q = queries.float()
    return torch.matmul(q.clamp(min=0), hi.transpose(-1, -2)) + torch.matmul(q.clamp(max=0), lo.transpose(-1, -2))


def unit_scores(queries: Tensor, summaries: BlockSummaries, scaling: float | None = None) -> Tensor:
    """``[H, U]`` scores of the units for the probed KV heads.

    ``queries`` are ``[H * group, n, D]``: the query heads of the probed KV groups, in
    group order. Per query head and new token, the scaled bounds go through a softmax
    over the present units (as a row's attention probability does over the rows); the
    probabilities are summed over the new tokens and the query heads of each group."""
    hq, n, d = queries.shape
    h, u, _ = summaries.lo.shape
    group = hq // h
    if scaling is None:
        scaling = 1.0 / math.sqrt(d) if d > 0 else 1.0
    q = (queries.float() * scaling).reshape(h, group * n, d)
    pos = q.clamp(min=0)
    # q+ . hi + q- . lo as one product: [q+, q-] against [hi; lo] (`bound_logits`)
    logits = torch.bmm(torch.cat([pos, q - pos], dim=-1), summaries.stacked)  # [H, group * n, U]
    if not summaries.all_present:
        logits = logits.masked_fill(~summaries.present, float("-inf"))
    return torch.softmax(logits, dim=-1).sum(dim=1)


def unit_row_scores(scores: Tensor, unit_of: Tensor, unit_count: Tensor) -> Tensor:
    """``[H, P]``: each unit's score shared evenly among its rows (their sum per unit is
    the unit's score, so ranking units by summed row scores ranks them by ``scores``)."""
    per_row = scores / unit_count.clamp(min=1).to(scores.dtype)
    return per_row[:, unit_of]


def take_units(scores: Tensor, unit_of: Tensor, unit_count: Tensor, k: int) -> Tensor:
    """`units_taken`'s rows only."""
    return units_taken(scores, unit_of, unit_count, k)[0]


def units_taken(scores: Tensor, unit_of: Tensor, unit_count: Tensor, k: int) -> tuple[Tensor, list[int]]:
    """``[k]`` positions (ascending) of the best units by ``[U]`` ``scores``: units taken
    in descending score (ties: lower unit first) until they cover ``k`` positions; when
    the last one overshoots, the rows with the highest shared score (the unit's score over
    its size) are kept, lower positions first on ties. The same rows as
    `scores.select_units` on `unit_row_scores`, from ``U`` scores instead of ``P``.
    Also returns the units (ascending) that hold the rows: the blocks to read."""
    return small.units_taken(scores, unit_of, unit_count, k)
