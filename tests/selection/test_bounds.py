"""Block-level scoring by per-channel key bounds (`selection.bounds`, ``block_scores="bounds"``)."""

from __future__ import annotations

from dataclasses import dataclass

import hypothesis.strategies as st
import numpy as np
import pytest
import torch
from hypothesis import given, settings

from helpers import blockset_of
from impress_cache.selection.bounds import (
    block_summaries, bound_logits, take_units, unit_row_scores, unit_scores, units_taken,
)
from impress_cache.selection.scores import select_units
from impress_cache.selection.selectors import select_row
from impress_cache.store.layout import PrefixLayout


@dataclass(frozen=True)
class _Seg:
    """What a layout reads of a radix-tree segment."""

    file_id: int
    file_row: int
    length: int


def _layout(pieces, ct, layer=0, perm_seed=None):
    """A layout over ``pieces`` (``(file_row, length)`` runs of files 0, 1, ...) with
    ``ct`` rows per block; with ``perm_seed`` every file's rows are permuted per layer."""
    segs = [_Seg(i, r0, n) for i, (r0, n) in enumerate(pieces)]
    perm_of = lambda fid: None  # noqa: E731
    if perm_seed is not None:
        rng = np.random.default_rng(perm_seed)
        perms = {i: np.stack([rng.permutation(r0 + n) for _ in range(layer + 1)]) for i, (r0, n) in enumerate(pieces)}
        perm_of = perms.get
    return PrefixLayout(segs, lambda fid: ct, perm_of).at(layer)


_pieces = st.lists(st.tuples(st.integers(0, 40), st.integers(1, 50)), min_size=1, max_size=3)


@settings(max_examples=60, deadline=None)
@given(pieces=_pieces, ct=st.integers(1, 20), heads=st.integers(1, 3), seed=st.integers(0, 10_000),
       reordered=st.booleans(), scale=st.sampled_from([1e-3, 1.0, 30.0]))
def test_the_bound_is_an_upper_bound_of_every_key_in_the_unit(pieces, ct, heads, seed, reordered, scale):
    lay = _layout(pieces, ct, perm_seed=seed if reordered else None)
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(heads, lay.length, 8, generator=g) * scale
    queries = torch.randn(heads, 5, 8, generator=g) * scale
    queries[:, 0, :3] = 0.0  # zero channels take either bound
    summ = block_summaries(keys, *lay.unit_table())
    assert bool(summ.present.equal(lay.unit_count > 0))
    bounds = bound_logits(queries, summ.lo, summ.hi)  # [H, n, U]
    exact = torch.matmul(queries, keys.transpose(-1, -2))  # [H, n, P]
    tol = 1e-5 * (1 + exact.abs().amax())
    assert bool((bounds[:, :, lay.unit_of] >= exact - tol).all())
    # the bounds are the per-channel extremes of exactly the unit's keys: tight for one-row units
    for u in torch.nonzero(lay.unit_count == 1).squeeze(1).tolist():
        p = int(torch.nonzero(lay.unit_of == u)[0, 0])
        assert torch.allclose(bounds[:, :, u], exact[:, :, p], atol=float(tol))


@settings(max_examples=60, deadline=None)
@given(pieces=_pieces, ct=st.integers(1, 20), seed=st.integers(0, 10_000), frac=st.floats(0.01, 1.0))
def test_take_units_equals_select_units_on_shared_row_scores(pieces, ct, seed, frac):
    lay = _layout(pieces, ct)
    g = torch.Generator().manual_seed(seed)
    # distinct scores: spread over rows, tied units' sums would differ by rounding
    scores = torch.randperm(len(lay.units), generator=g).to(torch.float64) + 1.0
    k = max(1, int(frac * lay.length))
    rows = take_units(scores, lay.unit_of, lay.unit_count, k)
    expected = select_units(unit_row_scores(scores.unsqueeze(0), lay.unit_of, lay.unit_count)[0], lay.unit_of, k)
    assert rows.numel() == k and torch.equal(rows, torch.unique(rows))
    # the same units, and the same number of rows from each (rows of one unit tie)
    assert torch.equal(torch.bincount(lay.unit_of[rows], minlength=len(lay.units)),
                       torch.bincount(lay.unit_of[expected], minlength=len(lay.units)))
    # the units it names to read are exactly those holding the rows (absent units too)
    same, units = units_taken(scores, lay.unit_of, lay.unit_count, k)
    assert torch.equal(same, rows) and units == lay.units_for(rows)


def test_unit_scores_are_a_softmax_per_query_head_and_token():
    lay = _layout([(0, 64)], 16)
    g = torch.Generator().manual_seed(0)
    keys = torch.randn(2, 64, 8, generator=g)
    summ = block_summaries(keys, *lay.unit_table())
    s = unit_scores(torch.randn(6, 3, 8, generator=g), summ)  # 2 KV heads x group 3, 3 tokens
    assert s.shape == (2, 4)
    assert torch.allclose(s.sum(dim=-1), torch.full((2,), 9.0))  # group x tokens


P, CT, D, HKV, GROUP, N = 128, 16, 16, 2, 2, 6


def _planted(planted_per_head, seed=0):
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(HKV, P, D, generator=g) * 0.1
    values = torch.randn(HKV, P, D, generator=g)
    direction = torch.randn(HKV, D, generator=g)
    direction = direction / direction.norm(dim=-1, keepdim=True)
    for h, rows in enumerate(planted_per_head):
        keys[h, rows] = direction[h] * 8.0
    queries = direction.repeat_interleave(GROUP, 0)[:, None, :].expand(HKV * GROUP, N, D) * 8.0
    return keys, values, queries.contiguous(), torch.randn(HKV, N, D, generator=g) * 0.1


def _select(planted, threshold=None, probe_kv=(0, 1), with_summaries=False, mode="block", keep=(0, 0)):
    keys, values, queries, new_keys = _planted(planted)
    lay, log = _layout([(0, P)], CT), []

    def read(units, rows=None):
        log.append(list(units))
        return blockset_of(lay, units, keys, values)

    probe = keys[list(probe_kv)]
    summ = block_summaries(probe, *lay.unit_table()) if with_summaries else None
    sel = select_row(
        queries=queries, new_keys=new_keys, probe_keys=probe, probe_kv_heads=probe_kv, layout=lay, k=32,
        read_units=read, mode=mode, fixed_threshold=threshold, block_scores="bounds", summaries=summ, keep=keep,
    )
    return sel, {u for call in log for u in call}, keys, values


@pytest.mark.parametrize("with_summaries", [False, True])
def test_bounds_find_the_planted_blocks_and_read_only_them(with_summaries):
    planted = [list(range(40, 48)) + [100, 101]] * HKV
    sel, read, keys, values = _select(planted, with_summaries=with_summaries)
    assert not sel.fell_back and sel.rows.numel() == 32 and torch.equal(sel.rows, torch.unique(sel.rows))
    assert set(planted[0]) <= set(sel.rows.tolist())
    assert read == {2, 6} and sel.units == 2
    assert torch.equal(sel.keys, keys[:, sel.rows]) and torch.equal(sel.values, values[:, sel.rows])
    assert sel.row_ranking() is not None and sel.row_ranking().shape == (P,)


def test_bounds_with_kept_rows_and_token_mode():
    planted = [list(range(40, 48))] * HKV
    sel, read, _, _ = _select(planted, keep=(1, 0))
    assert 0 in sel.rows.tolist() and set(planted[0]) <= set(sel.rows.tolist())
    sel, _, _, _ = _select(planted, mode="token")
    assert sel.rows.numel() == 32 and set(planted[0]) <= set(sel.rows.tolist())


def test_bounds_fall_back_per_head_when_the_heads_disagree():
    planted = [list(range(0, 16)), list(range(96, 112))]
    sel, read, keys, _ = _select(planted, threshold=0.9)
    assert sel.fell_back and sel.rows.shape == (HKV, 32)
    for h in range(HKV):
        assert set(planted[h]) <= set(sel.rows[h].tolist())
        assert torch.equal(sel.keys[h], keys[h, sel.rows[h]])
    assert read == set(sel.rows.reshape(-1).div(CT, rounding_mode="floor").tolist())
    # a probe copy without every KV head: the whole layer is read, as with row scores
    sel, read, _, _ = _select(planted, threshold=1.1, probe_kv=(0,))
    assert sel.fell_back and read == set(range(P // CT))


def test_the_probe_loader_computes_the_bounds_of_files_written_without_them(tmp_path):
    """Chunk files hold no summaries (files written before `block_scores` work as they
    are): the probe loader computes them from the decoded probe copy, per batch row and
    layer, only for ``block_scores="bounds"``."""
    from conftest import tiny_model
    from helpers import run, tokens
    from impress_cache import ImpressCache, ImpressConfig, ImpressStore
    from impress_cache.hf.loaders import ProbeLoader
    from impress_cache.stats import RequestStats

    model = tiny_model("llama")
    doc = tokens(1, 200)
    with ImpressStore(tmp_path, model, ImpressConfig(important_ratio=1.0, chunk_tokens=16)) as store:
        run(model, doc.unsqueeze(0), cache=ImpressCache(store))
    for scores in ("rows", "bounds"):
        cfg = ImpressConfig(important_ratio=0.25, chunk_tokens=16, block_scores=scores, host_bytes=0, device_bytes=0)
        with ImpressStore(tmp_path, model, cfg) as store:
            lay = store.layout(store.match(doc.tolist()).segments)
            loader = ProbeLoader(store, [lay], RequestStats())
            for layer in range(2):
                keys = loader.layer(layer)[0]
                got = loader.layer_summaries(layer)
                if scores == "rows":
                    assert got is None
                    continue
                want = block_summaries(keys, *lay.at(layer).unit_table())
                assert got is not None and torch.equal(got[0].lo, want.lo) and torch.equal(got[0].hi, want.hi)
                assert got[0].lo.shape == (len(store.probe.kv_heads), 13, keys.shape[-1])  # 200 rows: 13 units
                assert loader.layer_summaries(layer) is None  # the layer took them
