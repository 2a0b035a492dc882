"""The selection the cache really uses (`selection.selectors.select_row`), on synthetic tensors."""

from __future__ import annotations

import pytest
import torch

from helpers import blockset_of
from impress_cache.index.radix import RadixTree
from impress_cache.selection.selectors import select_row
from impress_cache.store.layout import PrefixLayout

P, CT, D, HKV, GROUP, N = 128, 16, 16, 2, 2, 6


def _layout(n=P):
    tree = RadixTree()
    tree.insert(tuple(range(n)), file_id=0)
    return PrefixLayout(tree.match(tuple(range(n))).segments, lambda fid: CT).at(0)


def _kv(seed, planted_per_head):
    """Keys whose planted rows align with every query of their KV head."""
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(HKV, P, D, generator=g) * 0.1
    values = torch.randn(HKV, P, D, generator=g)
    direction = torch.randn(HKV, D, generator=g)
    direction = direction / direction.norm(dim=-1, keepdim=True)
    for h, rows in enumerate(planted_per_head):
        keys[h, rows] = direction[h] * 8.0
    queries = direction.repeat_interleave(GROUP, 0)[:, None, :].expand(HKV * GROUP, N, D) * 8.0
    new_keys = torch.randn(HKV, N, D, generator=g) * 0.1
    return keys, values, queries.contiguous(), new_keys


def _reader(lay, keys, values, log):
    def read(units, rows=None):
        log.append(list(units))
        return blockset_of(lay, units, keys, values)

    return read


def _select(planted, mode, probe_kv=(0, 1), threshold=None):
    keys, values, queries, new_keys = _kv(0, planted)
    lay, log = _layout(), []
    sel = select_row(
        queries=queries, new_keys=new_keys, probe_keys=keys[list(probe_kv)], probe_kv_heads=probe_kv,
        layout=lay, k=32, read_units=_reader(lay, keys, values, log), mode=mode, fixed_threshold=threshold,
    )
    return sel, log, keys, values


@pytest.mark.parametrize("mode", ["token", "block"])
def test_planted_rows_are_found_and_only_their_blocks_read(mode):
    planted = [list(range(40, 48)) + [100, 101]] * HKV  # both KV heads agree
    sel, log, keys, values = _select(planted, mode)
    assert not sel.fell_back and sel.similarity >= sel.threshold
    assert set(planted[0]) <= set(sel.rows.tolist()) and sel.rows.numel() == 32
    read_units = {u for call in log for u in call}
    if mode == "block":  # 32 rows = 2 whole blocks (+1 for the planted pair at 100)
        assert len(read_units) <= 3
    else:  # the 22 rows beyond the planted ones are spread: token mode reads their blocks too
        assert read_units == set(sel.rows.div(CT, rounding_mode="floor").tolist())
    # the rows handed back are exactly the stored rows at the selected positions
    assert torch.equal(sel.keys, keys[:, sel.rows]) and torch.equal(sel.values, values[:, sel.rows])


@pytest.mark.parametrize("mode", ["token", "block"])
def test_disagreeing_heads_fall_back_to_per_head_rows(mode):
    planted = [list(range(0, 16)), list(range(96, 112))]  # each KV head wants other rows
    sel, log, keys, values = _select(planted, mode, threshold=0.9)
    assert sel.fell_back and sel.rows.shape == (HKV, 32)
    for h in range(HKV):
        assert set(planted[h]) <= set(sel.rows[h].tolist())
        assert torch.equal(sel.keys[h], keys[h, sel.rows[h]])
    # the probe copy holds both KV heads: only the blocks of the heads' rows were read
    read_units = {u for call in log for u in call}
    assert read_units == set(sel.rows.reshape(-1).div(CT, rounding_mode="floor").tolist())
    if mode == "block":
        assert len(read_units) <= 6


def test_fallback_reads_every_block_when_the_probe_copy_lacks_a_kv_head():
    planted = [list(range(0, 16)), list(range(96, 112))]
    sel, log, _, _ = _select(planted, "token", probe_kv=(0,), threshold=1.1)
    assert sel.fell_back
    assert sorted(u for call in log for u in call) == list(range(P // CT))
