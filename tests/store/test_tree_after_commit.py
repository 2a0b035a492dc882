"""The in-memory tree changes only from committed state (issue 25).

The disk budget (on its own, or inside a write's transaction) and quarantine delete
nodes and files in an index transaction. They used to take the nodes out of the
in-memory tree and the file table inside that transaction: another thread saw removals
that could still roll back, and a rollback had to reload the whole tree. Now every path
collects its deletions (`TreeChanges`) and applies them once ``COMMIT`` has returned.

Every test forces an interleaving on the store's real SQLite connection (its ``COMMIT``
held, failed, or another process let in before its ``BEGIN``) and ends by comparing the
tree and the file table with the index, read with plain SQL and by a fresh open.
"""

from __future__ import annotations

import sqlite3
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from impress_cache import ImpressStore
from impress_cache.index.sqlite import Index
from impress_cache.store.catalog import Catalog
from test_budget import prompts
from test_commit_handover import WAIT_S, _done_while_held, _in_thread, _waiting, held_commit
from test_invariants import PATHS, _evict_all_elsewhere, _hooked, _nodes_inside_files
from test_reorder import _model, assert_reads_exact, cfg, put


def tree_rows(store: ImpressStore) -> tuple[set[tuple], set[int]]:
    """The store's in-memory tree (one row per node, as the index keeps it) and the ids
    of its file table."""
    catalog = store._catalog
    with catalog.lock:
        nodes = {(n.id, n.parent.id, n.file_id, n.file_row, n.length, n.terminal) for n in catalog.tree.nodes()}
        return nodes, set(catalog.records)


def index_rows(path: Path) -> tuple[set[tuple], set[int]]:
    """The same, read from the index with plain SQL."""
    conn = sqlite3.connect(path / "index.sqlite")
    try:
        nodes = set(conn.execute("SELECT id, parent, file_id, file_row, length, terminal FROM nodes").fetchall())
        files = {fid for (fid,) in conn.execute("SELECT id FROM files")}
    finally:
        conn.close()
    return nodes, files


def assert_tree_is_the_index(store: ImpressStore, path: Path) -> None:
    """The tree equals the index: as SQL reads it, and as a fresh open loads it."""
    mine = tree_rows(store)
    assert mine == index_rows(path)
    with ImpressStore(path, _model(), cfg(), read_only=True) as fresh:
        assert tree_rows(fresh) == mine
    _nodes_inside_files(path)


def _count_reloads(monkeypatch) -> list[int]:
    real = Catalog.reload_tree
    calls: list[int] = []

    def counted(self):
        calls.append(1)
        return real(self)

    monkeypatch.setattr(Catalog, "reload_tree", counted)
    return calls


def _stored(store: ImpressStore, n: int, seed: int) -> list[list[int]]:
    toks = prompts(seed, n)
    for t in toks:
        put(store, t)
        store.match(t)  # (every file open: a match while a commit is held reads no index)
    return toks


def _leaf_file(store: ImpressStore, toks: list[int]) -> tuple[int, int]:
    seg = store.match(toks).segments[-1]
    return seg.node.id, seg.file_id


def _evict(store: ImpressStore) -> dict:
    store.config.disk_bytes = 1  # everything free may go
    try:
        return store.enforce_disk_budget()
    finally:
        store.config.disk_bytes = None


# -- the tree does not change before COMMIT ------------------------------------------------
@pytest.mark.parametrize("path", ["budget", "quarantine"])
def test_removals_reach_the_tree_only_after_their_commit(tmp_path, path):
    """While the removal's ``COMMIT`` is held, the tree and the file table still hold what
    it removes; once it has returned, both follow the index."""
    with ImpressStore(tmp_path, _model(), cfg()) as store:
        toks = _stored(store, 3, 1)
        node, fid = _leaf_file(store, toks[0])
        catalog = store._catalog
        with held_commit(store) as held:
            held.armed = True
            if path == "budget":
                worker, out = _in_thread(_evict, store)
            else:
                worker, out = _in_thread(store.quarantine, fid, "a test")
            assert held.reached.wait(WAIT_S)
            # (read without the catalog's lock, which the removal holds: it waits in COMMIT)
            assert catalog.tree.get(node) is not None and fid in catalog.records
            held.go.set()
            worker.join(WAIT_S)
            assert not worker.is_alive() and out and not isinstance(out[0], BaseException), out
        assert catalog.tree.get(node) is None and fid not in catalog.records
        assert store.match(toks[0]).length < len(toks[0])
        assert_tree_is_the_index(store, tmp_path)


def test_a_write_that_evicts_changes_the_tree_only_after_its_commit(tmp_path):
    """A write whose own transaction evicts (the budget inside the write) lets the catalog's
    lock go for its ``COMMIT``: meanwhile requests still match the prefix it evicts."""
    with ImpressStore(tmp_path, _model(), cfg()) as store:
        (a,) = _stored(store, 1, 2)
        (b,) = prompts(3, 1)
        node, fid = _leaf_file(store, a)
        store.config.disk_bytes = store.disk_bytes()  # b's write must evict a
        with held_commit(store) as held:
            held.armed = True
            writer, failed = _in_thread(put, store, b)
            assert held.reached.wait(WAIT_S)
            assert _done_while_held(store.match, a).length == len(a)
            assert fid in store._catalog.records
            held.go.set()
            writer.join(WAIT_S)
            assert not writer.is_alive() and failed == [None]
        store.config.disk_bytes = None
        assert store.match(a).length == 0 and store.stats()["prefixes_evicted"] == 1
        assert assert_reads_exact(store, b) == len(b)
        assert_tree_is_the_index(store, tmp_path)


# -- a rollback leaves the tree as the index has it ----------------------------------------
def _fail_statement(monkeypatch, name: str) -> list[int]:
    """``Index.name`` raises the first time it runs (a statement of the removal, after the
    point where the tree used to be changed)."""
    real = getattr(Index, name)
    calls: list[int] = []

    def failing(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise sqlite3.OperationalError("disk I/O error (injected)")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Index, name, failing)
    return calls


@pytest.mark.parametrize("fails", ["statement", "commit"])
@pytest.mark.parametrize("path", ["budget", "quarantine", "write"])
def test_a_removal_that_rolls_back_leaves_the_tree_equal_to_the_index(tmp_path, monkeypatch, path, fails):
    """The removal's transaction fails after its first deletion (a statement, or its
    ``COMMIT``): nothing changed in the tree, which is not reloaded, still equals the
    index, and every prompt still reads back exactly; the removal succeeds when tried
    again."""
    with ImpressStore(tmp_path, _model(), cfg()) as store:
        toks = _stored(store, 3, 4)
        before = tree_rows(store)
        node, fid = _leaf_file(store, toks[0])
        extra = prompts(5, 1)[0]
        reloads = _count_reloads(monkeypatch)
        if fails == "statement":
            calls = _fail_statement(monkeypatch, "unreferenced_files" if path == "quarantine" else "delete_file_if_unreferenced")
        if path == "write":
            store.config.disk_bytes = store.disk_bytes()  # the write must evict in its transaction
        with held_commit(store) as held:
            held.armed = held.fail = fails == "commit"
            held.go.set()
            if path == "budget":
                with pytest.raises(Exception):
                    _evict(store)
            elif path == "quarantine":
                with pytest.raises(Exception):
                    store.quarantine(fid, "a test")
            else:
                put(store, extra)  # a failed write is dropped, counted, not raised
                assert store.stats()["write_failures"] == 1
        assert fails == "commit" or calls, "the failing statement was not reached"
        assert reloads == []  # (the tree was never touched: nothing to undo)
        assert tree_rows(store) == before
        monkeypatch.undo()
        store.config.disk_bytes = None
        assert_tree_is_the_index(store, tmp_path)
        for t in toks:
            assert assert_reads_exact(store, t) == len(t)
        if path == "budget":
            assert _evict(store)["removed_prefixes"] > 0
        elif path == "quarantine":
            assert store.quarantine(fid, "a test")
        else:
            store.config.disk_bytes = store.disk_bytes()
            put(store, extra)
            store.config.disk_bytes = None
            assert assert_reads_exact(store, extra) == len(extra)
        assert_tree_is_the_index(store, tmp_path)


# -- another thread between a plan and its commit ------------------------------------------
def test_a_quarantine_waits_for_an_eviction_committing_the_same_file(tmp_path):
    """The budget's transaction removes a file and is held in ``COMMIT``; another thread
    quarantines that file meanwhile. It waits for the eviction, then finds the file gone
    from the index: nothing is quarantined, and the tree follows the index."""
    with ImpressStore(tmp_path, _model(), cfg()) as store:
        toks = _stored(store, 3, 6)
        node, fid = _leaf_file(store, toks[0])
        with held_commit(store) as held:
            held.armed = True
            evictor, evicted = _in_thread(_evict, store)
            assert held.reached.wait(WAIT_S)
            quarantine, out = _in_thread(store.quarantine, fid, "a test")
            quarantine.join(0.3)
            assert quarantine.is_alive()  # (it waits for the catalog's lock)
            assert store._catalog.tree.get(node) is not None
            held.go.set()
            for t in (evictor, quarantine):
                t.join(WAIT_S)
                assert not t.is_alive()
        assert out == [False] and evicted[0]["removed_prefixes"] >= 3
        assert store.stats()["quarantined_files"] == 0
        assert not (tmp_path / "quarantine").exists() or not any((tmp_path / "quarantine").iterdir())
        assert_tree_is_the_index(store, tmp_path)


def test_an_eviction_waits_for_a_quarantine_committing(tmp_path):
    """The other way round: a quarantine is held in ``COMMIT``; the budget meanwhile waits,
    then removes what is left, not the quarantined nodes a second time."""
    with ImpressStore(tmp_path, _model(), cfg()) as store:
        toks = _stored(store, 3, 7)
        node, fid = _leaf_file(store, toks[0])
        with held_commit(store) as held:
            held.armed = True
            quarantine, out = _in_thread(store.quarantine, fid, "a test")
            assert held.reached.wait(WAIT_S)
            evictor, evicted = _in_thread(_evict, store)
            evictor.join(0.3)
            assert evictor.is_alive()
            held.go.set()
            for t in (quarantine, evictor):
                t.join(WAIT_S)
                assert not t.is_alive()
        assert out == [True] and not isinstance(evicted[0], BaseException), evicted
        assert store.stats()["quarantined_files"] == 1
        assert len(store.tree) == 0
        assert_tree_is_the_index(store, tmp_path)


def test_a_quarantine_during_a_writes_eviction_commit(tmp_path):
    """A write's transaction evicts prompt a and lets the catalog's lock go for its
    ``COMMIT``; another thread quarantines a's file meanwhile. The quarantine waits for
    the write to apply its commit (without the lock: requests still match a), then finds
    a's file gone: nothing to quarantine."""
    with ImpressStore(tmp_path, _model(), cfg()) as store:
        (a,) = _stored(store, 1, 8)
        (b,) = prompts(9, 1)
        node, fid = _leaf_file(store, a)
        store.config.disk_bytes = store.disk_bytes()
        with held_commit(store) as held:
            held.armed = True
            writer, failed = _in_thread(put, store, b)
            assert held.reached.wait(WAIT_S)
            quarantine, out = _in_thread(store.quarantine, fid, "a test")
            _waiting()
            assert _done_while_held(store.match, a).length == len(a)
            held.go.set()
            for t in (writer, quarantine):
                t.join(WAIT_S)
                assert not t.is_alive()
        assert failed == [None] and out == [False]
        store.config.disk_bytes = None
        assert store.stats()["quarantined_files"] == 0 and store.stats()["prefixes_evicted"] == 1
        assert assert_reads_exact(store, b) == len(b)
        assert_tree_is_the_index(store, tmp_path)


def test_threads_evicting_quarantining_and_writing_at_once_keep_the_tree_equal_to_the_index(tmp_path):
    """A few threads write, read, evict and quarantine at random for a moment; at the end
    the tree equals the index and every prompt still stored reads back exactly."""
    import random

    pool = prompts(10, 10)
    stop = threading.Event()
    errors: list[BaseException] = []
    with ImpressStore(tmp_path, _model(), cfg()) as store:
        base = store.disk_bytes()
        for t in pool[:4]:
            put(store, t)
        prefix = store._catalog.chunk_bytes // 4
        store.config.disk_bytes = base + 3 * prefix

        def run(seed: int) -> None:
            rnd = random.Random(seed)
            try:
                while not stop.is_set():
                    toks = rnd.choice(pool)
                    op = rnd.random()
                    if op < 0.5:
                        put(store, toks)
                    elif op < 0.8:
                        _read_leased(store, toks)
                    elif op < 0.9:
                        store.enforce_disk_budget()
                    else:
                        m = store.match(toks)
                        if m.segments:
                            store.quarantine(m.segments[-1].file_id, "a test")
            except BaseException as exc:  # noqa: BLE001 - checked below
                errors.append(exc)

        threads = [threading.Thread(target=run, args=(s,), daemon=True) for s in range(3)]
        for t in threads:
            t.start()
        stop.wait(4.0)
        stop.set()
        for t in threads:
            t.join(WAIT_S)
            assert not t.is_alive()
        assert errors == []
        store.flush()
        assert store.stats()["write_failures"] == 0 and store.stats()["after_commit_failures"] == 0
        store.config.disk_bytes = None
        assert_tree_is_the_index(store, tmp_path)
        for toks in pool:
            assert assert_reads_exact(store, toks) >= 0


def _read_leased(store: ImpressStore, toks: list[int]) -> None:
    """A request's read: match, lease, load, compare (a file removed between the match and
    the lease is seen as such, and one quarantined meanwhile as a failed read)."""
    from impress_cache.errors import CorruptBlockError
    from test_reorder import kv_of
    import torch

    m = store.match(toks)
    if not m.length:
        return
    with store.lease([m]) as lease:
        if lease.stale:
            return
        try:
            loaded = store.load(m.segments)
        except CorruptBlockError as exc:  # quarantined by another thread after the match
            store.quarantine(exc.file_id, str(exc))
            return
        ks, vs = kv_of(toks[: m.length])
        assert torch.equal(loaded.keys, torch.stack(ks)) and torch.equal(loaded.values, torch.stack(vs))


# -- another process between a plan and its commit ----------------------------------------
_QUARANTINE = """
import sys
sys.path[:0] = {paths!r}
from impress_cache import ImpressStore
from test_reorder import _model, cfg
with ImpressStore({store!r}, _model(), cfg()) as store:
    print(int(store.quarantine({file_id}, "another process")))
"""


def _quarantine_elsewhere(path: Path, file_id: int) -> int:
    proc = subprocess.run(
        [sys.executable, "-c", _QUARANTINE.format(paths=PATHS, store=str(path), file_id=file_id)],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return int(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("here", ["budget", "quarantine"])
@pytest.mark.parametrize("there", ["budget", "quarantine"])
def test_another_process_removing_before_the_transaction_begins(tmp_path, here, there):
    """Another process evicts everything (``budget``) or quarantines the first prompt's
    file (``quarantine``) right before this process's removal takes the index's write
    lock; this process looked at the index before that. Its transaction plans from what
    the other process committed: nothing is removed twice, nothing fails, and the tree
    equals the index."""
    with ImpressStore(tmp_path, _model(), cfg()) as store:
        toks = _stored(store, 3, 12)
        node, fid = _leaf_file(store, toks[0])
        if there == "budget":
            hook = _hooked(store, lambda: _evict_all_elsewhere(tmp_path))
        else:
            hook = _hooked(store, lambda: _quarantine_elsewhere(tmp_path, fid))
        hook.armed = True
        if here == "budget":
            result = _evict(store)
            assert hook.ran >= 1
            assert len(store.tree) == 0
            assert result["removed_prefixes"] == (0 if there == "budget" else 2)
        else:
            assert store.quarantine(fid, "a test") is False  # gone already: not counted here
            assert hook.ran >= 1
            assert store._catalog.tree.get(node) is None
        assert store.stats()["write_failures"] == 0 and store.stats()["after_commit_failures"] == 0
        assert_tree_is_the_index(store, tmp_path)
        for t in toks:
            put(store, t)
            assert assert_reads_exact(store, t) == len(t)
        assert_tree_is_the_index(store, tmp_path)
