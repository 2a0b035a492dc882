"""Chunk-file formats: whatever blocks are written come back bit-identical, in every format."""

from __future__ import annotations

import hypothesis.strategies as st
import torch
from hypothesis import HealthCheck, given, settings
from safetensors.torch import load_file

from impress_cache.storage import ALIGN, FORMATS, BlockReader, Extent, iter_blocks

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
    bufs = [bytearray(infos[i].nbytes + 7) for i in want]  # destinations may be larger than blocks
    try:
        nbytes = reader.read_into(
            [Extent(0, path, infos[i].offset, infos[i].nbytes, infos[i].checksum, memoryview(b)) for i, b in zip(want, bufs)]
        )
    finally:
        reader.close()
    assert nbytes >= sum(infos[i].nbytes for i in want)
    for i, buf in zip(want, bufs):
        info = infos[i]
        got = torch.frombuffer(buf[: info.nbytes], dtype=tdt).view(2, heads, info.rows, dim)
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
