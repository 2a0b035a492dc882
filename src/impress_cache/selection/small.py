"""The selection's bookkeeping on short vectors, in numpy.

Choosing whole units and measuring the probe heads' agreement work on vectors of a few
hundred to a few thousand numbers (one per unit or per prefix row). There a torch
operation's fixed cost on the CPU (about 5-10 us) is most of its time, and a layer's
selection runs a few dozen of them; numpy's fixed cost is a fraction of that. Each
function here gives exactly the result of the torch code it replaced (the same rows, the
same ties broken the same way; ``tests/selection/test_small.py`` checks them against
those references):

* `rank_descending`: a stable descending sort's permutation (``torch.sort(...,
  descending=True, stable=True).indices``);
* `units_taken`: the best whole units by unit score until ``k`` rows are covered;
* `select_units_host`: the same by the summed scores of the units' rows;
* `top_jaccard`: the probe heads' agreement, the mean Jaccard similarity of their top-``k``
  sets.

Inputs may live on any device: they are brought to the host (a no-op on the CPU, one
small copy from an accelerator); the rows come back as CPU tensors.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

__all__ = ["host", "rank_descending", "select_units_host", "top_jaccard", "top_mask", "units_taken"]


def host(t: Tensor) -> np.ndarray:
    """``t`` as a numpy array (shared memory on the CPU)."""
    return t.detach().cpu().numpy()


def rank_descending(values: np.ndarray) -> np.ndarray:
    """Indices of the last axis by descending value, ties lower index first (``values``
    without NaN: negation keeps every other value's order, ``-0.0`` ties ``0.0``)."""
    return np.argsort(-values, axis=-1, kind="stable")


def _finite_f64(scores: Tensor) -> np.ndarray:
    """float64 scores with NaN as 0 and infinities as the largest finite values
    (``torch.nan_to_num(scores.double(), nan=0.0)``)."""
    return np.nan_to_num(host(scores.to(torch.float64)), nan=0.0)


def units_taken(scores: Tensor, unit_of: Tensor, unit_count: Tensor, k: int) -> tuple[Tensor, list[int]]:
    """See `selection.bounds.units_taken` (the documented contract)."""
    s = _finite_f64(scores)
    count = host(unit_count)
    uo = host(unit_of)
    order = rank_descending(s)
    covered = np.cumsum(count[order])
    n_take = min(int(np.count_nonzero(covered < k)) + 1, order.size)
    chosen = np.zeros(s.shape[0], dtype=bool)
    chosen[order[:n_take]] = True
    rows = np.flatnonzero(chosen[uo])
    if rows.size > k:
        per_row = (s / np.maximum(count, 1))[uo[rows]]
        rows = np.sort(rows[rank_descending(per_row)[:k]])
        units = np.unique(uo[rows])  # (a unit may have lost all its rows)
    else:
        units = np.flatnonzero(chosen & (count > 0))
    return torch.from_numpy(rows.astype(np.int64, copy=False)), units.tolist()


def select_units_host(scores: Tensor, unit_of: Tensor, k: int) -> Tensor:
    """See `selection.scores.select_units` (arguments checked there)."""
    s = _finite_f64(scores)
    uo = host(unit_of)
    n_units = int(uo.max()) + 1
    sums = np.bincount(uo, weights=s, minlength=n_units)  # summed in row order, as scatter_add
    sizes = np.bincount(uo, minlength=n_units)
    order = rank_descending(sums)
    covered = np.cumsum(sizes[order])
    n_take = int(np.count_nonzero(covered < k)) + 1
    chosen = np.zeros(n_units, dtype=bool)
    chosen[order[:n_take]] = True
    rows = np.flatnonzero(chosen[uo])
    if rows.size > k:
        rows = rows[rank_descending(s[rows])[:k]]
    return torch.from_numpy(np.sort(rows).astype(np.int64, copy=False))


def top_mask(s: np.ndarray, k: int) -> np.ndarray:
    """Bool mask of the ``k`` highest of each row of ``[H, P]`` ``s`` without NaN, ties
    lower index first (the first ``k`` of a stable descending sort), without sorting."""
    p = s.shape[-1]
    kth = np.partition(s, p - k, axis=-1)[:, p - k : p - k + 1]  # the k-th highest
    above = s > kth
    ties = s == kth
    fill = k - np.count_nonzero(above, axis=-1)[:, None]
    return above | (ties & (np.cumsum(ties, axis=-1) <= fill))


def top_jaccard(scores: Tensor, k: int) -> float:
    """See `selection.scores.top_jaccard` (``[H, P]`` scores, ``H >= 2``, ``k`` checked
    there): the same float (NaN ranks lowest, as `scores._sanitize_scores` has it)."""
    s = host(scores)
    if s.dtype.kind != "f":
        s = s.astype(np.float32)
    if np.isnan(s).any():  # below everything: infinities become the largest finite values
        s = np.nan_to_num(s, nan=-np.inf)
    member = top_mask(s, k)
    h = s.shape[0]
    # counted pair by pair (a product would go through numpy's BLAS and its threads)
    inter = [int(np.count_nonzero(member[a] & member[b])) for a in range(h) for b in range(a + 1, h)]
    if len(inter) > 10:  # the reference's float64 mean, whose order of additions is torch's
        pair = torch.tensor(inter, dtype=torch.float64)
        return float((pair / (2 * k - pair)).mean().to(torch.float32))
    total = 0.0
    for x in inter:  # every set has k members: |A | B| = 2k - |A & B|
        total += x / (2 * k - x)  # (torch adds so few float64 numbers in order, too)
    return float(np.float32(total / len(inter)))
