"""Requests do not wait for the disk while the store writes.

A write's ``COMMIT`` waits for the disk (fsync); so does a statistics save. Both hold
the index while they do, not the catalog's lock that requests take to match, lease and
open files. A write whose tree changed while its commit ran (another thread changed it)
reads the tree again from the index instead of applying its plan to a tree it no longer
fits. The connection below is the store's real SQLite connection; only its ``COMMIT`` is
held until the test lets it go.
"""

from __future__ import annotations

import sqlite3
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from impress_cache import ImpressStore
from test_budget import prompts
from test_reorder import _model, assert_reads_exact, cfg, kv_of, put

WAIT_S = 30.0


class _HeldCommit:
    """The store's SQLite connection; once `armed`, its next ``COMMIT`` signals
    `reached` and waits for `go`."""

    def __init__(self, conn: Any) -> None:
        self._conn = conn
        self.armed = False
        self.fail = False  # the held COMMIT fails (as on a full disk) instead
        self.reached = threading.Event()
        self.go = threading.Event()
        self.commits = 0
        self.level = -1  # SQLite's synchronous setting at the last COMMIT

    def execute(self, sql: str, *args: Any) -> Any:
        if sql == "COMMIT":
            self.commits += 1
            self.level = self._conn.execute("PRAGMA synchronous").fetchone()[0]  # (1: NORMAL, 2: FULL)
            if self.armed:
                self.armed = False
                self.reached.set()
                assert self.go.wait(WAIT_S)
                if self.fail:
                    raise sqlite3.OperationalError("disk I/O error")
        return self._conn.execute(sql, *args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._conn, name)


@contextmanager
def held_commit(store: ImpressStore):
    index = store.index
    real = index._conn
    held = _HeldCommit(real)
    index._conn = held
    try:
        yield held
    finally:
        held.go.set()
        index._conn = real


def _in_thread(fn, *args) -> tuple[threading.Thread, list]:
    out: list = []

    def run() -> None:
        try:
            out.append(fn(*args))
        except BaseException as exc:  # noqa: BLE001 - checked by the test
            out.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


def _waiting() -> None:
    """Until a thread waits in `Catalog.transaction` for the index's write lock (which
    the held write or save keeps, while the catalog's lock stays free)."""
    deadline = time.monotonic() + WAIT_S
    while not any(_waits_in_transaction(frame) for frame in sys._current_frames().values()):
        assert time.monotonic() < deadline, "nobody waits for the write"
        time.sleep(0.001)


def _waits_in_transaction(frame: Any) -> bool:
    names = []
    while frame is not None:
        names.append((frame.f_code.co_name, Path(frame.f_code.co_filename).name))
        frame = frame.f_back
    # (the lock's Python `acquire` with the lock-order checks the suite turns on; a plain lock's is C code)
    return bool(names) and names[0][0] in ("acquire", "transaction") and ("transaction", "catalog.py") in names


def _planned_match(store: ImpressStore, toks: list[int]) -> int:
    """What a transaction begun now plans from: its tree's match of ``toks``."""
    with store._catalog.transaction():
        return store._catalog.tree.match(toks).length


def _done_while_held(fn, *args) -> Any:
    """``fn(*args)`` on another thread, which must finish while the commit is held."""
    t, out = _in_thread(fn, *args)
    t.join(WAIT_S / 3)
    assert not t.is_alive(), f"{fn.__name__} waited for the held commit"
    assert out and not isinstance(out[0], BaseException), out
    return out[0]


def test_requests_match_and_lease_while_a_write_commits(tmp_path):
    a, b = prompts(1, 2)
    with ImpressStore(tmp_path, _model(), cfg(fsync=True)) as store:
        put(store, a)
        store.match(a)
        with held_commit(store) as held:
            held.armed = True
            writer, failed = _in_thread(put, store, b)
            assert held.reached.wait(WAIT_S)
            # the write's transaction is committing: the tree is as it planned (b not yet in it)
            m = _done_while_held(store.match, a)
            assert m.length == len(a)
            lease = _done_while_held(store.lease, [m])
            assert not lease.stale  # a's files are still indexed
            lease.release()
            assert _done_while_held(store.match, b).length < len(b)
            held.go.set()
            writer.join(WAIT_S)
            assert not writer.is_alive() and failed == [None]
            assert held.level == 2  # a prompt's commit waits for the disk (synchronous=FULL)
        assert assert_reads_exact(store, b) == len(b)
        assert assert_reads_exact(store, a) == len(a)


def test_a_tree_changed_during_the_commit_is_read_again(tmp_path):
    a, b, c = prompts(2, 3)
    with ImpressStore(tmp_path, _model(), cfg()) as store:
        put(store, a)
        put(store, c)
        leaf_c = store.match(c).segments[-1]
        with held_commit(store) as held:
            held.armed = True
            writer, failed = _in_thread(put, store, b)
            assert held.reached.wait(WAIT_S)
            catalog = store._catalog
            with catalog.lock:  # another thread changes the tree meanwhile (here: drops c's leaf from it only,
                # which the index's change log does not know: such a tree is marked stale)
                node = next(n for n in catalog.tree.nodes() if n.file_id == leaf_c.file_id and not n.children)
                catalog.tree.remove(node)
                catalog.mark_stale()
                assert catalog.tree.match(c).length < len(c)
            held.go.set()
            writer.join(WAIT_S)
            assert not writer.is_alive() and failed == [None]
        # the write did not apply its plan to the changed tree: it read the tree from the
        # index, which has b (just committed) and still has c
        for toks in (a, b, c):
            assert assert_reads_exact(store, toks) == len(toks)
        assert store.stats()["after_commit_failures"] == 0


def test_a_statistics_save_is_one_transaction_and_requests_match_meanwhile(tmp_path):
    a, b = prompts(3, 2)
    with ImpressStore(tmp_path, _model(), cfg(host_bytes=1 << 20)) as store:
        put(store, a)
        put(store, b)
        for toks in (a, b):
            m = store.match(toks)
            store.load(m.segments)  # marks blocks and nodes: statistics to save
        with held_commit(store) as held:
            held.armed = True
            saver, out = _in_thread(store.save_block_stats)
            assert held.reached.wait(WAIT_S)
            assert _done_while_held(store.match, a).length == len(a)
            held.go.set()
            saver.join(WAIT_S)
            assert not saver.is_alive()
            assert out and out[0] > 0  # block rows written
            assert held.commits == 1  # nodes, importance and blocks in one transaction
            assert held.level == 1  # that does not wait for the disk (synchronous=NORMAL)
        (n_blocks,) = store.index._conn.execute("SELECT COUNT(*) FROM block_stats").fetchone()
        (n_nodes,) = store.index._conn.execute("SELECT COUNT(*) FROM node_stats").fetchone()
        assert n_blocks == out[0] and n_nodes > 0


def test_a_file_removed_while_it_is_opened_is_not_kept(tmp_path):
    a, b = prompts(4, 2)
    with ImpressStore(tmp_path, _model(), cfg()) as store:
        put(store, a)
        put(store, b)
        catalog = store._catalog
        fid = store.match(b).segments[-1].file_id
        catalog.forget({fid})  # not open yet
        real = catalog.index.block_table

        def removed_meanwhile(file_id: int):
            out = real(file_id)
            with catalog.lock:  # what an eviction's transaction does to the file table
                catalog._drop_record(file_id)
            return out

        catalog.index.block_table = removed_meanwhile
        try:
            f = catalog.open_file(fid)  # read without the catalog's lock; the file left meanwhile
        finally:
            del catalog.index.block_table
        assert f.record.id == fid
        assert fid not in catalog.files.ids()  # not kept: nobody would forget it again
        assert catalog.lend(f) is None and f.fd is None  # no descriptor kept with it either
        other = store.match(a).segments[-1].file_id
        assert catalog.open_file(other) is catalog.open_file(other)  # a file still indexed is kept


def test_a_transaction_started_during_a_commit_plans_from_the_committed_tree(tmp_path):
    """Another thread's transaction that begins while a write commits (here: a quarantine
    of the file the write extends) waits until the write has applied its commit to the
    tree: planned from the tree without it, it would remove the file's node but leave
    the write's new node below it in the index, without a parent."""
    a = prompts(5, 1)[0]
    b = a + [7, 8, 9, 10, 11]
    with ImpressStore(tmp_path, _model(), cfg()) as store:
        put(store, a)
        fa = store.match(a).segments[-1].file_id
        with held_commit(store) as held:
            held.armed = True
            writer, failed = _in_thread(put, store, b)
            assert held.reached.wait(WAIT_S)
            quarantine, out = _in_thread(store.quarantine, fa, "a test")
            _waiting()  # (without the catalog's lock: requests match meanwhile)
            assert _done_while_held(store.match, a).length == len(a)
            held.go.set()
            for t in (writer, quarantine):
                t.join(WAIT_S)
                assert not t.is_alive()
            assert failed == [None] and out == [True]
        store.index.load_tree()  # every node has its parent
        assert store.match(b).length == 0  # b's node went with the node it extends
        put(store, b)
        assert assert_reads_exact(store, b) == len(b)
    with ImpressStore(tmp_path, _model(), cfg()) as store:
        assert assert_reads_exact(store, b) == len(b)


def test_a_commit_that_fails_after_the_lock_was_let_go(tmp_path):
    """The write's COMMIT fails (disk I/O error) while another transaction waits for it:
    the write is counted as failed, the leaf its transaction evicted never left the tree
    (the tree changes only once the transaction has committed), the waiter goes on, and
    the store keeps working."""
    a, b = prompts(6, 2)
    with ImpressStore(tmp_path, _model(), cfg()) as store:
        put(store, a)
        store.match(a)  # (a's file open: a match while the commit is held reads no index)
        store.config.disk_bytes = store.disk_bytes()  # b's write must evict a
        with held_commit(store) as held:
            held.armed = held.fail = True
            writer, failed = _in_thread(put, store, b)
            assert held.reached.wait(WAIT_S)
            # planned, not committed: a's leaf is still in the tree for every other thread
            assert _done_while_held(store.match, a).length == len(a)
            waiter, out = _in_thread(_planned_match, store, a)  # (a transaction waits for the write)
            _waiting()
            held.go.set()
            for t in (writer, waiter):
                t.join(WAIT_S)
                assert not t.is_alive()
        assert store.stats()["write_failures"] == 1
        assert out == [len(a)]  # planned from the tree as committed: a is there
        store.config.disk_bytes = None
        assert assert_reads_exact(store, a) == len(a)  # rolled back: a is stored still
        assert store.match(b).length < len(b)
        put(store, b)
        assert assert_reads_exact(store, b) == len(b)


def test_a_write_waits_for_a_statistics_save_without_the_catalog_lock(tmp_path):
    a, b = prompts(7, 2)
    with ImpressStore(tmp_path, _model(), cfg(host_bytes=1 << 20)) as store:
        put(store, a)
        store.load(store.match(a).segments)  # statistics to save
        with held_commit(store) as held:
            held.armed = True
            saver, saved = _in_thread(store.save_block_stats)
            assert held.reached.wait(WAIT_S)  # the save holds the index
            writer, failed = _in_thread(put, store, b)
            _waiting()  # the write waits for the save, without the catalog's lock
            assert _done_while_held(store.match, a).length == len(a)
            held.go.set()
            for t in (saver, writer):
                t.join(WAIT_S)
                assert not t.is_alive()
            assert failed == [None] and saved[0] > 0
        assert assert_reads_exact(store, b) == len(b)


def test_put_async_does_not_wait_for_the_catalog_lock(tmp_path):
    """Handing a prompt to the writer (and opening the store, which hands it the
    crash-leftover scan) takes the writer's own lock, not the catalog's, which a job on
    the writer thread (the deferred statistics reads at open) may hold for long."""
    a = prompts(8, 1)[0]
    with ImpressStore(tmp_path, _model(), cfg()) as store:
        ks, vs = kv_of(a)
        with store._catalog.lock:  # held here: the other thread's put_async returns all the same
            fut = _done_while_held(store.put_async, a, ks, vs)
        fut.result(WAIT_S)
        assert assert_reads_exact(store, a) == len(a)
