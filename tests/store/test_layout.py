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


@settings(max_examples=80, deadline=None)
@given(
    pieces=st.lists(st.tuples(st.integers(0, 40), st.integers(1, 40), st.booleans()), min_size=1, max_size=4),
    chunk=st.integers(1, 17),
    per_head=st.booleans(),
    split=st.booleans(),
    data=st.data(),
)
def test_layout_gather_matches_a_row_by_row_copy(pieces, chunk, per_head, split, data):
    """Every gather of a layer view (shared positions, per-head positions, every position
    with `gather_into`) returns exactly the rows a row-by-row walk finds, for files in
    prompt order and files whose layers keep their rows in their own order (reordered),
    with pieces of one file split into two segments (a split node)."""
    from impress_cache.index.radix import RadixNode, Segment
    from impress_cache.store.layout import PrefixLayout

    heads, dim, layers = 2, 3, 2
    segments, files, perms = [], {}, {}
    for i, (row, n, permuted) in enumerate(pieces):
        g = torch.Generator().manual_seed(i)
        total = row + n
        # logical rows of file i, per layer: [layers, 2, heads, rows, dim]
        files[i] = torch.randn(layers, 2, heads, total, dim, generator=g)
        perms[i] = torch.stack([torch.randperm(total, generator=g) for _ in range(layers)]).numpy() if permuted else None
        if split and n > 1:  # two consecutive segments of one file, as after a split
            k = n // 2
            segments.append(Segment(RadixNode(2 * i, np.arange(k, dtype=np.int32), i, row, None), k))
            segments.append(Segment(RadixNode(2 * i + 1, np.arange(n - k, dtype=np.int32), i, row + k, None), n - k))
        else:
            segments.append(Segment(RadixNode(2 * i, np.arange(n, dtype=np.int32), i, row, None), n))
    lay = PrefixLayout(segments, lambda _file: chunk, perms.get)
    assert lay.length == sum(n for _, n, _ in pieces)
    assert lay.in_order == all(p is None for p in perms.values())

    def blocks(layer, units):  # the whole disk blocks of units: physical rows of the layer
        pool = torch.zeros(len(units), 2, heads, chunk, dim)
        rows = []
        for slot, u in enumerate(units):
            unit = lay.units[u]
            logical = files[unit.file_id][layer]
            perm = perms[unit.file_id]
            physical = logical if perm is None else torch.empty_like(logical).index_copy_(2, torch.as_tensor(perm[layer]), logical)
            b = physical[:, :, unit.block * chunk : (unit.block + 1) * chunk]
            pool[slot, :, :, : b.shape[2]] = b
            rows.append(b.shape[2])
        return BlockSet(KV, pool, rows, list(range(len(units))))

    for layer in range(layers):
        view = lay.at(layer)
        # the expected row of every logical position, walking the pieces
        expect = torch.cat([files[i][layer][:, :, row : row + n] for i, (row, n, _) in enumerate(pieces)], dim=2)
        k = data.draw(st.integers(1, lay.length))
        draw = st.lists(st.integers(0, lay.length - 1), min_size=k, max_size=k, unique=True)
        if per_head:
            positions = torch.stack([torch.tensor(sorted(data.draw(draw))) for _ in range(heads)])
        else:
            positions = torch.tensor(sorted(data.draw(draw)))
        units = view.units_for(positions.reshape(-1))
        keys, values = view.gather(units, blocks(layer, units), positions)
        for h in range(heads):
            pos = positions[h] if per_head else positions
            assert torch.equal(keys[h], expect[0, h, pos])
            assert torch.equal(values[h], expect[1, h, pos])
        # into a layer's buffer (room after the k rows: written in place) and into a
        # batch row of a larger one (a copy): the same rows, no other batch row touched
        room = data.draw(st.integers(0, 3))
        for batch, row in ((1, 0), (3, 1)):
            buf = torch.full((2, batch, heads, k + room, dim), 7.0)
            got = view.gather(units, blocks(layer, units), positions, out=buf[:, row, :, :k])
            assert torch.equal(got[0], keys) and torch.equal(got[1], values)
            assert torch.equal(buf[:, row, :, :k], torch.stack([keys, values]))
            assert got[0].data_ptr() == buf[0, row].data_ptr()
            others = [b for b in range(batch) if b != row]
            assert bool((buf[:, others] == 7.0).all())
            if batch > 1:  # a view the rows cannot tile: its room is left alone
                assert bool((buf[:, row, :, k:] == 7.0).all())
        # every position, from every unit of the layer
        all_units = view.units_all()
        keys, values = view.gather(all_units, blocks(layer, all_units))
        assert torch.equal(keys, expect[0]) and torch.equal(values, expect[1])
        out = torch.zeros(2, heads, lay.length, dim)
        view.gather_into(all_units, blocks(layer, all_units), out)
        assert torch.equal(out, expect)
        # blocks cut from in-memory rows (recomputed prefixes) gather the same way
        again = view.gather(units, view.blocks_from(expect[0], expect[1], units), positions)
        for h in range(heads):
            pos = positions[h] if per_head else positions
            assert torch.equal(again[0][h], expect[0, h, pos]) and torch.equal(again[1][h], expect[1, h, pos])
        missing = int(view.unit_of[0])
        rest = [u for u in all_units if u != missing]
        with pytest.raises(ValueError, match="not given"):
            view.gather(rest, blocks(layer, rest), torch.tensor([0]))
