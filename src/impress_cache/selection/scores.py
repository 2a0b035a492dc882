"""Important-KV identification with probe heads (IMPRESS section 1).

This module holds the pure tensor logic of the "identify" step of IMPRESS:

* `attention_column_scores` scores every prefix token with the queries of the
  new tokens (H2O-style column sums of the softmax attention probabilities);
* `topk_indices`, `mean_pairwise_jaccard`, `expected_random_jaccard`
  and `similarity_threshold` decide whether the probe heads agree;
* `vote` (token mode) and `select_units` (block mode: whole units of a stored
  prefix, ranked by summed score) build one shared set of prefix rows.

`selectors.select_row` combines these for one layer, including the per-KV-head fallback
when the probed heads disagree. Everything here is I/O free and works on CPU or GPU
tensors alike.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from . import small

__all__ = [
    "attention_column_scores",
    "expected_random_jaccard",
    "mean_pairwise_jaccard",
    "select_units",
    "similarity_threshold",
    "top_jaccard",
    "topk_indices",
    "vote",
]

#: Upper bound on the number of float32 logits materialised per query-row chunk by
#: `attention_column_scores` when ``chunk_rows`` is not given (~64 MiB).
DEFAULT_CHUNK_ELEMENTS: int = 1 << 24



# ---------------------------------------------------------------------------
# small private helpers
# ---------------------------------------------------------------------------


def _check_k(k: int, P: int, what: str = "k") -> None:
    """Validate ``1 <= k <= P`` for an integer ``k``."""
    if isinstance(k, bool) or not isinstance(k, int):
        raise ValueError(f"{what} must be an int, got {type(k).__name__}")
    if k < 1:
        raise ValueError(f"{what} must be >= 1, got {k}")
    if k > P:
        raise ValueError(f"{what}={k} exceeds the number of prefix tokens P={P}")


def _rank_descending(primary: Tensor, secondary: Optional[Tensor] = None) -> Tensor:
    """Return the permutation ranking the last dim by descending keys.

    Order is: ``primary`` descending, then ``secondary`` descending (if given), then
    lower index first.  Implemented with two stable sorts, which is exact (no mixing
    of keys into one float) and deterministic.
    """
    if secondary is None:
        return torch.sort(primary, dim=-1, descending=True, stable=True).indices
    # Sort by the least significant key first, then stably by the more significant one.
    order = torch.sort(secondary, dim=-1, descending=True, stable=True).indices
    prim_in_order = torch.gather(primary, -1, order)
    order2 = torch.sort(prim_in_order, dim=-1, descending=True, stable=True).indices
    return torch.gather(order, -1, order2)


def _sanitize_scores(scores: Tensor) -> Tensor:
    """Return float scores where NaN is replaced by ``-inf`` (never preferred)."""
    if not scores.is_floating_point():
        scores = scores.to(torch.float32)
    if torch.isnan(scores).any():
        scores = torch.nan_to_num(scores, nan=float("-inf"))
    return scores


def _normalise_heads(scores: Tensor) -> Tensor:
    """Divide each head's scores by the sum of their absolute values.

    Heads whose scores sum to zero are mapped to all zeros (no division by zero).
    For the non-negative attention scores of this module, the absolute sum is the
    plain sum.
    """
    s = scores.to(torch.float64)
    s = torch.nan_to_num(s, nan=0.0, posinf=0.0, neginf=0.0)
    denom = s.abs().sum(dim=-1, keepdim=True)
    safe = torch.where(denom > 0, denom, torch.ones_like(denom))
    return torch.where(denom > 0, s / safe, torch.zeros_like(s))


# ---------------------------------------------------------------------------
# 1. attention column scores
# ---------------------------------------------------------------------------


def attention_column_scores(
    queries: Tensor,
    prefix_keys: Tensor,
    new_keys: Optional[Tensor] = None,
    scaling: Optional[float] = None,
    *,
    query_mask: Optional[Tensor] = None,
    prefix_mask: Optional[Tensor] = None,
    chunk_rows: Optional[int] = None,
) -> Tensor:
    """H2O-style importance of every prefix token, per query head.

    For each query row ``i`` of the new tokens, the real attention distribution is a
    softmax over all ``P`` prefix keys and the new keys ``0..i`` (causal).  The score of
    prefix token ``p`` is the sum over all valid query rows of the probability mass
    that row puts on ``p``.

    Parameters
    ----------
    queries : Tensor
        ``[B, Hq, n, D]`` post-RoPE queries of the ``n`` new tokens.
    prefix_keys : Tensor
        ``[B, Hk, P, D]`` post-RoPE keys of the stored prefix.  Normally ``Hk == Hq``
        (the caller already picked the KV head of each query head).  As a convenience
        ``Hq`` may also be a multiple of ``Hk``; query head ``h`` then uses KV head
        ``h // (Hq // Hk)`` (the Hugging Face grouped-query convention).
    new_keys : Tensor, optional
        ``[B, Hk, n, D]`` keys of the new tokens.  Query ``i`` attends to new keys
        ``0..i``.  If omitted, the softmax is over the prefix keys only.
    scaling : float, optional
        Logit scale, default ``1 / sqrt(D)``.
    query_mask : Tensor, optional
        ``[B, n]`` bool, ``False`` marks a padding new token.  Its query row is
        excluded from the sums *and* its key (if ``new_keys`` is given) is masked out
        for the other rows, as a padding token is neither a query nor a key.
    prefix_mask : Tensor, optional
        ``[B, P]`` bool, ``False`` marks a padding prefix column: it gets zero
        probability (and thus a zero score).
    chunk_rows : int, optional
        Number of query rows processed at once.  By default it is chosen so that at
        most about `DEFAULT_CHUNK_ELEMENTS` logits exist at a time.

    Returns
    -------
    Tensor
        ``[B, Hq, P]`` float32 column sums.  Each valid query row contributes at most
        1 in total (less when it also attends to new tokens).  A row with no visible
        key at all contributes nothing.

    Raises
    ------
    ValueError
        On inconsistent shapes or invalid arguments.
    """
    if queries.dim() != 4 or prefix_keys.dim() != 4:
        raise ValueError(
            "queries and prefix_keys must be 4-D [B, H, T, D], got "
            f"{tuple(queries.shape)} and {tuple(prefix_keys.shape)}"
        )
    B, Hq, n, D = queries.shape
    Bk, Hk, P, Dk = prefix_keys.shape
    if Bk != B or Dk != D:
        raise ValueError(
            f"prefix_keys {tuple(prefix_keys.shape)} does not match queries "
            f"{tuple(queries.shape)} in batch or head_dim"
        )
    if Hk < 1 or Hq % Hk != 0:
        raise ValueError(f"query heads Hq={Hq} must be a multiple of key heads Hk={Hk}")
    if new_keys is not None and tuple(new_keys.shape) != (B, Hk, n, D):
        raise ValueError(
            f"new_keys must have shape {(B, Hk, n, D)}, got {tuple(new_keys.shape)}"
        )
    if query_mask is not None and tuple(query_mask.shape) != (B, n):
        raise ValueError(f"query_mask must have shape {(B, n)}, got {tuple(query_mask.shape)}")
    if prefix_mask is not None and tuple(prefix_mask.shape) != (B, P):
        raise ValueError(
            f"prefix_mask must have shape {(B, P)}, got {tuple(prefix_mask.shape)}"
        )
    if chunk_rows is not None and chunk_rows < 1:
        raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
    if scaling is None:
        scaling = 1.0 / math.sqrt(D) if D > 0 else 1.0
    return column_sums(queries, prefix_keys, new_keys, scaling, query_mask, prefix_mask, chunk_rows)


def column_sums(
    queries: Tensor,
    prefix_keys: Tensor,
    new_keys: Optional[Tensor],
    scaling: Optional[float] = None,
    query_mask: Optional[Tensor] = None,
    prefix_mask: Optional[Tensor] = None,
    chunk_rows: Optional[int] = None,
) -> Tensor:
    """`attention_column_scores` without checking its arguments: the per-layer hot path of
    a sparse prefill calls this with shapes it built itself."""
    B, Hq, n, D = queries.shape
    Hk, P = prefix_keys.shape[1], prefix_keys.shape[2]
    if scaling is None:
        scaling = 1.0 / math.sqrt(D) if D > 0 else 1.0
    device = queries.device
    if n == 0 or P == 0:
        return torch.zeros(B, Hq, P, dtype=torch.float32, device=device)
    out: Optional[Tensor] = None

    group = Hq // Hk
    # Grouped-query attention without copying keys: the query heads of one KV group are
    # stacked as extra rows ([B, Hk, group * rows, D]) against that group's keys. The
    # scale is folded into the (few) queries instead of the (many) keys.
    qg = (queries.to(torch.float32) * scaling).view(B, Hk, group, n, D)
    kp_t = prefix_keys.to(torch.float32).transpose(-1, -2)  # [B, Hk, D, P]
    kn_t = new_keys.to(torch.float32).transpose(-1, -2) if new_keys is not None else None  # [B, Hk, D, n]

    neg_inf = float("-inf")
    prefix_bias: Optional[Tensor] = None
    if prefix_mask is not None:
        pm = prefix_mask.to(device=device, dtype=torch.bool)
        prefix_bias = torch.zeros(B, 1, 1, P, dtype=torch.float32, device=device)
        prefix_bias.masked_fill_(~pm[:, None, None, :], neg_inf)
    qm: Optional[Tensor] = None
    newkey_bias: Optional[Tensor] = None
    if query_mask is not None:
        qm = query_mask.to(device=device, dtype=torch.bool)
        if kn_t is not None:
            newkey_bias = torch.zeros(B, 1, 1, n, dtype=torch.float32, device=device)
            newkey_bias.masked_fill_(~qm[:, None, None, :], neg_inf)

    if chunk_rows is None:
        per_row = max(1, B * Hq * (P + (n if kn_t is not None else 0)))
        chunk_rows = max(1, DEFAULT_CHUNK_ELEMENTS // per_row)
    chunk_rows = min(chunk_rows, n)

    positions = torch.arange(n, device=device)
    for start in range(0, n, chunk_rows):
        stop = min(start + chunk_rows, n)
        c = stop - start
        qc = qg[:, :, :, start:stop, :].reshape(B, Hk, group * c, D)  # rows: (head in group, position)
        e = torch.matmul(qc, kp_t)  # logits [B, Hk, group * c, P], exponentiated in place below
        if prefix_bias is not None:
            e += prefix_bias
        # one pass of exp over the big matrix: e = exp(logits - m) with m the row maximum
        m = e.amax(dim=-1, keepdim=True)
        m = torch.where(torch.isinf(m), torch.zeros_like(m), m)  # rows with no visible prefix key
        e.sub_(m).exp_()
        lse = m.squeeze(-1) + torch.log(e.sum(dim=-1))  # [B, Hk, group * c]
        if kn_t is not None:
            # Rows start..stop-1 can only see new keys 0..stop-1.
            logits_n = torch.matmul(qc, kn_t[..., :stop])  # [B, Hk, group * c, stop]
            causal = positions[None, :stop] > positions[start:stop, None]  # [c, stop]
            logits_n = logits_n.masked_fill(causal.repeat(group, 1), neg_inf)
            if newkey_bias is not None:
                logits_n = logits_n + newkey_bias[..., :stop]
            lse = torch.logaddexp(lse, torch.logsumexp(logits_n, dim=-1))
            del logits_n
        # probability of a prefix key = e * exp(m - lse) per row; rows that see no key at
        # all (lse = -inf) contribute zero
        w = torch.where(torch.isinf(lse), torch.zeros_like(lse), torch.exp(m.squeeze(-1) - lse))
        if qm is not None:
            w = w * qm[:, start:stop].to(torch.float32)[:, None, None, :].expand(B, 1, group, c).reshape(B, 1, group * c)
        # column sums per query head: a [1, c] x [c, P] product per (batch, KV head, head in group)
        part = torch.matmul(w.view(B, Hk, group, 1, c), e.view(B, Hk, group, c, P)).view(B, Hq, P)
        out = part if out is None else out.add_(part)
        del e
    assert out is not None
    return out


# ---------------------------------------------------------------------------
# 2. top-k
# ---------------------------------------------------------------------------


def topk_indices(scores: Tensor, k: int) -> Tensor:
    """Indices of the ``k`` highest scores along the last dimension.

    Parameters
    ----------
    scores : Tensor
        ``[..., P]`` scores, typically ``[B, H, P]``.  NaN counts as ``-inf``.
    k : int
        Number of indices to keep, ``1 <= k <= P``.

    Returns
    -------
    Tensor
        ``[..., k]`` int64 indices, sorted ascending.  Ties are broken by the lower
        index, so the result is deterministic.

    Raises
    ------
    ValueError
        If ``scores`` has no dimension or ``k`` is out of range.
    """
    if scores.dim() < 1:
        raise ValueError("scores must have at least one dimension")
    _check_k(k, scores.shape[-1])
    s = _sanitize_scores(scores)
    # the k-th largest value splits the rows: everything above it is in, and of the
    # values equal to it the ones with the lowest indices fill up to k (the order a
    # stable descending sort gives), without sorting all P values
    keep = _top_mask(s, k)
    return torch.nonzero(keep.reshape(-1, s.shape[-1]))[:, 1].reshape(*s.shape[:-1], k)


def _top_mask(s: Tensor, k: int) -> Tensor:
    """Bool mask of the ``k`` highest of each row of sanitised ``s`` (ties: lower index)."""
    kth = torch.topk(s, k, dim=-1, sorted=False).values.amin(dim=-1, keepdim=True)
    above = s > kth
    ties = s == kth
    fill = k - above.sum(dim=-1, keepdim=True)
    return above | (ties & (torch.cumsum(ties.to(torch.int32), dim=-1) <= fill))


def top_jaccard(scores: Tensor, k: int) -> float:
    """Mean pairwise Jaccard similarity of the rows' top ``k`` of ``[H, P]`` scores:
    ``float(mean_pairwise_jaccard(topk_indices(scores[None], k))[0])`` without building
    the index sets (the sets are ``k``-of-``P`` masks; ``1.0`` for one row)."""
    h, p = scores.shape
    if h <= 1:
        return 1.0
    _check_k(k, p)
    return small.top_jaccard(scores, k)  # on the host: a few cheap numpy operations


# ---------------------------------------------------------------------------
# 3. similarity and threshold
# ---------------------------------------------------------------------------


def expected_random_jaccard(k: int, P: int) -> float:
    """Expected Jaccard similarity of two random ``k``-of-``P`` index sets.

    Uses the paper's formula ``j = r / (2 - r)`` with ``r = k / P`` (ratio of the
    expected intersection ``k^2/P`` to the expected union ``2k - k^2/P``).

    Parameters
    ----------
    k : int
        Set size, ``0 <= k <= P``.
    P : int
        Universe size, ``P >= 1``.

    Returns
    -------
    float
        The expected Jaccard ``j`` in ``[0, 1]``.

    Raises
    ------
    ValueError
        If ``P < 1`` or ``k`` is outside ``[0, P]``.
    """
    if P < 1:
        raise ValueError(f"P must be >= 1, got {P}")
    if k < 0 or k > P:
        raise ValueError(f"k must be in [0, P={P}], got {k}")
    r = k / P
    return r / (2.0 - r)


def similarity_threshold(k: int, P: int, alpha: float = 0.6) -> float:
    """Similarity threshold ``t = j ** alpha`` of IMPRESS.

    Parameters
    ----------
    k : int
        Number of selected tokens per head.
    P : int
        Number of prefix tokens.
    alpha : float, default 0.6
        Exponent, ``alpha > 0``; smaller values give a stricter (higher) threshold.

    Returns
    -------
    float
        Threshold in ``[0, 1]``; about 0.517 for ``k / P = 0.5`` and ``alpha = 0.6``.

    Raises
    ------
    ValueError
        If ``alpha <= 0`` or ``k``/``P`` are invalid.
    """
    if not alpha > 0:
        raise ValueError(f"alpha must be > 0, got {alpha}")
    return expected_random_jaccard(k, P) ** alpha


def mean_pairwise_jaccard(index_sets: Tensor) -> Tensor:
    """Mean Jaccard similarity over all head pairs.

    Parameters
    ----------
    index_sets : Tensor
        ``[B, H, k]`` non-negative integer indices; each ``[b, h]`` row is one set
        (duplicates inside a row are counted once).

    Returns
    -------
    Tensor
        ``[B]`` float32, mean of ``|A & B| / |A | B|`` over the ``H (H - 1) / 2``
        pairs of heads.  ``1.0`` when ``H == 1``.  Two empty sets have similarity 1.

    Raises
    ------
    ValueError
        On a wrong rank, non-integer dtype or negative indices.
    """
    if index_sets.dim() != 3:
        raise ValueError(f"index_sets must be [B, H, k], got {tuple(index_sets.shape)}")
    if index_sets.is_floating_point() or index_sets.dtype == torch.bool:
        raise ValueError("index_sets must hold integer indices")
    B, H, k = index_sets.shape
    device = index_sets.device
    if H <= 1 or B == 0:
        return torch.ones(B, dtype=torch.float32, device=device)
    if k == 0:
        return torch.ones(B, dtype=torch.float32, device=device)
    idx = index_sets.to(torch.int64)
    if (idx < 0).any():
        raise ValueError("index_sets must be non-negative")
    universe = int(idx.max().item()) + 1
    return mean_jaccard_of(idx, universe)


def mean_jaccard_of(idx: Tensor, universe: int) -> Tensor:
    """`mean_pairwise_jaccard` of checked ``[B, H, k]`` indices below ``universe``."""
    B, H, _ = idx.shape
    device = idx.device
    # membership counts are exact in float32 (sets far below 2**24 rows)
    member = torch.zeros(B, H, universe, dtype=torch.float32, device=device)
    member.scatter_(-1, idx, 1.0)
    inter = torch.matmul(member, member.transpose(-1, -2)).to(torch.float64)  # [B, H, H]
    sizes = torch.diagonal(inter, dim1=-2, dim2=-1)  # [B, H]
    union = sizes[:, :, None] + sizes[:, None, :] - inter
    jac = torch.where(union > 0, inter / union.clamp_min(1.0), torch.ones_like(inter))
    iu = torch.triu_indices(H, H, offset=1, device=device)
    pair_vals = jac[:, iu[0], iu[1]]  # [B, H(H-1)/2]
    return pair_vals.mean(dim=-1).to(torch.float32)


# ---------------------------------------------------------------------------
# 4. voting
# ---------------------------------------------------------------------------


def vote(scores: Tensor, k: int) -> Tensor:
    """One shared index set per batch row from several probe heads.

    Every head's top-``k`` gives one vote to each of its indices.  The ``k`` indices
    with the most votes are kept; ties are broken by the sum over heads of the
    normalised scores (each head's scores divided by their sum), then by lower index.

    Parameters
    ----------
    scores : Tensor
        ``[B, H, P]`` per-head importance scores (expected non-negative; heads are
        normalised by the sum of absolute values, a head summing to 0 adds nothing to
        the tie-break).
    k : int
        Number of indices to select, ``1 <= k <= P``.

    Returns
    -------
    Tensor
        ``[B, k]`` int64 indices sorted ascending.

    Raises
    ------
    ValueError
        On a wrong rank or an invalid ``k``.
    """
    if scores.dim() != 3:
        raise ValueError(f"scores must be [B, H, P], got {tuple(scores.shape)}")
    B, H, P = scores.shape
    if H < 1:
        raise ValueError("scores must contain at least one head")
    _check_k(k, P)
    per_head = topk_indices(scores, k)  # [B, H, k]
    votes = torch.zeros(B, P, dtype=torch.int64, device=scores.device)
    flat = per_head.reshape(B, H * k)
    votes.scatter_add_(-1, flat, torch.ones_like(flat))
    tie = _normalise_heads(scores).sum(dim=1)  # [B, P] float64
    order = _rank_descending(votes, tie)
    return torch.sort(order[:, :k], dim=-1).values


# ---------------------------------------------------------------------------
# 5. selection over irregular blocks (units of a stored prefix)
# ---------------------------------------------------------------------------


def select_units(scores: Tensor, unit_of: Tensor, k: int) -> Tensor:
    """Whole-unit selection for prefixes whose blocks have different sizes.

    A stored prefix is split into *units* (the part of one disk block it covers; units
    at radix-node boundaries can be short). Units are ranked by the sum of their rows'
    scores (ties: lower unit id first) and taken until at least ``k`` rows are covered;
    of those rows the ``k`` with the highest scores are returned, so at most one
    unit's worth of rows is read but not used.

    Parameters
    ----------
    scores : Tensor
        ``[P]`` per-row scores (e.g. summed normalised probe-head scores).
    unit_of : Tensor
        ``[P]`` int64 unit id of every row, ids in ``[0, n_units)``.
    k : int
        Rows to return, ``1 <= k <= P``.

    Returns
    -------
    Tensor
        ``[k]`` int64 row indices sorted ascending.
    """
    if scores.dim() != 1 or unit_of.shape != scores.shape:
        raise ValueError(f"scores and unit_of must be 1-D of equal length, got {tuple(scores.shape)}, {tuple(unit_of.shape)}")
    P = scores.shape[0]
    _check_k(k, P)
    return small.select_units_host(scores, unit_of, k)
