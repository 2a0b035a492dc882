"""Never-wrong leftovers: a request whose matched node is rewritten before it leases it
reads the new file (no quarantine), a failed save of the statistics keeps them for the
next one, and block codes refuse numbers they cannot hold."""

from __future__ import annotations

import sqlite3

import numpy as np
import pytest
import torch

from conftest import VOCAB, tiny_model
from helpers import assert_same_as_uncached
from impress_cache import ImpressConfig, ImpressStore, StoreLimitError
from impress_cache.storage.base import MAX_BLOCKS, MAX_FILE_ID, MAX_LAYERS, block_code

CFG = dict(chunk_tokens=16, important_ratio=1.0, reorg_idle_ms=None, fsync=False)


def _doc(seed: int = 0, n: int = 150) -> torch.Tensor:
    return torch.randint(3, VOCAB, (1, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("rewriter", ["this store", "another store on the directory"])
def test_a_node_rewritten_between_match_and_lease_is_matched_again(tmp_path, rewriter):
    """The request matches, the rewrite commits (by this store, or by another one on the
    directory: another process's view), then the request leases: it matches again and
    reads the new file; nothing is quarantined."""
    model, doc = tiny_model(), _doc()
    with ImpressStore(tmp_path, model, ImpressConfig(**CFG)) as store:
        assert_same_as_uncached(model, store, doc)
        other = store if rewriter == "this store" else ImpressStore(tmp_path, model, ImpressConfig(**CFG))
        m = other.match(doc[0].numpy())
        imp = np.zeros((model.config.num_hidden_layers, m.length), np.float32)
        imp[:, ::4] = 1.0  # important rows in every block: a rewrite packs them
        other.record_importance(m.segments, imp)
        other._reorder.reorganizer._ratio = 0.25  # plans as a sparse store would; requests stay dense
        real_lease, rewrites = store.lease, []

        def lease(matches, share=1.0):  # the request has matched; the rewrite commits now
            if not rewrites:
                rewrites.append(other.reorganize(force=True))
            return real_lease(matches, share)

        store.lease = lease
        cache = assert_same_as_uncached(model, store, doc)
        assert rewrites[0]["rewritten"] == 1
        assert cache.stats.matched_tokens == doc.shape[1] - 1
        assert cache.stats.quarantined_files == 0 and store.stats()["quarantined_files"] == 0
        m = store.match(doc[0].numpy())
        assert all(store._catalog.perm_of(seg.file_id) is not None for seg in m.segments)
        if other is not store:
            other.close()


def test_a_failed_save_of_the_statistics_keeps_them_for_the_next(tmp_path):
    model, doc = tiny_model(), _doc(1)
    with ImpressStore(tmp_path, model, ImpressConfig(**CFG, stats_interval_s=1e9)) as store:
        assert_same_as_uncached(model, store, doc)
        conn = sqlite3.connect(tmp_path / "index.sqlite")
        for table in ("block_stats", "node_stats"):  # a real failure of the index write
            conn.execute(f"CREATE TRIGGER fail_{table} BEFORE INSERT ON {table} BEGIN SELECT RAISE(ABORT, 'injected'); END")
        conn.commit()
        conn.execute("DELETE FROM block_stats")
        conn.execute("DELETE FROM node_stats")
        conn.commit()
        assert_same_as_uncached(model, store, doc)  # its flush fails to save: logged, kept
        assert store.index.load_block_stats() == [] and len(store.index.load_node_stats()[0]) == 0
        for table in ("block_stats", "node_stats"):
            conn.execute(f"DROP TRIGGER fail_{table}")
        conn.commit()
        conn.close()
        written = store.save_block_stats()
        assert written == len(store.index.load_block_stats()) > 0
        assert len(store.index.load_node_stats()[0]) > 0  # node ids (and their columns)


def test_block_codes_refuse_what_they_cannot_hold():
    assert block_code(MAX_FILE_ID, MAX_LAYERS - 1, MAX_BLOCKS - 1) > 0
    codes = block_code(np.array([1, 2]), np.array([0, 1]), np.array([3, 4]))
    assert len(set(codes.tolist())) == 2
    for bad in ((MAX_FILE_ID + 1, 0, 0), (1, MAX_LAYERS, 0), (1, 0, MAX_BLOCKS), (1, 0, -1)):
        with pytest.raises(StoreLimitError, match="chunk_tokens"):
            block_code(*bad)
    with pytest.raises(StoreLimitError):
        block_code(np.array([1, 1]), np.array([0, 0]), np.array([0, MAX_BLOCKS]))


def test_a_lease_over_many_files_looks_at_other_processes_commits_once(tmp_path):
    """Whether a leased file left the index is asked once per lease, not once per file
    (each look is a query of the index's data version, and waits for its lock)."""
    model = tiny_model()
    with ImpressStore(tmp_path, model, ImpressConfig(**CFG)) as store:
        spec, toks = store.spec, _doc(n=160)[0]
        for n in range(20, 161, 20):  # each prompt extends the last one: a file per extension
            base = toks[:n].float()[None, :, None] + torch.arange(n).float()[None, :, None] / 1000
            keys = [base.expand(spec.num_kv_heads, n, spec.head_dim) + layer for layer in range(spec.num_layers)]
            store.put(toks[:n].tolist(), keys, [-k for k in keys])
        matches = [store.match(toks.numpy()), store.match(toks[:100].numpy())]
        files = {seg.file_id for m in matches for seg in m.segments}
        assert len(files) == 8
        before = store._catalog.refreshes
        lease = store.lease(matches)
        assert store._catalog.refreshes - before == 1
        assert not lease.stale and set(lease.file_ids) == files
        lease.release()
        # a file that left the index (another store on the directory evicted it) is still seen
        with ImpressStore(tmp_path, model, ImpressConfig(**CFG, disk_bytes=1)) as other:
            other.enforce_disk_budget()
        before = store._catalog.refreshes
        lease = store.lease(matches)
        assert store._catalog.refreshes - before == 1 and lease.stale
        lease.release()
