"""Slabs: a resident prefix's layers served as one view of the memory tiers (store/slabs.py)."""

from __future__ import annotations

import pytest
import torch

from conftest import VOCAB, tiny_model
from helpers import assert_same_as_uncached
from impress_cache import ImpressConfig, ImpressStore
from impress_cache.storage.base import KV
from impress_cache.tiers import DEVICE, HOST
from test_tiers_in_store import _reuse as _exact_reuse  # (a request reusing the store, checked exact)

CT = 16
BLOCK = 2 * 2 * CT * 16 * 4  # tiny llama: 2 KV heads, head_dim 16, float32


def _tok(seed: int, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (1, n), generator=g)


def _cfg(**kw) -> ImpressConfig:
    return ImpressConfig(chunk_tokens=CT, fsync=False, important_ratio=1.0, **kw)


@pytest.fixture
def model():
    return tiny_model("llama")


def _layout(store: ImpressStore, doc: torch.Tensor):
    return store.layout(store.match(doc[0].tolist()).segments)


def _disk_rows(store: ImpressStore, lay, layer: int) -> torch.Tensor:
    """The layer's rows as the per-block read path gives them: ``[2, heads, P, dim]``."""
    view = lay.at(layer)
    units = view.units_all()
    k, v = view.gather(units, store.read_blocks(lay.keys(units, KV, layer)))
    return torch.stack([k, v])


def test_a_prefix_read_once_is_served_from_one_slab_per_layer_and_stays_exact(tmp_path, model):
    doc = _tok(0, 90)  # 5 whole blocks and a short one
    with ImpressStore(tmp_path, model, _cfg()) as store:
        assert_same_as_uncached(model, store, doc, new_tokens=3)
    with ImpressStore(tmp_path, model, _cfg()) as store:
        lay = _layout(store, doc)
        assert store.resident_rows(lay, 0) is None  # nothing in memory yet
        _exact_reuse(model, store, torch.cat([doc, _tok(1, 5)], dim=1))  # from disk, into slabs
        assert store.tiers.group_count == store.spec.num_layers
        store.reset_stats()
        views = [store.resident_rows(lay, layer) for layer in range(store.spec.num_layers)]
        for layer, parts in enumerate(views):
            assert parts is not None and len(parts) == 1 and parts[0].shape[2] == 90
            assert torch.equal(parts[0], _disk_rows(store, lay, layer))
        s = store.stats()
        blocks = 6 * store.spec.num_layers
        assert s["lookups"]["kv"]["device"]["blocks"] == 2 * blocks  # the slabs', then read_blocks'
        assert s["tiers"]["device"]["hits"] == 2 * blocks and s["bytes_read_disk"] == 0
        key = (lay.units[0].file_id, KV, 0, 0)
        assert store.tiers.export_stats([key])[key]["count"] == 3  # first read, the slab, read_blocks
        cache = _exact_reuse(model, store, torch.cat([doc, _tok(2, 7)], dim=1))
        assert cache.stats.bytes_read_disk == 0 and cache.stats.matched_tokens == 90


def test_a_slab_with_an_evicted_block_is_never_served_and_the_prefix_stays_exact_and_regroups(tmp_path, model):
    doc = _tok(3, 80)
    with ImpressStore(tmp_path, model, _cfg()) as store:
        assert_same_as_uncached(model, store, doc, new_tokens=3)
    with ImpressStore(tmp_path, model, _cfg()) as store:
        ids = torch.cat([doc, _tok(4, 6)], dim=1)
        _exact_reuse(model, store, ids)
        lay = _layout(store, doc)
        before = store.resident_rows(lay, 1)[0].clone()
        fid = lay.units[0].file_id
        assert store.tiers.evict((fid, KV, 1, 2))  # one block of layer 1
        assert store.resident_rows(lay, 1) is None and store.resident_rows(lay, 0) is not None
        others = [store.tiers.get((fid, KV, 1, b)) for b in (0, 1, 3, 4)]
        assert all(o is not None and o[1].is_contiguous() for o in others)  # copies of their own
        store.reset_stats()
        cache = _exact_reuse(model, store, ids)
        assert cache.stats.bytes_read_disk == BLOCK  # the evicted block only
        assert torch.equal(_disk_rows(store, lay, 1), before)
        # the block read again is a slab of its own, the runs of hits beside it slabs again
        parts = store.resident_rows(lay, 1)
        assert [p.shape[2] for p in parts] == [2 * CT, CT, 80 - 3 * CT]
        assert torch.equal(torch.cat(parts, dim=2), before)
        assert torch.equal(store.resident_rows(lay, 0)[0], _disk_rows(store, lay, 0))
        store.tiers._check_invariants()


def test_a_quarantined_file_drops_its_slabs(tmp_path, model):
    doc = _tok(5, 64)
    with ImpressStore(tmp_path, model, _cfg()) as store:
        assert_same_as_uncached(model, store, doc, new_tokens=3)
    with ImpressStore(tmp_path, model, _cfg()) as store:
        _exact_reuse(model, store, torch.cat([doc, _tok(6, 4)], dim=1))
        lay = _layout(store, doc)
        rec = store._catalog.records[lay.units[0].file_id]
        assert store.resident_rows(lay, 0) is not None
        store.quarantine(rec.id, "test")
        assert store.tiers.group_count == 0 and store.tiers.used_bytes(DEVICE) == 0
        assert store.resident_rows(lay, 0) is None
        assert store.match(doc[0].tolist()).length == 0
        assert_same_as_uncached(model, store, torch.cat([doc, _tok(7, 4)], dim=1), new_tokens=3)


@pytest.mark.parametrize("tiers", [{"device_bytes": 7 * BLOCK, "host_bytes": 0},
                                   {"device_bytes": 3 * BLOCK, "host_bytes": 5 * BLOCK}])
def test_budgets_hold_with_slabs_and_requests_stay_exact(tmp_path, model, tiers):
    """Small budgets: slabs form only where a whole run was admitted, evictions dissolve
    them, the tiers stay within budget and every request is exact."""
    docs = [_tok(10 + i, 48 + 16 * i) for i in range(3)]
    with ImpressStore(tmp_path, model, _cfg()) as store:
        for doc in docs:
            assert_same_as_uncached(model, store, doc, new_tokens=3)
    with ImpressStore(tmp_path, model, _cfg(policy="lru", **tiers)) as store:
        for rnd in range(3):
            for i, doc in enumerate(docs):
                _exact_reuse(model, store, torch.cat([doc, _tok(20 + rnd, 3 + i)], dim=1))
                store.tiers._check_invariants()
                assert store.tiers.used_bytes(DEVICE) <= tiers["device_bytes"]
                assert store.tiers.used_bytes(HOST) <= tiers["host_bytes"]
        # every resident block's payload either is a view of an intact slab or owns its storage
        for key, entry in store.tiers._where.items():
            grouped = key in store.tiers._group_of
            assert grouped or entry.payload.untyped_storage().nbytes() == entry.nbytes
