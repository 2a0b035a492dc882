"""A write reads its change set before its ``COMMIT`` and updates the tree without the index.

A write lets the catalog's lock go for its ``COMMIT`` and takes it again after. It used to
read the index's change log then (`Catalog.catch_up`), with the catalog's lock held: a
statistics save or a checkpoint on another thread that took the index as the ``COMMIT``
ended held up the write, and every `match` with it. Now the write reads the log after its
tree's position inside its transaction, right before the ``COMMIT`` (its own entries
included; nobody else can commit then), and applies that after the ``COMMIT`` without
touching the index, still holding the index's write lock (`Catalog.transaction`), so a
save or checkpoint takes the index only once the write is in the tree.

The tests hold statements on the store's real SQLite connection (real files, real
SQLite) to force the interleavings; they wait on events, never on time, and end by
comparing the tree with the index (plain SQL and a fresh open).
"""

from __future__ import annotations

import sqlite3
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from impress_cache import ImpressStore
from helpers import index_value
from impress_cache.index.sqlite import Index
from test_budget import prompts
from test_commit_handover import WAIT_S, _done_while_held, _in_thread
from test_reorder import _model, assert_reads_exact, cfg, put
from test_tree_after_commit import assert_tree_is_the_index, tree_rows


class _Hold:
    """One statement held: `reached` once it is about to run, then it waits for `go`
    (``fail``: it then raises, as a ``COMMIT`` on a full disk would)."""

    def __init__(self, sql: str, fail: bool = False) -> None:
        self.sql, self.fail = sql, fail
        self.reached = threading.Event()
        self.go = threading.Event()


class _Held:
    """The store's SQLite connection; a statement equal to the first pending hold's is held."""

    def __init__(self, conn: Any) -> None:
        self._conn = conn
        self.holds: list[_Hold] = []

    def execute(self, sql: str, *args: Any) -> Any:
        if self.holds and sql == self.holds[0].sql:
            hold = self.holds.pop(0)
            hold.reached.set()
            assert hold.go.wait(3 * WAIT_S)  # (longer than any wait of the test: a stuck test fails there)
            if hold.fail:
                raise sqlite3.OperationalError("disk I/O error")
        return self._conn.execute(sql, *args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._conn, name)


@contextmanager
def held(store: ImpressStore, *holds: _Hold):
    index = store.index
    real = index._conn
    conn = _Held(real)
    conn.holds.extend(holds)
    index._conn = conn
    try:
        yield conn
    finally:
        for hold in holds:
            hold.go.set()
        index._conn = real


def _log_position(path: Path) -> int:
    return index_value(path, "SELECT seq FROM sqlite_sequence WHERE name='changes'")


def _until(what: str, ok) -> None:
    """Until ``ok()`` (a thread reached a point no event marks); fails after `WAIT_S`."""
    deadline = time.monotonic() + WAIT_S
    while not ok():
        assert time.monotonic() < deadline, what
        time.sleep(0.001)


def _keep_the_index(index: Index, taken: threading.Event, release: threading.Event) -> None:
    """Take the store's index lock (waiting for it), say so, keep it until told."""
    with index._lock:
        taken.set()
        assert release.wait(WAIT_S)


@pytest.mark.parametrize("holder", ["statistics save", "checkpoint", "index lock"])
def test_a_write_s_tree_update_does_not_wait_for_whoever_takes_the_index_after_its_commit(tmp_path, holder):
    a, b = prompts(31, 2)
    with ImpressStore(tmp_path, _model(), cfg(host_bytes=1 << 20)) as store:
        put(store, a)
        store.load(store.match(a).segments)  # statistics to save; a's files open (a match reads no index)
        catalog = store._catalog
        write = _Hold("COMMIT")
        # the holder's own statement, held while it has the index (none for a bare lock)
        other = {"statistics save": _Hold("COMMIT"), "checkpoint": _Hold("PRAGMA wal_checkpoint(TRUNCATE)")}.get(holder)
        with held(store, *([write] + ([other] if other else []))):
            writer, failed = _in_thread(put, store, b)
            assert write.reached.wait(WAIT_S)  # the write is committing, without the catalog's lock
            taken, release = threading.Event(), threading.Event()
            # the holder queues for the index behind the write
            if holder == "statistics save":
                holding, out = _in_thread(store.save_block_stats)
            elif holder == "checkpoint":
                holding, out = _in_thread(store.index.checkpoint)
            else:
                holding, out = _in_thread(_keep_the_index, store.index, taken, release)
            assert _done_while_held(store.match, a).length == len(a)  # requests match meanwhile
            write.go.set()
            # the write brings its commit into the tree without the index and returns; the
            # holder has the index only after that
            writer.join(WAIT_S)
            assert not writer.is_alive(), "the write waited for the index after its COMMIT"
            assert failed == [None]
            assert (other.reached if other else taken).wait(WAIT_S)  # the holder has the index now
            assert holding.is_alive()  # (still holding the index)
            # a request on a third thread matches meanwhile; the tree has the prompt just written
            assert _done_while_held(store.match, a).length == len(a)
            assert _done_while_held(catalog.match, b).length == len(b)
            if other:
                other.go.set()
            release.set()
            holding.join(WAIT_S)
            assert not holding.is_alive() and out and not isinstance(out[0], BaseException), out
        if holder == "statistics save":
            assert out[0] > 0  # (block rows written)
        assert catalog._log_seq == _log_position(tmp_path)  # the position is the set's last entry
        assert_tree_is_the_index(store, tmp_path)
        assert store.stats()["after_commit_failures"] == 0 and store.stats()["log_reloads"] == 0
        for toks in (a, b):
            assert assert_reads_exact(store, toks) == len(toks)


def test_a_write_reads_the_log_once_inside_its_transaction(tmp_path, monkeypatch):
    a, b = prompts(32, 2)
    with ImpressStore(tmp_path, _model(), cfg()) as store:
        put(store, a)
        real = Index.changes_since
        reads: list[tuple[bool, bool]] = []

        def counted(self, seq, conn=None):
            reads.append((conn is not None, self.in_transaction()))
            return real(self, seq, conn)

        monkeypatch.setattr(Index, "changes_since", counted)
        put(store, b)
        # once before the COMMIT, with the transaction's connection, and none after (the
        # write's first match may look at the log through the read connection: a's commit)
        assert reads[-1] == (True, True) and reads.count((True, True)) == 1
        assert all(r == (False, False) for r in reads[:-1])
        assert store._catalog._log_seq == _log_position(tmp_path)
        assert store.match(b).length == len(b)
        with pytest.raises(RuntimeError):  # outside a transaction there is no "own connection" to read with
            store.index.changes_since(0, conn=store.index._conn)
    with ImpressStore(tmp_path, _model(), cfg()) as store:
        assert_tree_is_the_index(store, tmp_path)


def test_a_failed_commit_applies_nothing(tmp_path):
    """The write's COMMIT fails after its change set was read (this write's rows and the
    budget's removals, all uncommitted): the set is dropped; the tree, the file table and
    the log position stay as they were, and the next write follows the log from there."""
    mine = prompts(33, 4)
    b, c = prompts(34, 2)
    with ImpressStore(tmp_path, _model(), cfg()) as store:
        for t in mine:
            put(store, t)
            store.match(t)
        catalog = store._catalog
        before, seq = tree_rows(store), catalog._log_seq
        store.config.disk_bytes = store.disk_bytes()  # b's write evicts in its own transaction
        fail = _Hold("COMMIT", fail=True)
        with held(store, fail):
            writer, failed = _in_thread(put, store, b)
            assert fail.reached.wait(WAIT_S)
            # its set is read, the COMMIT not done: requests match the tree as it was
            assert _done_while_held(store.match, mine[0]).length == len(mine[0])
            fail.go.set()
            writer.join(WAIT_S)
            assert not writer.is_alive() and failed == [None]
        assert store.stats()["write_failures"] == 1
        assert tree_rows(store) == before and catalog._log_seq == seq
        assert_tree_is_the_index(store, tmp_path)
        store.config.disk_bytes = None
        for t in mine:
            assert assert_reads_exact(store, t) == len(t)  # nothing was evicted
        put(store, c)  # (reuses the log's sequence numbers the rollback gave back)
        assert catalog._log_seq == _log_position(tmp_path)
        assert_tree_is_the_index(store, tmp_path)
        assert store.match(c).length == len(c) and store.match(b).length < len(b)


def test_a_write_whose_commit_another_thread_followed_meanwhile_applies_nothing_again(tmp_path):
    """After the write's COMMIT and before it retakes the lock, another process commits and
    a thread of this one follows the log past both: the write's set, older than the tree
    by then, is not applied over it."""
    a, b = prompts(35, 2)
    c = prompts(36, 1)[0]
    with ImpressStore(tmp_path, _model(), cfg()) as store, ImpressStore(tmp_path, _model(), cfg()) as other:
        put(store, a)
        store.match(a)
        catalog = store._catalog
        write = _Hold("COMMIT")
        with held(store, write):
            writer, failed = _in_thread(put, store, b)
            assert write.reached.wait(WAIT_S)
            seq = _log_position(tmp_path)
            with catalog.lock:
                write.go.set()
                # (the COMMIT is done: the log grew; the write waits for the catalog's lock)
                _until("the write committed", lambda: _log_position(tmp_path) > seq)
                t, out = _in_thread(put, other, c)  # another process commits after it
                t.join(WAIT_S)
                assert out == [None]
                applied = store.stats()["log_applied"]
                catalog.refresh()  # a request's look: follows the log past both commits
                assert store.stats()["log_applied"] == applied + 1
                assert catalog._log_seq == _log_position(tmp_path)
                assert catalog.tree.match(b).length == len(b) and catalog.tree.match(c).length == len(c)
                followed = tree_rows(store)
            writer.join(WAIT_S)
            assert not writer.is_alive() and failed == [None]
        assert tree_rows(store) == followed and catalog._log_seq == _log_position(tmp_path)
        assert store.stats()["log_reloads"] == 0 and store.stats()["after_commit_failures"] == 0
        assert_tree_is_the_index(store, tmp_path)
        for toks in (a, b, c):
            assert assert_reads_exact(store, toks) == len(toks)


def test_the_first_read_of_a_just_written_prompt_reads_no_block_table_from_the_index(tmp_path, monkeypatch):
    """The writer keeps the block table it wrote (`OpenFiles.seed`): the first match and
    read of the prompt do not go back to the index for it (a read that could wait for
    another process's write or a checkpoint), and the kept table is the index's."""
    import numpy as np

    from impress_cache.store.chunkfiles import read_file

    toks = prompts(1, 2)
    with ImpressStore(tmp_path, _model(), cfg()) as store:
        catalog = store._catalog
        calls: list[int] = []
        real = Index.block_table
        monkeypatch.setattr(Index, "block_table", lambda self, fid: calls.append(fid) or real(self, fid))
        for t in toks:
            put(store, t)
        store.flush()
        for t in toks:
            assert assert_reads_exact(store, t) == len(t)
        assert calls == []
        for fid in catalog.files.ids():
            kept, fresh = catalog.open_file(fid), read_file(catalog.index, catalog.chunks, catalog._row_bytes, fid, None)
            assert np.array_equal(kept.table.offsets, fresh.table.offsets)
            assert np.array_equal(kept.table.checksums, fresh.table.checksums)
            assert np.array_equal(kept.table.seeds, fresh.table.seeds)


def test_written_block_tables_are_few_and_built_only_when_read(tmp_path, monkeypatch):
    """A write keeps what it wrote for the last `WRITTEN_KEEP` files only, and builds no
    table until a request asks (a store that writes many prompts and reads few keeps no
    table per write); an older file's table is read from the index as before."""
    import impress_cache.store.chunkfiles as chunkfiles

    monkeypatch.setattr(chunkfiles, "WRITTEN_KEEP", 2)
    toks = prompts(3, 4)
    with ImpressStore(tmp_path, _model(), cfg()) as store:
        files = store._catalog.files
        for t in toks:
            put(store, t)
        store.flush()
        assert files.ids() == [] and len(files._written) == 2
        calls: list[int] = []
        real = Index.block_table
        monkeypatch.setattr(Index, "block_table", lambda self, fid: calls.append(fid) or real(self, fid))
        for t in toks:
            assert assert_reads_exact(store, t) == len(t)
        assert len(calls) == 2 and not files._written  # the two oldest from the index
