"""Tests for impress_cache.selection.scores (the maths of probe-head importance selection)."""

from __future__ import annotations

import itertools
import math
from typing import Optional

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from impress_cache.selection.scores import (
    attention_column_scores,
    expected_random_jaccard,
    mean_pairwise_jaccard,
    similarity_threshold,
    top_jaccard,
    topk_indices,
    vote,
)
from impress_cache.store.binding import choose_probe_heads

FAST = settings(max_examples=40, deadline=None)


# ---------------------------------------------------------------------------
# naive float64 oracles
# ---------------------------------------------------------------------------


def _full_softmax(
    q: torch.Tensor,
    kp: torch.Tensor,
    kn: Optional[torch.Tensor],
    scaling: float,
    query_mask: Optional[torch.Tensor],
    prefix_mask: Optional[torch.Tensor],
) -> torch.Tensor:
    """Full [B, H, n, P + n] softmax matrix in float64, rows without keys set to 0."""
    q, kp = q.double(), kp.double()
    B, H, n, _ = q.shape
    P = kp.shape[2]
    logits = [q @ kp.transpose(-1, -2) * scaling]
    mask = [torch.ones(B, 1, n, P, dtype=torch.bool)]
    if prefix_mask is not None:
        mask[0] = mask[0] & prefix_mask[:, None, None, :]
    if kn is not None:
        logits.append(q @ kn.double().transpose(-1, -2) * scaling)
        causal = torch.tril(torch.ones(n, n, dtype=torch.bool))[None, None]
        m = causal.expand(B, 1, n, n)
        if query_mask is not None:
            m = m & query_mask[:, None, None, :]
        mask.append(m)
    logits_t = torch.cat(logits, dim=-1)
    mask_t = torch.cat(mask, dim=-1).expand_as(logits_t)
    logits_t = logits_t.masked_fill(~mask_t, float("-inf"))
    probs = torch.softmax(logits_t, dim=-1)
    return torch.nan_to_num(probs, nan=0.0)


def _naive_column_scores(q, kp, kn, scaling, query_mask, prefix_mask):
    probs = _full_softmax(q, kp, kn, scaling, query_mask, prefix_mask)
    P = kp.shape[2]
    col = probs[..., :P]
    if query_mask is not None:
        col = col * query_mask[:, None, :, None].double()
    return col.sum(dim=2), probs


def _brute_topk(row: list[float], k: int) -> list[int]:
    order = sorted(range(len(row)), key=lambda i: (-row[i], i))
    return sorted(order[:k])


def _brute_vote(scores: torch.Tensor, k: int) -> list[int]:
    """Python oracle of vote() for one batch row: scores [H, P]."""
    H, P = scores.shape
    votes = [0] * P
    tie = [0.0] * P
    for h in range(H):
        row = scores[h].tolist()
        for i in _brute_topk(row, k):
            votes[i] += 1
        total = sum(abs(x) for x in row)
        if total > 0:
            for i in range(P):
                tie[i] += row[i] / total
    order = sorted(range(P), key=lambda i: (-votes[i], -tie[i], i))
    return sorted(order[:k])


def _planted(seed: int, B=2, H=3, n=16, P=128, D=32, planted=(5, 40, 77, 100, 127)):
    """Random q/k where the planted prefix keys align with every query."""
    g = torch.Generator().manual_seed(seed)
    u = torch.randn(B, 1, 1, D, generator=g)
    u = u / u.norm(dim=-1, keepdim=True)
    q = 6.0 * u + 0.3 * torch.randn(B, H, n, D, generator=g)
    kp = torch.randn(B, H, P, D, generator=g) * 0.5
    kn = torch.randn(B, H, n, D, generator=g) * 0.5
    for p in planted:
        kp[:, :, p, :] = 6.0 * u[:, :, 0, :]
    return q, kp, kn, list(planted)


# ---------------------------------------------------------------------------
# planted high-attention tokens
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_planted_tokens_in_every_head_topk_and_vote(seed):
    q, kp, kn, planted = _planted(seed)
    scores = attention_column_scores(q, kp, kn)
    assert scores.shape == (2, 3, 128) and scores.dtype == torch.float32
    k = 12
    per_head = topk_indices(scores, k)
    assert per_head.shape == (2, 3, k)
    for b in range(2):
        for h in range(3):
            assert set(planted) <= set(per_head[b, h].tolist())
    voted = vote(scores, k)
    assert voted.shape == (2, k)
    for b in range(2):
        assert set(planted) <= set(voted[b].tolist())
        assert voted[b].tolist() == sorted(voted[b].tolist())
    # planted tokens dominate: they hold most of the probability mass
    mass = scores[:, :, planted].sum(-1) / scores.sum(-1)
    assert (mass > 0.5).all()


# ---------------------------------------------------------------------------
# column scores vs naive implementation
# ---------------------------------------------------------------------------


@FAST
@given(
    B=st.integers(1, 2),
    H=st.integers(1, 3),
    group=st.integers(1, 3),
    n=st.integers(1, 7),
    P=st.integers(1, 9),
    D=st.integers(1, 6),
    with_new=st.booleans(),
    with_qmask=st.booleans(),
    with_pmask=st.booleans(),
    chunk=st.integers(1, 8),
    seed=st.integers(0, 10_000),
)
def test_column_scores_match_naive(B, H, group, n, P, D, with_new, with_qmask, with_pmask, chunk, seed):
    """H KV heads, each shared by ``group`` query heads (grouped-query attention: query
    head h uses KV head h // group); the naive version gives every query head its own
    copy of the keys."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H * group, n, D, generator=g) * 2
    kp = torch.randn(B, H, P, D, generator=g) * 2
    kn = torch.randn(B, H, n, D, generator=g) * 2 if with_new else None
    qmask = torch.rand(B, n, generator=g) > 0.3 if with_qmask else None
    pmask = torch.rand(B, P, generator=g) > 0.3 if with_pmask else None
    scaling = 1.0 / math.sqrt(D)
    got = attention_column_scores(
        q, kp, kn, query_mask=qmask, prefix_mask=pmask, chunk_rows=chunk
    )
    rep_kn = kn.repeat_interleave(group, dim=1) if kn is not None else None
    want, probs = _naive_column_scores(q, kp.repeat_interleave(group, dim=1), rep_kn, scaling, qmask, pmask)
    H = H * group  # query heads, from here on
    assert got.dtype == torch.float32 and got.shape == (B, H, P)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    # every row that sees at least one key is a probability distribution
    row_sums = probs.sum(-1)
    has_key = (probs > 0).any(-1)
    torch.testing.assert_close(row_sums[has_key], torch.ones_like(row_sums[has_key]))
    if kn is not None:
        # with new keys every non-padding query sees at least itself
        valid = qmask if qmask is not None else torch.ones(B, n, dtype=torch.bool)
        assert has_key[valid[:, None, :].expand(B, H, n)].all()
    if pmask is not None:
        assert (got.masked_select(~pmask[:, None, :].expand(B, H, P)) == 0).all()


def test_column_scores_full_softmax_rows_sum_to_one():
    g = torch.Generator().manual_seed(3)
    B, H, n, P, D = 2, 2, 6, 10, 8
    q, kp, kn = (torch.randn(B, H, t, D, generator=g) for t in (n, P, n))
    _, probs = _naive_column_scores(q, kp, kn, 1 / math.sqrt(D), None, None)
    torch.testing.assert_close(probs.sum(-1), torch.ones(B, H, n, dtype=torch.float64))
    # without new keys the prefix columns carry the whole mass of every row
    scores = attention_column_scores(q, kp)
    torch.testing.assert_close(scores.sum(-1), torch.full((B, H), float(n)))
    # with new keys, the first query row attends to itself too -> less than n in total
    scores_new = attention_column_scores(q, kp, kn)
    assert (scores_new.sum(-1) < n).all()


def test_column_scores_chunking_invariant_and_scaling():
    g = torch.Generator().manual_seed(11)
    B, H, n, P, D = 1, 2, 37, 23, 16
    q, kp, kn = (torch.randn(B, H, t, D, generator=g) for t in (n, P, n))
    a = attention_column_scores(q, kp, kn, chunk_rows=1)
    b = attention_column_scores(q, kp, kn, chunk_rows=5)
    c = attention_column_scores(q, kp, kn)
    torch.testing.assert_close(a, b)
    torch.testing.assert_close(a, c)
    d = attention_column_scores(q, kp, kn, scaling=0.5 / math.sqrt(D))
    want, _ = _naive_column_scores(q, kp, kn, 0.5 / math.sqrt(D), None, None)
    torch.testing.assert_close(d.double(), want, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(c, d)


def test_column_scores_half_precision_inputs_give_float32():
    g = torch.Generator().manual_seed(2)
    q, kp, kn = (torch.randn(1, 2, t, 8, generator=g).to(torch.bfloat16) for t in (4, 6, 4))
    out = attention_column_scores(q, kp, kn)
    assert out.dtype == torch.float32
    want, _ = _naive_column_scores(q.float(), kp.float(), kn.float(), 1 / math.sqrt(8), None, None)
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(queries=torch.zeros(1, 2, 3), prefix_keys=torch.zeros(1, 2, 4, 5)),
        dict(queries=torch.zeros(1, 2, 3, 5), prefix_keys=torch.zeros(1, 2, 4, 6)),
        dict(queries=torch.zeros(1, 3, 3, 5), prefix_keys=torch.zeros(1, 2, 4, 5)),
        dict(queries=torch.zeros(2, 2, 3, 5), prefix_keys=torch.zeros(1, 2, 4, 5)),
        dict(
            queries=torch.zeros(1, 2, 3, 5),
            prefix_keys=torch.zeros(1, 2, 4, 5),
            new_keys=torch.zeros(1, 2, 2, 5),
        ),
        dict(
            queries=torch.zeros(1, 2, 3, 5),
            prefix_keys=torch.zeros(1, 2, 4, 5),
            query_mask=torch.ones(1, 4, dtype=torch.bool),
        ),
        dict(
            queries=torch.zeros(1, 2, 3, 5),
            prefix_keys=torch.zeros(1, 2, 4, 5),
            prefix_mask=torch.ones(1, 3, dtype=torch.bool),
        ),
    ],
)
def test_column_scores_rejects_bad_shapes(kwargs):
    with pytest.raises(ValueError):
        attention_column_scores(**kwargs)


# ---------------------------------------------------------------------------
# top-k
# ---------------------------------------------------------------------------


@FAST
@given(
    rows=st.integers(1, 3),
    P=st.integers(1, 12),
    data=st.data(),
)
def test_topk_matches_bruteforce_with_ties(rows, P, data):
    values = data.draw(st.lists(st.integers(0, 3), min_size=rows * P, max_size=rows * P))
    k = data.draw(st.integers(1, P))
    scores = torch.tensor(values, dtype=torch.float32).reshape(1, rows, P)
    got = topk_indices(scores, k)
    assert got.dtype == torch.int64 and got.shape == (1, rows, k)
    for r in range(rows):
        assert got[0, r].tolist() == _brute_topk(scores[0, r].tolist(), k)


def test_topk_all_equal_takes_lowest_indices_and_validates_k():
    scores = torch.zeros(2, 3, 10)
    assert (topk_indices(scores, 4) == torch.arange(4)).all()
    with pytest.raises(ValueError):
        topk_indices(scores, 0)
    with pytest.raises(ValueError):
        topk_indices(scores, 11)


def test_topk_nan_is_never_preferred():
    scores = torch.tensor([[[float("nan"), 1.0, 0.5, float("nan")]]])
    assert topk_indices(scores, 2)[0, 0].tolist() == [1, 2]


# ---------------------------------------------------------------------------
# similarity and threshold
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("k", [40, 100, 200])
def test_expected_random_jaccard_matches_monte_carlo(k):
    P, trials = 400, 3000
    g = torch.Generator().manual_seed(1234 + k)
    total = 0.0
    for _ in range(trials):
        a = set(torch.randperm(P, generator=g)[:k].tolist())
        b = set(torch.randperm(P, generator=g)[:k].tolist())
        total += len(a & b) / len(a | b)
    estimate = total / trials
    assert abs(estimate - expected_random_jaccard(k, P)) < 0.005


def test_paper_threshold_at_half_selection():
    assert expected_random_jaccard(50, 100) == pytest.approx(1 / 3)
    t = similarity_threshold(50, 100)
    assert t == pytest.approx((1 / 3) ** 0.6)
    assert t == pytest.approx(0.517, abs=5e-4)
    # at 25% selection the threshold is lower; alpha -> larger means lower threshold
    assert similarity_threshold(25, 100) < t
    assert similarity_threshold(50, 100, alpha=1.0) < t
    assert expected_random_jaccard(100, 100) == 1.0
    assert expected_random_jaccard(0, 100) == 0.0
    for bad in [(-1, 10), (11, 10), (1, 0)]:
        with pytest.raises(ValueError):
            expected_random_jaccard(*bad)
    with pytest.raises(ValueError):
        similarity_threshold(5, 10, alpha=0.0)


def test_jaccard_identical_and_disjoint_heads():
    same = torch.tensor([[[1, 4, 7], [1, 4, 7], [1, 4, 7]]])
    disjoint = torch.tensor([[[0, 1, 2], [3, 4, 5], [6, 7, 8]]])
    assert mean_pairwise_jaccard(same).tolist() == [1.0]
    assert mean_pairwise_jaccard(disjoint).tolist() == [0.0]
    both = torch.cat([same, disjoint])
    assert mean_pairwise_jaccard(both).tolist() == [1.0, 0.0]
    assert mean_pairwise_jaccard(torch.tensor([[[3, 9]]])).tolist() == [1.0]
    # {0,1,2,3} vs {2,3,4,5}: 2 / 6
    half = torch.tensor([[[0, 1, 2, 3], [2, 3, 4, 5]]])
    assert mean_pairwise_jaccard(half).item() == pytest.approx(1 / 3)
    with pytest.raises(ValueError):
        mean_pairwise_jaccard(torch.tensor([[0, 1]]))
    with pytest.raises(ValueError):
        mean_pairwise_jaccard(torch.tensor([[[0.0, 1.0]]]))


@FAST
@given(B=st.integers(1, 2), H=st.integers(1, 4), P=st.integers(1, 15), data=st.data())
def test_jaccard_matches_python_sets(B, H, P, data):
    k = data.draw(st.integers(1, P))
    seed = data.draw(st.integers(0, 10_000))
    g = torch.Generator().manual_seed(seed)
    sets = torch.stack(
        [torch.stack([torch.randperm(P, generator=g)[:k] for _ in range(H)]) for _ in range(B)]
    )
    got = mean_pairwise_jaccard(sets)
    for b in range(B):
        pairs = list(itertools.combinations(range(H), 2))
        if not pairs:
            want = 1.0
        else:
            vals = []
            for i, j in pairs:
                a, c = set(sets[b, i].tolist()), set(sets[b, j].tolist())
                vals.append(len(a & c) / len(a | c))
            want = sum(vals) / len(vals)
        assert got[b].item() == pytest.approx(want, abs=1e-6)


# ---------------------------------------------------------------------------
# voting
# ---------------------------------------------------------------------------


def test_vote_majority_and_tie_breaks():
    # P = 6, k = 2, three heads.
    scores = torch.tensor(
        [
            [
                [9.0, 8.0, 0.0, 0.0, 0.0, 0.0],  # top-2 {0, 1}
                [9.0, 0.0, 8.0, 0.0, 0.0, 0.0],  # top-2 {0, 2}
                [0.0, 0.0, 0.0, 9.0, 8.0, 0.0],  # top-2 {3, 4}
            ]
        ]
    )
    # votes: 0 -> 2, others 1 each; tie among {1, 2, 3, 4} broken by normalised sums:
    # 1: 8/17, 2: 8/17, 3: 9/17, 4: 8/17 -> 3 wins
    assert vote(scores, 2).tolist() == [[0, 3]]
    # full tie -> lowest index
    flat = torch.ones(1, 3, 5)
    assert vote(flat, 2).tolist() == [[0, 1]]


def test_vote_tie_break_uses_normalised_not_raw_scores():
    # Both heads vote for one index each, so votes tie; head 0 has huge raw scores but
    # normalised, head 1's pick carries more of its head's mass.
    scores = torch.tensor([[[1000.0, 999.0, 998.0, 0.0], [0.0, 0.0, 0.0, 1.0]]])
    # normalised: idx0 = 1000/2997 ~ 0.334, idx3 = 1.0 -> idx3 wins the single slot
    assert vote(scores, 1).tolist() == [[3]]


@FAST
@given(B=st.integers(1, 2), H=st.integers(1, 4), P=st.integers(1, 10), data=st.data())
def test_vote_matches_bruteforce(B, H, P, data):
    k = data.draw(st.integers(1, P))
    values = data.draw(st.lists(st.integers(0, 4), min_size=B * H * P, max_size=B * H * P))
    scores = torch.tensor(values, dtype=torch.float64).reshape(B, H, P)
    got = vote(scores, k)
    assert got.shape == (B, k)
    for b in range(B):
        assert got[b].tolist() == _brute_vote(scores[b], k)


# ---------------------------------------------------------------------------
# probe heads
# ---------------------------------------------------------------------------


def test_choose_probe_heads_examples():
    assert choose_probe_heads(9, 3, 3) == [0, 3, 6]
    assert choose_probe_heads(32, 32, 3) == [0, 1, 2]
    assert choose_probe_heads(32, 8, 3) == [0, 4, 8]
    assert choose_probe_heads(8, 2, 3) == [0, 1, 4]
    assert choose_probe_heads(4, 1, 3) == [0, 1, 2]
    assert choose_probe_heads(8, 2, 8) == list(range(8))


@FAST
@given(kv=st.integers(1, 8), group=st.integers(1, 6), data=st.data())
def test_choose_probe_heads_properties(kv, group, data):
    q = kv * group
    p = data.draw(st.integers(1, q))
    heads = choose_probe_heads(q, kv, p)
    assert len(heads) == p and heads == sorted(set(heads))
    assert all(0 <= h < q for h in heads)
    groups = [h // group for h in heads]
    counts = [groups.count(g) for g in range(kv)]
    # balanced over KV groups: counts differ by at most one
    assert max(counts) - min(counts) <= 1
    if p <= kv:
        assert len(set(groups)) == p


@pytest.mark.parametrize(
    "args", [(0, 1, 1), (4, 0, 1), (6, 4, 1), (4, 8, 1), (4, 2, 0), (4, 2, 5), (4.0, 2, 1)]
)
def test_choose_probe_heads_validation(args):
    with pytest.raises(ValueError):
        choose_probe_heads(*args)


@pytest.mark.parametrize("seed", range(12))
def test_top_jaccard_equals_the_mean_pairwise_jaccard_of_the_top_k_sets(seed):
    """The selection's agreement, from masks, is the number the index sets give, ties and
    NaN included (the threshold test compares it exactly)."""
    g = torch.Generator().manual_seed(seed)
    h, p = 1 + seed % 4, 5 + seed * 7
    scores = torch.randint(0, 4, (h, p), generator=g).float()  # many ties
    if seed % 3 == 0:
        scores[0, ::5] = float("nan")
    for k in {1, p // 3 or 1, p - 1, p}:
        want = float(mean_pairwise_jaccard(topk_indices(scores[None], k))[0])
        assert top_jaccard(scores, k) == want
    # the two ways (sets of a sort for few scores, masks for many) agree
    wide = scores.repeat(1, 2048 // p + 1)
    for k in (1, wide.shape[1] // 4, wide.shape[1]):
        want = float(mean_pairwise_jaccard(topk_indices(wide[None], k))[0])
        assert top_jaccard(wide, k) == want
