"""Prefix layouts: rows gathered from blocks, and whole stored prefixes read back exact."""

from __future__ import annotations

import hypothesis.strategies as st
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings

from conftest import tiny_model
from impress_cache import ImpressConfig, ImpressStore
from impress_cache.storage import FORMATS, KV
from impress_cache.store.blockset import BlockSet

def _kv(layers, heads, n, dim, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    ks = [torch.randn(heads, n, dim, generator=g).to(dtype) for _ in range(layers)]
    vs = [torch.randn(heads, n, dim, generator=g).to(dtype) for _ in range(layers)]
    return ks, vs


_MODEL = None


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    fmt=st.sampled_from(sorted(FORMATS)),
    lengths=st.lists(st.integers(2, 60), min_size=1, max_size=4),
    cut=st.integers(1, 59),
    chunk=st.integers(1, 20),
    seed=st.integers(0, 1000),
)
def test_store_load_returns_exact_rows(tmp_path_factory, fmt, lengths, cut, chunk, seed):
    """Prompts sharing prefixes are stored in pieces across files; any match reads back exact."""
    model = _model()
    spec_heads, dim, layers = 2, 16, 2
    g = torch.Generator().manual_seed(seed)
    base = torch.randint(3, 256, (60,), generator=g).tolist()
    d = tmp_path_factory.mktemp("kv")
    ks, vs = _kv(layers, spec_heads, 60, dim, torch.float32, seed)
    with ImpressStore(d, model, ImpressConfig(chunk_tokens=chunk, fsync=False), storage_format=fmt) as store:
        for n in lengths:
            toks = base[:n]
            store.put(toks, [k[:, :n] for k in ks], [v[:, :n] for v in vs])
        longest = max(lengths)
        q = base[: min(cut, longest)]
        m = store.match(q)
        assert m.length == len(q)
        loaded = store.load(m.segments)
        assert torch.equal(loaded.keys, torch.stack([k[:, : len(q)] for k in ks]))
        assert torch.equal(loaded.values, torch.stack([v[:, : len(q)] for v in vs]))


def _model():
    global _MODEL
    if _MODEL is None:
        _MODEL = tiny_model("llama")
    return _MODEL


def test_hdf5_refuses_bfloat16(tmp_path):
    from impress_cache import ConfigError

    with pytest.raises(ConfigError, match="hdf5"):
        ImpressStore(tmp_path, _model(), ImpressConfig(kv_dtype="bfloat16"), storage_format="hdf5")


@settings(max_examples=60, deadline=None)
@given(
    pieces=st.lists(st.tuples(st.integers(0, 40), st.integers(1, 40)), min_size=1, max_size=4),
    chunk=st.integers(1, 17),
    per_head=st.booleans(),
    data=st.data(),
)
def test_layout_gather_matches_a_row_by_row_copy(pieces, chunk, per_head, data):
    """`PrefixLayout.gather` (what sparse prefills and `store.load` use) returns exactly
    the rows a row-by-row walk over the units finds, for shared and per-head positions."""
    from impress_cache.store.layout import PrefixLayout
    from impress_cache.index.radix import RadixNode, Segment

    heads, dim = 2, 3
    # piece i: rows file_row .. file_row + length of file i (blocks of `chunk` rows)
    segments = [Segment(RadixNode(i, np.arange(n, dtype=np.int32), i, row, None), n) for i, (row, n) in enumerate(pieces)]
    files = {}
    for i, (row, n) in enumerate(pieces):
        g = torch.Generator().manual_seed(i)
        files[i] = torch.randn(2, heads, row + n, dim, generator=g)
    lay = PrefixLayout(segments, lambda _file: chunk)
    assert lay.length == sum(n for _, n in pieces)

    def blocks(units):  # the whole disk blocks of units, one slot each (a file's last block may be short)
        pool = torch.zeros(len(units), 2, heads, chunk, dim)
        rows = []
        for slot, u in enumerate(units):
            unit = lay.units[u]
            b = files[unit.file_id][:, :, unit.block * chunk : (unit.block + 1) * chunk]
            pool[slot, :, :, : b.shape[2]] = b
            rows.append(b.shape[2])
        return BlockSet(KV, pool, rows, list(range(len(units))))

    # the expected row of every logical position, walking the segments
    expect = torch.cat([files[i][:, :, row : row + n] for i, (row, n) in enumerate(pieces)], dim=2)
    k = data.draw(st.integers(1, lay.length))
    if per_head:
        positions = torch.stack([
            torch.tensor(sorted(data.draw(st.lists(st.integers(0, lay.length - 1), min_size=k, max_size=k, unique=True))))
            for _ in range(heads)
        ])
    else:
        positions = torch.tensor(sorted(data.draw(st.lists(st.integers(0, lay.length - 1), min_size=k, max_size=k, unique=True))))
    units = lay.units_for(positions.reshape(-1))
    keys, values = lay.gather(units, blocks(units), positions)
    for h in range(heads):
        pos = positions[h] if per_head else positions
        assert torch.equal(keys[h], expect[0, h, pos])
        assert torch.equal(values[h], expect[1, h, pos])
    # every position, from every unit
    all_units = list(range(len(lay.units)))
    keys, values = lay.gather(all_units, blocks(all_units))
    assert torch.equal(keys, expect[0]) and torch.equal(values, expect[1])
    if len(all_units) > 1:  # position 0 lies in unit 0, whose block is left out
        with pytest.raises(ValueError, match="not given"):
            lay.gather(all_units[1:], blocks(all_units[1:]), torch.tensor([0]))
