"""Exact reuse read straight into a layer's buffer (`store.direct`, `storage.placed`)."""

from __future__ import annotations

import shutil

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import HealthCheck, given, settings

from conftest import VOCAB, tiny_model
from helpers import assert_same_as_uncached, run
from impress_cache import CorruptBlockError, ImpressCache, ImpressConfig, ImpressStore
from impress_cache.storage import KV
from impress_cache.storage.placed import STAGE_BYTES
from impress_cache.store import CHUNK_DIR, QUARANTINE_DIR
from impress_cache.tools import drop_page_cache
from test_reorder import _model

TIERS_OFF = {"device_bytes": 0, "host_bytes": 0}


def _kv(layers, heads, n, dim, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    ks = [torch.randn(heads, n, dim, generator=g).to(dtype) for _ in range(layers)]
    vs = [torch.randn(heads, n, dim, generator=g).to(dtype) for _ in range(layers)]
    return ks, vs


def _buffer(store, rows, room):
    """A layer buffer as the dense loader makes it: ``[2, 1, heads, rows + room, dim]``, filled with NaN."""
    spec = store.spec
    return torch.full((2, 1, spec.num_kv_heads, rows + room, spec.head_dim), float("nan"), dtype=spec.torch_kv_dtype)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    lengths=st.lists(st.integers(2, 60), min_size=1, max_size=4),
    cut=st.integers(1, 59),
    chunk=st.integers(1, 20),
    room=st.integers(0, 9),
    kind=st.sampled_from([("safetensors", "float32"), ("safetensors", "bfloat16"), ("hdf5", "float32")]),
    seed=st.integers(0, 1000),
    direct_io=st.sampled_from([True, False, "auto"]),
    cold=st.booleans(),
)
def test_rows_read_into_a_buffer_are_the_stored_rows(tmp_path_factory, lengths, cut, chunk, room, kind, seed, direct_io, cold):
    """Prompts sharing prefixes are stored across files (partial first and last blocks,
    short last blocks; both chunk formats), read with or without ``O_DIRECT``, from the
    page cache or guest-cold; every row of every layer lands where the pool path puts
    it, and the rows after the prefix are left alone."""
    model = _model()
    g = torch.Generator().manual_seed(seed)
    base = torch.randint(3, 256, (60,), generator=g).tolist()
    fmt, dtype = kind
    cfg = ImpressConfig(chunk_tokens=chunk, fsync=False, kv_dtype=dtype, direct_io=direct_io, **TIERS_OFF)
    path = tmp_path_factory.mktemp("kv")
    with ImpressStore(path, model, cfg, storage_format=fmt) as store:
        spec = store.spec
        ks, vs = _kv(spec.num_layers, spec.num_kv_heads, 60, spec.head_dim, spec.torch_kv_dtype, seed)
        for n in lengths:
            store.put(base[:n], [k[:, :n] for k in ks], [v[:, :n] for v in vs])
        if cold:
            store.flush()
            drop_page_cache(path)
        q = base[: min(cut, max(lengths))]
        m = store.match(q)
        lay = store.layout(m.segments)
        before = _counted(store)
        for layer in range(spec.num_layers):
            buf = _buffer(store, len(q), room)
            read = store.start_rows(lay, layer, buf[:, 0, :, : len(q)])
            assert read is not None
            stats = read.result()
            assert stats.disk_blocks == len(lay.at(layer).units_all())
            assert torch.equal(buf[0, 0, :, : len(q)], ks[layer][:, : len(q)])
            assert torch.equal(buf[1, 0, :, : len(q)], vs[layer][:, : len(q)])
            assert bool(buf[:, :, :, len(q) :].float().isnan().all())
        direct = {k: v - before[k] for k, v in _counted(store).items()}
        before = _counted(store)
        store.load(m.segments)  # the pool path counts the same read the same way
        assert direct == {k: v - before[k] for k, v in _counted(store).items()}
        assert direct["blocks_read"] > 0


def _counted(store):
    s = store.stats()
    return {
        "blocks_read": s["blocks_read"], "kv_bytes_read_disk": s["kv_bytes_read_disk"],
        "important_rows_needed": s["important_rows_needed"], "disk_blocks": s["lookups"]["kv"]["disk"]["blocks"],
        "disk_bytes": s["lookups"]["kv"]["disk"]["bytes"], "invalid_io_ratio": s["invalid_io_ratio"],
    }


def test_the_pool_path_reads_where_rows_cannot_go_straight(tmp_path):
    """With the memory tiers on, a ``kv_codec`` or a destination of another dtype the
    direct read declines (the pool path reads, admits and decodes)."""
    model = _model()
    toks = list(range(3, 40))
    for cfg, dtype in (
        (ImpressConfig(chunk_tokens=8, fsync=False), None),
        (ImpressConfig(chunk_tokens=8, fsync=False, kv_codec="int8", **TIERS_OFF), None),
        (ImpressConfig(chunk_tokens=8, fsync=False, **TIERS_OFF), torch.float64),
    ):
        d = tmp_path / f"s{len(list(tmp_path.iterdir()))}"
        with ImpressStore(d, model, cfg) as store:
            spec = store.spec
            ks, vs = _kv(spec.num_layers, spec.num_kv_heads, len(toks), spec.head_dim, torch.float32, 0)
            store.put(toks, ks, vs)
            lay = store.layout(store.match(toks).segments)
            out = torch.empty(2, spec.num_kv_heads, len(toks), spec.head_dim, dtype=dtype or spec.torch_kv_dtype)
            assert store.start_rows(lay, 0, out) is None


def _flip_first_kv_block_byte(store, path, layer=0):
    """Flip a byte inside block 0 of ``layer``'s K/V (found through the block table)."""
    f = store._catalog.open_file(next(iter(store._catalog.records)))
    at = int(f.table.offsets[KV, layer, 0]) + 100
    raw = bytearray(f.path.read_bytes())
    raw[at] ^= 0xFF
    f.path.write_bytes(bytes(raw))


def test_a_damaged_byte_is_caught_before_its_block_is_placed(tmp_path):
    """A flipped byte in a block read straight into the buffer raises
    `CorruptBlockError` naming the file, and none of that block's rows reach the buffer."""
    model = _model()
    toks = list(range(3, 67))
    cfg = ImpressConfig(chunk_tokens=16, fsync=False, **TIERS_OFF)
    with ImpressStore(tmp_path, model, cfg) as store:
        spec = store.spec
        ks, vs = _kv(spec.num_layers, spec.num_kv_heads, len(toks), spec.head_dim, torch.float32, 1)
        store.put(toks, ks, vs)
        _flip_first_kv_block_byte(store, tmp_path)
        lay = store.layout(store.match(toks).segments)
        buf = _buffer(store, len(toks), 0)
        read = store.start_rows(lay, 0, buf[:, 0])
        assert read is not None
        with pytest.raises(CorruptBlockError) as err:
            read.result()
        assert err.value.file_id == next(iter(store._catalog.records))
        assert bool(buf[:, 0, :, :16].isnan().all())  # block 0: never placed
        # the other layers are intact and read exact
        read = store.start_rows(lay, 1, buf[:, 0])
        read.result()
        assert torch.equal(buf[0, 0], ks[1]) and torch.equal(buf[1, 0], vs[1])


def _record_direct(store):
    """Make ``store.start_rows`` record, per call, whether the direct path was taken."""
    calls = []
    start_rows = store.start_rows

    def counted(*args, **kwargs):
        got = start_rows(*args, **kwargs)
        calls.append(got is not None)
        return got

    store.start_rows = counted
    return calls


def test_exact_reuse_with_tiers_off_reads_straight_into_the_buffers(tmp_path):
    """generate with the tiers off takes the direct path for every layer and matches
    generate without a cache; a damaged file is quarantined and the output stays exact."""
    model = tiny_model("llama")
    doc = torch.randint(3, VOCAB, (1, 70), generator=torch.Generator().manual_seed(3))
    cfg = ImpressConfig(chunk_tokens=16, important_ratio=1.0, **TIERS_OFF)
    with ImpressStore(tmp_path, model, cfg) as store:
        assert_same_as_uncached(model, store, doc)
        calls = _record_direct(store)
        ids = torch.cat([doc, doc[:, :4]], dim=1)
        c = assert_same_as_uncached(model, store, ids)
        assert c.stats.matched_tokens == 70
        assert calls == [True] * model.config.num_hidden_layers
        assert c.stats.blocks_read == model.config.num_hidden_layers * 5
    with ImpressStore(tmp_path, model, cfg) as store:
        f = next((tmp_path / CHUNK_DIR).iterdir())
        _flip_first_kv_block_byte(store, tmp_path, layer=1)
        c = assert_same_as_uncached(model, store, ids)
        assert c.stats.recomputed_layers >= 1
        assert not f.exists() and any((tmp_path / QUARANTINE_DIR).iterdir())


def _int_stats(stats):
    """A request's counters (ints, no timings) as a dict."""
    return {k: v for k, v in vars(stats).items() if isinstance(v, int) and not isinstance(v, bool)}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_padded_batch_reads_the_same_as_the_pool_path(tmp_path, dtype):
    """Two left-padded batch rows with prefixes of different lengths (partial first and
    last blocks, stored across two files), the stored dtype float32 or bfloat16: the
    direct read gives the pool path's logits bit for bit and the same request counters."""
    model = _model()
    g = torch.Generator().manual_seed(5)
    doc = torch.randint(3, VOCAB, (1, 53), generator=g)
    cfg = ImpressConfig(chunk_tokens=7, important_ratio=1.0, kv_dtype=dtype, fsync=False, **TIERS_OFF)
    with ImpressStore(tmp_path / "a", model, cfg) as store:
        run(model, doc[:, :30], cache=ImpressCache(store))
        store.flush()
        run(model, doc, cache=ImpressCache(store))
    shutil.copytree(tmp_path / "a", tmp_path / "b")  # each run stores its prompt: the other reads a copy
    ids = torch.zeros(2, 60, dtype=torch.long)
    ids[0, 3:] = torch.cat([doc[0, :50], torch.tensor([9] * 7)])
    ids[1, 9:] = torch.cat([doc[0, :44], torch.tensor([11] * 7)])
    mask = (torch.arange(60) >= torch.tensor([[3], [9]])).long()
    with ImpressStore(tmp_path / "a", model, cfg) as store:
        calls = _record_direct(store)
        direct = ImpressCache(store)
        seq, logits = run(model, ids, mask, direct)
    assert calls == [True] * (2 * model.config.num_hidden_layers)
    with ImpressStore(tmp_path / "b", model, cfg) as store:
        store.start_rows = lambda *args, **kwargs: None  # the pool path
        pool = ImpressCache(store)
        seq_pool, logits_pool = run(model, ids, mask, pool)
    assert direct.stats.reused_columns == pool.stats.reused_columns > 40
    assert torch.equal(seq, seq_pool) and torch.equal(logits, logits_pool)
    assert _int_stats(direct.stats) == _int_stats(pool.stats)


def test_disk_bytes_are_counted_as_the_pool_path_counts_them(tmp_path):
    """Blocks that are not 4 KiB multiples (padding between them) and a layer longer
    than a staging buffer: the bytes read from the device (gaps inside a read included)
    are those the pool path reports for the same layer."""
    model = _model()
    cfg = ImpressConfig(chunk_tokens=15, fsync=False, **TIERS_OFF)  # 15 rows of 256 bytes: 3840, padded to 4096
    n = 4500  # 300 blocks: three staging runs, in two shares
    with ImpressStore(tmp_path, model, cfg) as store:
        spec = store.spec
        ks, vs = _kv(spec.num_layers, spec.num_kv_heads, n, spec.head_dim, spec.torch_kv_dtype, 2)
        toks = [3 + i % 200 for i in range(n)]
        store.put(toks, ks, vs)
        lay = store.layout(store.match(toks).segments)
        assert n * spec.kv_row_bytes > 2 * STAGE_BYTES
        for layer in range(spec.num_layers):
            buf = _buffer(store, n, 0)
            direct = store.start_rows(lay, layer, buf[:, 0]).result()
            pool = store.start_layout(lay, KV, [layer], lay.at(layer).units_all(), place_hits=False).result().stats
            assert (direct.disk_bytes, direct.disk_blocks) == (pool.disk_bytes, pool.disk_blocks)
            assert torch.equal(buf[0, 0], ks[layer]) and torch.equal(buf[1, 0], vs[layer])


def test_a_linked_file_is_filled_then_read_straight_into_the_buffers(bucket, tmp_path):
    """Host a stores a document; host b, tiers off, links it with a sparse request (only
    the selected blocks arrive), then reuses it exactly: the direct read makes the rest
    of every layer's blocks present first (`before`) and the output matches generate
    without a cache."""
    from conftest import BUCKET

    server, prefix, _ = bucket
    model = _model()
    doc = torch.randint(3, VOCAB, (1, 150), generator=torch.Generator().manual_seed(4))
    remote = {"remote": f"s3://{BUCKET}/{prefix}", "remote_options": server.options, "remote_retry_s": 0.5}
    with ImpressStore(tmp_path / "a", model, ImpressConfig(chunk_tokens=16, important_ratio=1.0, fsync=False, **remote)) as a:
        assert_same_as_uncached(model, a, doc)
    sparse = ImpressConfig(chunk_tokens=16, important_ratio=0.25, decode="keep", prefetch=False, fsync=False, **TIERS_OFF, **remote)
    tail = torch.randint(3, VOCAB, (1, 8), generator=torch.Generator().manual_seed(9))
    with ImpressStore(tmp_path / "b", model, sparse) as b:
        c = ImpressCache(b)
        run(model, torch.cat([doc, tail], dim=1), cache=c)
        assert c.stats.matched_tokens == 150
    exact = ImpressConfig(chunk_tokens=16, important_ratio=1.0, fsync=False, **TIERS_OFF, **remote)
    with ImpressStore(tmp_path / "b", model, exact) as b:
        fid = b.match(doc[0].numpy()).segments[0].file_id
        assert b._io.fill is not None and b._io.fill.linked(b._catalog.records[fid].name, fid)
        calls = _record_direct(b)
        c = assert_same_as_uncached(model, b, torch.cat([doc, tail[:, :3]], dim=1))
        assert c.stats.matched_tokens == 150 and c.stats.recomputed_layers == 0
        assert calls == [True] * model.config.num_hidden_layers


def test_a_damaged_first_layer_recomputes_while_later_layers_are_in_flight(tmp_path):
    """Six layers, the first one's block damaged: the loader has the next layers' direct
    reads in flight into buffers of their own when the first fails; the request
    quarantines the file and recomputes every layer, and the output is exact (no late
    reader writes into a buffer the model uses)."""
    model = tiny_model("llama", num_hidden_layers=6)
    doc = torch.randint(3, VOCAB, (1, 300), generator=torch.Generator().manual_seed(6))
    cfg = ImpressConfig(chunk_tokens=16, important_ratio=1.0, **TIERS_OFF)
    with ImpressStore(tmp_path, model, cfg) as store:
        assert_same_as_uncached(model, store, doc)
    ids = torch.cat([doc, doc[:, :5]], dim=1)
    with ImpressStore(tmp_path, model, cfg) as store:
        _flip_first_kv_block_byte(store, tmp_path, layer=0)
        c = assert_same_as_uncached(model, store, ids)
        assert c.stats.recomputed_layers == 6 and c.stats.quarantined_files == 1
        assert_same_as_uncached(model, store, ids)  # the file is gone: nothing (or less) reused, still exact
