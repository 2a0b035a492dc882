"""The host-side bookkeeping (`selection.small`) chooses exactly what the torch code it
replaced chose: the references below are that code, kept here as it was."""

from __future__ import annotations

import hypothesis.strategies as st
import numpy as np
import torch
from hypothesis import given, settings

from impress_cache.selection.bounds import units_taken
from impress_cache.selection.scores import _sanitize_scores, select_units, top_jaccard


def _rank(primary: torch.Tensor) -> torch.Tensor:
    return torch.sort(primary, dim=-1, descending=True, stable=True).indices


def reference_units_taken(scores, unit_of, unit_count, k):
    s = torch.nan_to_num(scores.to(torch.float64), nan=0.0)
    order = torch.sort(s, descending=True, stable=True).indices
    covered = torch.cumsum(unit_count[order], dim=0)
    n_take = min(int((covered < k).sum()) + 1, order.numel())
    chosen = torch.zeros(s.shape[0], dtype=torch.bool)
    chosen[order[:n_take]] = True
    rows = torch.nonzero(chosen[unit_of]).squeeze(1)
    if rows.numel() > k:
        per_row = (s / unit_count.clamp(min=1).to(torch.float64))[unit_of[rows]]
        rows = torch.sort(rows[torch.sort(per_row, descending=True, stable=True).indices[:k]]).values
        units = torch.unique(unit_of[rows])
    else:
        units = torch.nonzero(chosen & (unit_count > 0)).squeeze(1)
    return rows, units.tolist()


def reference_select_units(scores, unit_of, k):
    s = torch.nan_to_num(scores.to(torch.float64), nan=0.0)
    n_units = int(unit_of.max()) + 1
    sums = torch.zeros(n_units, dtype=torch.float64).scatter_add_(0, unit_of, s)
    sizes = torch.bincount(unit_of, minlength=n_units)
    order = _rank(sums)
    covered = torch.cumsum(sizes[order], dim=0)
    n_take = int((covered < k).sum()) + 1
    chosen = torch.zeros(n_units, dtype=torch.bool)
    chosen[order[:n_take]] = True
    rows = torch.nonzero(chosen[unit_of]).squeeze(1)
    if rows.numel() > k:
        rows = rows[_rank(s[rows])[:k]]
    return torch.sort(rows).values


def reference_top_jaccard(scores, k):
    h, _ = scores.shape
    if h <= 1:
        return 1.0
    s = _sanitize_scores(scores)
    top = [set(r) for r in torch.sort(s, dim=-1, descending=True, stable=True).indices[:, :k].tolist()]
    inter = [len(top[a] & top[b]) for a in range(h) for b in range(a + 1, h)]
    pair = torch.tensor(inter, dtype=torch.float64)
    return float((pair / (2 * k - pair)).mean().to(torch.float32))


def _scores(draw_seed: int, n: int, kind: str, dtype=torch.float64) -> torch.Tensor:
    """Scores with the cases that decide ties: distinct, few distinct values (many ties),
    zeros of both signs, NaN and infinities."""
    g = torch.Generator().manual_seed(draw_seed)
    if kind == "distinct":
        s = torch.rand(n, generator=g, dtype=torch.float64)
    elif kind == "ties":
        s = torch.randint(0, 4, (n,), generator=g).to(torch.float64) / 4
    else:
        s = torch.randint(0, 6, (n,), generator=g).to(torch.float64)
        specials = torch.tensor([0.0, -0.0, float("nan"), float("inf"), float("-inf"), 1.5], dtype=torch.float64)
        s = specials[s.long()]
    return s.to(dtype)


def _units(seed: int, p: int, n_units: int, in_order: bool) -> torch.Tensor:
    """``[p]`` unit of every row: runs in order, or scattered; every id below ``n_units``
    may or may not occur (empty units)."""
    rng = np.random.default_rng(seed)
    if in_order:
        cuts = np.sort(rng.integers(0, n_units, p))
        return torch.from_numpy(cuts.astype(np.int64))
    return torch.from_numpy(rng.integers(0, n_units, p).astype(np.int64))


_kinds = st.sampled_from(["distinct", "ties", "special"])


@settings(max_examples=200, deadline=None)
@given(seed=st.integers(0, 100_000), p=st.integers(1, 300), n_units=st.integers(1, 60), kind=_kinds,
       in_order=st.booleans(), frac=st.floats(0.0, 1.0))
def test_units_taken_chooses_what_the_reference_chose(seed, p, n_units, kind, in_order, frac):
    unit_of = _units(seed, p, n_units, in_order)
    count = torch.bincount(unit_of, minlength=n_units)
    scores = _scores(seed, n_units, kind, dtype=torch.float32 if seed % 2 else torch.float64)
    k = max(1, min(p, int(frac * p)))
    rows, units = units_taken(scores, unit_of, count, k)
    ref_rows, ref_units = reference_units_taken(scores, unit_of, count, k)
    assert rows.dtype == torch.int64 and torch.equal(rows, ref_rows)
    assert units == ref_units


@settings(max_examples=200, deadline=None)
@given(seed=st.integers(0, 100_000), p=st.integers(1, 300), n_units=st.integers(1, 60), kind=_kinds,
       in_order=st.booleans(), frac=st.floats(0.0, 1.0))
def test_select_units_chooses_what_the_reference_chose(seed, p, n_units, kind, in_order, frac):
    unit_of = _units(seed, p, n_units, in_order)
    scores = _scores(seed, p, kind, dtype=torch.float32 if seed % 2 else torch.float64)
    k = max(1, min(p, int(frac * p)))
    rows = select_units(scores, unit_of, k)
    assert rows.dtype == torch.int64 and torch.equal(rows, reference_select_units(scores, unit_of, k))


def test_select_units_sums_a_long_prefix_in_the_same_order():
    """8000-row prefixes of 16-row units with float32 attention-like scores (the default
    path's sizes): the units' sums, added in row order, rank the units alike."""
    g = torch.Generator().manual_seed(7)
    for seed in range(5):
        p = 8000 + seed * 131
        unit_of = torch.arange(p) // 16
        scores = torch.softmax(torch.randn(3, p, generator=g) * 4, dim=-1).sum(0).to(torch.float64)
        scores = scores / 3 + scores * 1e-9  # values whose sums round
        k = p // 4 + seed
        assert torch.equal(select_units(scores, unit_of, k), reference_select_units(scores, unit_of, k))


@settings(max_examples=200, deadline=None)
@given(seed=st.integers(0, 100_000), h=st.integers(1, 6), p=st.integers(1, 200), kind=_kinds, frac=st.floats(0.0, 1.0))
def test_top_jaccard_agrees_with_the_reference(seed, h, p, kind, frac):
    scores = torch.stack([_scores(seed + i, p, kind, dtype=torch.float32) for i in range(h)])
    k = max(1, min(p, int(frac * p)))
    assert top_jaccard(scores, k) == reference_top_jaccard(scores, k)


def test_top_jaccard_of_long_prefixes_agrees_with_the_reference():
    """Row scores of 8k-row prefixes (the default path's agreement), with ties and NaN."""
    for seed, kind in enumerate(["distinct", "ties", "special", "distinct"]):
        p = 8000 + 97 * seed
        scores = torch.stack([_scores(seed * 10 + i, p, kind, dtype=torch.float32) for i in range(3)])
        for k in (1, p // 4, p // 4 + 3, p - 1, p):
            assert top_jaccard(scores, k) == reference_top_jaccard(scores, k)


def _prefix(pieces):
    """A layout over several stored prompts (files 0, 1, ...: ``(first file row, rows)``
    each) with 16-row blocks, so that units at the pieces' edges are short."""
    from dataclasses import dataclass

    from impress_cache.store.layout import PrefixLayout

    @dataclass(frozen=True)
    class Seg:
        file_id: int
        file_row: int
        length: int

    return PrefixLayout([Seg(i, r0, n) for i, (r0, n) in enumerate(pieces)], lambda fid: 16).at(0)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 100_000), pieces=st.lists(st.tuples(st.integers(0, 40), st.integers(1, 120)), min_size=1,
       max_size=3), frac=st.floats(0.05, 0.95), scale=st.sampled_from([0.1, 1.0, 6.0]),
       block_scores=st.sampled_from(["rows", "bounds"]), alike=st.sampled_from([0.0, 0.9, 1.0]))
def test_select_row_chooses_and_gathers_what_the_reference_did(seed, pieces, frac, scale, block_scores, alike):
    """`select_row` (block mode; ``"rows"`` is the default) against the torch code it ran
    before: the same rows, the same similarity, and the gathered K/V are those rows. With
    ``alike`` near 1 the two KV heads see alike keys and queries (the heads agree: one
    shared set), at 0 they are independent (mostly each head's own set)."""
    from helpers import blockset_of
    from impress_cache.selection.bounds import unit_scores, block_summaries
    from impress_cache.selection.scores import similarity_threshold
    from impress_cache.selection.selectors import normalised_sum, probe_scores, select_row

    lay = _prefix(pieces)
    p, hkv, group, n, d = lay.length, 2, 2, 5, 8
    k = max(1, min(p - 1, int(frac * p))) if p > 1 else 1
    g = torch.Generator().manual_seed(seed)
    keys, values = torch.randn(hkv, p, d, generator=g), torch.randn(hkv, p, d, generator=g)
    queries = torch.randn(hkv * group, n, d, generator=g) * scale
    new_keys = torch.randn(hkv, n, d, generator=g)
    keys[1] = alike * keys[0] + (1 - alike) * keys[1]
    queries[group:] = alike * queries[:group] + (1 - alike) * queries[group:]
    sel = select_row(
        queries=queries, new_keys=new_keys, probe_keys=keys, probe_kv_heads=(0, 1), layout=lay, k=k,
        read_units=lambda units, rows=None: blockset_of(lay, units, keys, values), block_scores=block_scores,
    )
    if block_scores == "rows":
        scores = probe_scores(queries, new_keys, keys, (0, 1))
        thr = similarity_threshold(k, p, 0.6)
        sim = reference_top_jaccard(scores, k)
        choose = lambda s: reference_select_units(s, lay.unit_of, k)  # noqa: E731
    else:
        scores = unit_scores(queries, block_summaries(keys, *lay.unit_table()))
        present = int((lay.unit_count > 0).sum())
        k_u = min(present, max(1, -(-k * present // p)))
        thr = similarity_threshold(k_u, present, 0.6)
        sim = reference_top_jaccard(scores, k_u)
        choose = lambda s: reference_units_taken(s, lay.unit_of, lay.unit_count, k)[0]  # noqa: E731
    assert sel.similarity == sim and sel.threshold == thr
    if sim >= thr:
        rows = choose(normalised_sum(scores))
    else:
        rows = torch.stack([choose(scores[h]) for h in range(hkv)])
    assert torch.equal(sel.rows, rows)
    idx = rows if rows.dim() == 2 else rows.expand(hkv, -1)
    assert torch.equal(sel.keys, torch.gather(keys, 1, idx[..., None].expand(-1, -1, d)))
    assert torch.equal(sel.values, torch.gather(values, 1, idx[..., None].expand(-1, -1, d)))
