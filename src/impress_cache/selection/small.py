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
* `top_intersections`: the sizes of the pairwise intersections of the rows' top-``k`` sets.

Inputs may live on any device: they are brought to the host (a no-op on the CPU, one
small copy from an accelerator); the rows come back as CPU tensors.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

__all__ = ["host", "rank_descending", "select_units_host", "top_intersections", "units_taken"]


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


def top_intersections(scores: Tensor, k: int) -> Tensor:
    """float64 ``|A & B|`` of the top-``k`` sets (ties: lower index) of every pair of rows
    ``a < b`` of ``[H, P]`` scores without NaN, in the order ``(0, 1), (0, 2), ...``."""
    s = host(scores)
    h, p = s.shape
    top = rank_descending(s)[:, :k]
    member = np.zeros((h, p), dtype=np.float32)
    np.put_along_axis(member, top, 1.0, axis=1)
    inter = member @ member.T  # exact counts in float32
    a, b = np.triu_indices(h, 1)
    return torch.from_numpy(inter[a, b].astype(np.float64))
