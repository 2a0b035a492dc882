"""A rewrite (reordering) of a node whose old file a request has leased: the request
keeps reading the old file through its lease, whichever thread applies the rewrite's
change set to the tree (`Catalog._follow` forgets a dropped file only once no lease of
this process holds it; the file is unlinked after the last lease)."""

from __future__ import annotations

import os

import torch

from test_reorder import _model, cfg, kv_of, put, scatter
from impress_cache import ImpressStore
from impress_cache.store.catalog import CHUNK_DIR


def test_a_leased_file_stays_readable_after_its_node_is_rewritten(tmp_path):
    toks = list(range(3, 67))  # 64 rows, 16 blocks of 4
    with ImpressStore(tmp_path, _model(), cfg()) as store:
        put(store, toks)
        for _ in range(4):
            scatter(store, toks)
        m = store.match(toks)
        (old_fid,) = {seg.file_id for seg in m.segments}
        old_name = store._catalog.records[old_fid].name
        # (a request's lease as the rewrite commits; one counted as activity would keep
        # the rewrite waiting between blocks, `test_rewrite_waits_for_requests_between_blocks`)
        lease = store._leases.hold([old_fid], request=False)
        # the request has opened the old file (its descriptor is kept with it)
        f = store._catalog.open_file(old_fid)
        loan = store._catalog.lend(f)
        assert loan is not None
        fd = loan.fd
        loan.release()  # (its reads done; the descriptor stays kept with the file)
        assert store.reorganize()["rewritten"] == 1
        assert old_fid not in store._catalog.records  # out of the index, and of the tree
        # the leased file is still this process's, its descriptor open: the request reads it
        assert store._catalog.open_file(old_fid) is f and f.fd == fd
        os.fstat(fd)
        loaded = store.load(m.segments)
        ks, vs = kv_of(toks)
        assert torch.equal(loaded.keys, torch.stack(ks)) and torch.equal(loaded.values, torch.stack(vs))
        assert (tmp_path / CHUNK_DIR / old_name).exists()
        lease.release()
        store._leases.unlinker.drain()
        # the last lease gone: forgotten and unlinked
        assert f.fd is None
        assert not (tmp_path / CHUNK_DIR / old_name).exists()
