"""Important-KV identification with probe heads (IMPRESS section 1).

This module holds the pure tensor logic of the "identify" step of IMPRESS:

* `attention_column_scores` scores every prefix token with the queries of the
  new tokens (H2O-style column sums of the softmax attention probabilities);
* `topk_indices`, `mean_pairwise_jaccard`, `expected_random_jaccard`
  and `similarity_threshold` decide whether the probe heads agree;
* `vote` (token mode) and `select_units` (block mode: whole units of a stored
  prefix, ranked by summed score) build one shared set of prefix rows;
  `impress_cache.sparse.select_row` combines all of these for one layer, including the
  per-KV-head fallback when the probed heads disagree;
* `choose_probe_heads` picks probe query heads from different KV groups;
* `sparse_prefix_attention_reference` is a slow, exact reference of attention
  restricted to selected prefix rows, used by tests.

Everything here is I/O free and works on CPU or GPU tensors alike.
"""

from __future__ import annotations

import logging
import math
from typing import Optional, Sequence, Union

import torch
from torch import Tensor

logger = logging.getLogger(__name__)

__all__ = [
    "attention_column_scores",
    "choose_probe_heads",
    "expected_random_jaccard",
    "mean_pairwise_jaccard",
    "select_units",
    "similarity_threshold",
    "sparse_prefix_attention_reference",
    "topk_indices",
    "vote",
]

#: Upper bound on the number of float32 logits materialised per query-row chunk by
#: `attention_column_scores` when ``chunk_rows`` is not given (~64 MiB).
DEFAULT_CHUNK_ELEMENTS: int = 1 << 24

_VALID_MODES = ("token", "block")


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

    device = queries.device
    out = torch.zeros(B, Hq, P, dtype=torch.float32, device=device)
    if n == 0 or P == 0:
        return out

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
        logits_p = torch.matmul(qc, kp_t)  # [B, Hk, group * c, P]
        if prefix_bias is not None:
            logits_p = logits_p + prefix_bias
        lse = torch.logsumexp(logits_p, dim=-1)  # [B, Hk, group * c]
        if kn_t is not None:
            # Rows start..stop-1 can only see new keys 0..stop-1.
            logits_n = torch.matmul(qc, kn_t[..., :stop])  # [B, Hk, group * c, stop]
            causal = positions[None, :stop] > positions[start:stop, None]  # [c, stop]
            logits_n = logits_n.masked_fill(causal.repeat(group, 1), neg_inf)
            if newkey_bias is not None:
                logits_n = logits_n + newkey_bias[..., :stop]
            lse = torch.logaddexp(lse, torch.logsumexp(logits_n, dim=-1))
            del logits_n
        # Rows that see no key at all have lse = -inf; make them contribute zero.
        lse = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
        probs = torch.exp(logits_p - lse.unsqueeze(-1))  # [B, Hk, group * c, P]
        if qm is not None:
            w = qm[:, start:stop].to(torch.float32)[:, None, None, :].expand(B, 1, group, c)
            probs = probs * w.reshape(B, 1, group * c, 1)
        out += probs.view(B, Hk, group, c, P).sum(dim=3).view(B, Hq, P)
        del probs, logits_p
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
    order = _rank_descending(_sanitize_scores(scores))
    return torch.sort(order[..., :k], dim=-1).values


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
    member = torch.zeros(B, H, universe, dtype=torch.float64, device=device)
    member.scatter_(-1, idx, 1.0)
    inter = torch.matmul(member, member.transpose(-1, -2))  # [B, H, H]
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
# 5. block selection
# ---------------------------------------------------------------------------






# ---------------------------------------------------------------------------
# 6. per-layer selection
# ---------------------------------------------------------------------------






# ---------------------------------------------------------------------------
# 7. reference sparse attention
# ---------------------------------------------------------------------------




def _selection_for_row(
    selected: Union[Tensor, Sequence[Tensor]], b: int, B: int, H: int
) -> Tensor:
    """Return the selection of batch row ``b`` as ``[k]`` or ``[H, k]`` int64."""
    if isinstance(selected, Tensor):
        if selected.dim() == 1:
            sel = selected
        elif selected.dim() == 2:
            if selected.shape[0] != B:
                raise ValueError(f"selected [B, k] must have B={B} rows, got {selected.shape[0]}")
            sel = selected[b]
        elif selected.dim() == 3:
            if selected.shape[0] != B or selected.shape[1] != H:
                raise ValueError(
                    f"selected [B, H, k] must have B={B}, H={H}, got {tuple(selected.shape)}"
                )
            sel = selected[b]
        else:
            raise ValueError(f"selected tensor must be 1-D, 2-D or 3-D, got {selected.dim()}-D")
    else:
        if len(selected) != B:
            raise ValueError(f"selected list must have B={B} entries, got {len(selected)}")
        sel = torch.as_tensor(selected[b])
        if sel.dim() not in (1, 2):
            raise ValueError("each entry of selected must be [k] or [H, k]")
        if sel.dim() == 2 and sel.shape[0] != H:
            raise ValueError(f"per-head selection must have H={H} rows, got {sel.shape[0]}")
    return sel.to(torch.int64)


def sparse_prefix_attention_reference(
    query: Tensor,
    prefix_keys: Tensor,
    prefix_values: Tensor,
    new_keys: Optional[Tensor],
    new_values: Optional[Tensor],
    selected: Union[Tensor, Sequence[Tensor]],
    scaling: Optional[float] = None,
) -> Tensor:
    """Exact attention of the new tokens over selected prefix rows plus new tokens.

    Query ``i`` attends to ``prefix_keys[..., selected, :]`` and, causally, to new keys
    ``0..i``.  Slow and simple; intended as a test oracle.  Computation happens in the
    dtype of ``query`` (use float64 for tight comparisons).

    Parameters
    ----------
    query : Tensor
        ``[B, H, n, D]`` queries of the new tokens.
    prefix_keys, prefix_values : Tensor
        ``[B, H, P, D]`` prefix keys and values (already expanded to ``H`` heads).
    new_keys, new_values : Tensor or None
        ``[B, H, n, D]`` keys and values of the new tokens, or both ``None``.
    selected : Tensor or sequence of Tensor
        Selected prefix rows (unique indices): a 1-D tensor shared by all batch rows
        and heads; a ``[B, k]`` tensor (per batch row); a ``[B, H, k]`` tensor (per
        head, as in `per_head_indices`); or a list of ``B``
        tensors each ``[k_b]`` or ``[H, k_b]`` (as in `indices`).
    scaling : float, optional
        Logit scale, default ``1 / sqrt(D)``.

    Returns
    -------
    Tensor
        ``[B, H, n, D]`` attention output.

    Raises
    ------
    ValueError
        On inconsistent shapes, out-of-range indices, or a query row that would see
        no key at all.
    """
    if query.dim() != 4:
        raise ValueError(f"query must be [B, H, n, D], got {tuple(query.shape)}")
    B, H, n, D = query.shape
    if prefix_keys.dim() != 4 or prefix_keys.shape[:2] != (B, H) or prefix_keys.shape[3] != D:
        raise ValueError(
            f"prefix_keys must be [B={B}, H={H}, P, D={D}], got {tuple(prefix_keys.shape)}"
        )
    P = prefix_keys.shape[2]
    if prefix_values.dim() != 4 or prefix_values.shape[:3] != prefix_keys.shape[:3]:
        raise ValueError("prefix_values must match prefix_keys in [B, H, P]")
    if (new_keys is None) != (new_values is None):
        raise ValueError("new_keys and new_values must both be given or both be None")
    if new_keys is not None:
        assert new_values is not None
        if tuple(new_keys.shape) != (B, H, n, D):
            raise ValueError(f"new_keys must be {(B, H, n, D)}, got {tuple(new_keys.shape)}")
        dv = prefix_values.shape[3]
        if tuple(new_values.shape[:3]) != (B, H, n) or new_values.shape[3] != dv:
            raise ValueError("new_values must be [B, H, n, Dv] with Dv matching prefix_values")
    if scaling is None:
        scaling = 1.0 / math.sqrt(D) if D > 0 else 1.0
    dtype = query.dtype

    causal = None
    if new_keys is not None:
        pos = torch.arange(n, device=query.device)
        causal = pos[None, :] > pos[:, None]  # [n, n] True = hidden

    outs = []
    for b in range(B):
        sel = _selection_for_row(selected, b, B, H).to(query.device)
        if sel.numel() and (sel.min() < 0 or sel.max() >= P):
            raise ValueError(f"selected indices must lie in [0, P={P})")
        if sel.dim() == 1:
            k_sel = prefix_keys[b][:, sel, :]
            v_sel = prefix_values[b][:, sel, :]
        else:
            k_sel = torch.gather(prefix_keys[b], 1, sel[:, :, None].expand(-1, -1, D))
            v_sel = torch.gather(
                prefix_values[b], 1, sel[:, :, None].expand(-1, -1, prefix_values.shape[3])
            )
        q = query[b]
        logits = [torch.matmul(q, k_sel.to(dtype).transpose(-1, -2)) * scaling]
        values = [v_sel.to(dtype)]
        if new_keys is not None and new_values is not None and causal is not None:
            ln = torch.matmul(q, new_keys[b].to(dtype).transpose(-1, -2)) * scaling
            logits.append(ln.masked_fill(causal, float("-inf")))
            values.append(new_values[b].to(dtype))
        all_logits = torch.cat(logits, dim=-1)
        if all_logits.shape[-1] == 0 and n > 0:
            raise ValueError("no key to attend to: empty selection and no new tokens")
        probs = torch.softmax(all_logits, dim=-1)
        outs.append(torch.matmul(probs, torch.cat(values, dim=1)))
    return torch.stack(outs, dim=0)


# ---------------------------------------------------------------------------
# 8. probe heads
# ---------------------------------------------------------------------------


def choose_probe_heads(
    num_attention_heads: int, num_key_value_heads: int, probe_heads: int = 3
) -> list[int]:
    """Pick probe query heads spread over different KV groups.

    With grouped-query attention, query head ``h`` belongs to KV group
    ``h // (num_attention_heads // num_key_value_heads)``.  Probes are taken from
    distinct KV groups: the first query head of each of the first ``probe_heads``
    groups when ``probe_heads <= num_key_value_heads`` (e.g. 9 query / 3 KV heads /
    3 probes gives ``[0, 3, 6]``; multi-head attention gives the paper's ``[0, 1, 2]``).
    If more probes than KV groups are asked for, selection continues round-robin with
    the next query head inside each group.

    Parameters
    ----------
    num_attention_heads : int
        Number of query heads, ``>= 1``.
    num_key_value_heads : int
        Number of KV heads, ``>= 1``, dividing ``num_attention_heads``.
    probe_heads : int, default 3
        Number of probes, ``1 <= probe_heads <= num_attention_heads``.

    Returns
    -------
    list of int
        Sorted distinct query-head indices.

    Raises
    ------
    ValueError
        On out-of-range or inconsistent arguments.
    """
    for name, val in (
        ("num_attention_heads", num_attention_heads),
        ("num_key_value_heads", num_key_value_heads),
        ("probe_heads", probe_heads),
    ):
        if isinstance(val, bool) or not isinstance(val, int):
            raise ValueError(f"{name} must be an int, got {val!r}")
        if val < 1:
            raise ValueError(f"{name} must be >= 1, got {val}")
    if num_key_value_heads > num_attention_heads or num_attention_heads % num_key_value_heads:
        raise ValueError(
            f"num_attention_heads={num_attention_heads} must be a multiple of "
            f"num_key_value_heads={num_key_value_heads}"
        )
    if probe_heads > num_attention_heads:
        raise ValueError(
            f"probe_heads={probe_heads} exceeds num_attention_heads={num_attention_heads}"
        )
    group = num_attention_heads // num_key_value_heads
    full_rounds, rem = divmod(probe_heads, num_key_value_heads)
    heads = [g * group + r for r in range(full_rounds) for g in range(num_key_value_heads)]
    # The last, partial round uses the first KV groups (for multi-head attention this
    # gives the paper's "first heads of the layer").
    heads.extend(g * group + full_rounds for g in range(rem))
    return sorted(heads)


# ---------------------------------------------------------------------------
# 9. selection over irregular blocks (units of a stored prefix)
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
    s = torch.nan_to_num(scores.to(torch.float64), nan=0.0)
    n_units = int(unit_of.max()) + 1
    sums = torch.zeros(n_units, dtype=torch.float64, device=s.device).scatter_add_(0, unit_of, s)
    sizes = torch.bincount(unit_of, minlength=n_units)
    order = _rank_descending(sums)
    covered = torch.cumsum(sizes[order], dim=0)
    n_take = int((covered < k).sum()) + 1
    chosen = torch.zeros(n_units, dtype=torch.bool, device=s.device)
    chosen[order[:n_take]] = True
    rows = torch.nonzero(chosen[unit_of]).squeeze(1)
    if rows.numel() > k:
        keep = _rank_descending(s[rows])[:k]
        rows = rows[keep]
    return torch.sort(rows).values
