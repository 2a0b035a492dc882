"""Block layout: whatever rows are written come back bit-identical, in every format."""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from safetensors.torch import load_file

from conftest import tiny_model
from impress_cache import ImpressConfig, ImpressStore
from impress_cache.storage import ALIGN, FORMATS, BlockReader, ReadRequest, iter_blocks

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _kv(layers, heads, n, dim, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    ks = [torch.randn(heads, n, dim, generator=g).to(dtype) for _ in range(layers)]
    vs = [torch.randn(heads, n, dim, generator=g).to(dtype) for _ in range(layers)]
    return ks, vs


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    fmt=st.sampled_from(sorted(FORMATS)),
    dtype=st.sampled_from(["float32", "float16", "bfloat16"]),
    layers=st.integers(1, 3),
    heads=st.integers(1, 3),
    dim=st.sampled_from([4, 8, 24]),
    n=st.integers(1, 70),
    chunk=st.integers(1, 33),
    seed=st.integers(0, 2**16),
    data=st.data(),
)
def test_any_blocks_round_trip(tmp_path_factory, fmt, dtype, layers, heads, dim, n, chunk, seed, data):
    if fmt == "hdf5" and dtype == "bfloat16":
        return  # HDF5 has no bfloat16; the store refuses that combination up front
    tdt = DTYPES[dtype]
    ks, vs = _kv(layers, heads, n, dim, tdt, seed)
    blocks = list(iter_blocks(ks, vs, chunk))
    path = tmp_path_factory.mktemp("chunks") / f"f.{fmt}"
    infos = FORMATS[fmt](fsync=False).write(path, blocks, {"k": "v"})
    assert all(i.offset % ALIGN == 0 for i in infos)
    want = data.draw(st.lists(st.sampled_from(range(len(infos))), min_size=1, unique=True))
    reader = BlockReader(threads=2)
    try:
        views, nbytes = reader.read(
            [ReadRequest(0, path, infos[i].offset, infos[i].nbytes, infos[i].crc32) for i in want]
        )
    finally:
        reader.close()
    assert nbytes >= sum(infos[i].nbytes for i in want)
    for i, view in zip(want, views):
        info = infos[i]
        got = torch.frombuffer(bytearray(view), dtype=tdt).view(2, heads, info.rows, dim)
        s = info.block * chunk
        assert torch.equal(got[0].view(torch.uint8), ks[info.layer][:, s : s + info.rows].contiguous().view(torch.uint8))
        assert torch.equal(got[1].view(torch.uint8), vs[info.layer][:, s : s + info.rows].contiguous().view(torch.uint8))


def test_safetensors_chunk_file_loads_with_safetensors(tmp_path):
    ks, vs = _kv(2, 2, 37, 8, torch.float16, 0)
    blocks = list(iter_blocks(ks, vs, 16))
    path = tmp_path / "x.safetensors"
    FORMATS["safetensors"](fsync=False).write(path, blocks, {"note": "test"})
    tensors = load_file(path)
    assert torch.equal(tensors["L1.B2"], torch.stack((ks[1][:, 32:], vs[1][:, 32:])))
    assert sum(1 for name in tensors if not name.startswith("__pad")) == len(blocks)


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


_MODEL = None


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
    from impress_cache.layout import PrefixLayout
    from impress_cache.radix import RadixNode, Segment

    heads, dim = 2, 3
    # piece i: rows file_row .. file_row + length of file i (blocks of `chunk` rows)
    segments = [Segment(RadixNode(i, tuple(range(n)), i, row), n) for i, (row, n) in enumerate(pieces)]
    files = {}
    for i, (row, n) in enumerate(pieces):
        g = torch.Generator().manual_seed(i)
        files[i] = torch.randn(2, heads, row + n, dim, generator=g)
    lay = PrefixLayout(segments, lambda _file: chunk)
    assert lay.length == sum(n for _, n in pieces)

    def block(u):  # the whole disk block of unit u (the last block of a file may be short)
        unit = lay.units[u]
        return files[unit.file_id][:, :, unit.block * chunk : (unit.block + 1) * chunk]

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
    keys, values = lay.gather(units, [block(u) for u in units], positions)
    for h in range(heads):
        pos = positions[h] if per_head else positions
        assert torch.equal(keys[h], expect[0, h, pos])
        assert torch.equal(values[h], expect[1, h, pos])
    # every position, from every unit
    all_units = list(range(len(lay.units)))
    keys, values = lay.gather(all_units, [block(u) for u in all_units])
    assert torch.equal(keys, expect[0]) and torch.equal(values, expect[1])
    if len(all_units) > 1:  # position 0 lies in unit 0, whose block is left out
        with pytest.raises(ValueError, match="not given"):
            lay.gather(all_units[1:], [block(u) for u in all_units[1:]], torch.tensor([0]))
