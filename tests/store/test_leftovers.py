"""The crash-leftover scan runs off the open path (on the writer thread) and never removes a
file that a writer of this or another store (process) is creating or has just committed:
two stores on one directory, a write held between its file and its commit by a hook."""

from __future__ import annotations

import threading
import uuid

import pytest

from impress_cache import ImpressStore
from impress_cache.errors import StoreFormatError
from impress_cache.store import CHUNK_DIR
from impress_cache.store.directory import CreationGate
from test_reorder import _model, assert_reads_exact, cfg, kv_of, put


def _names(path) -> set[str]:
    return {p.name for p in (path / CHUNK_DIR).iterdir()}


def _leftover(path) -> str:
    """A crash leftover: a temporary file of an interrupted write (nobody holds the gate)."""
    name = uuid.uuid4().hex + ".safetensors.tmp"
    (path / CHUNK_DIR / name).write_bytes(b"half a file")
    return name


def test_the_scan_waits_for_a_write_in_flight_in_another_store(tmp_path):
    first, second, third = [3, 4, 5, 6] * 4, [7, 8, 9, 10] * 4, [11, 12, 13, 14] * 4
    with ImpressStore(tmp_path, _model(), cfg()) as a:
        put(a, first)
    leftover = _leftover(tmp_path)
    a = ImpressStore(tmp_path, _model(), cfg())
    a.flush()  # its own scan: the leftover goes
    assert leftover not in _names(tmp_path)
    leftover = _leftover(tmp_path)
    # a's next write stops between its file (renamed into place) and its commit
    created, go = threading.Event(), threading.Event()
    commit = a._catalog.commit_prompt

    def held(*args, **kw):
        created.set()
        assert go.wait(60)
        return commit(*args, **kw)

    a._catalog.commit_prompt = held
    before = _names(tmp_path)
    fut = a.put_async(second, *kv_of(second))
    assert created.wait(60)
    (in_flight,) = _names(tmp_path) - before  # a's new file, not in the index yet
    try:
        b = ImpressStore(tmp_path, _model(), cfg())  # the index lists files: the scan is deferred
        b.flush()  # the scan ran and found a writer at work: nothing removed
        assert {in_flight, leftover} <= _names(tmp_path)
        assert b._writer._scan is not None  # tried again before b's next write
    finally:
        go.set()
        fut.result()
    a.close()
    # b loaded the index before a's commit; its scan (before b's write) reads the index again
    assert in_flight not in {r.name for r in b._catalog.records.values()}
    put(b, third)
    assert b._writer._scan is None
    names = _names(tmp_path)
    assert in_flight in names and leftover not in names
    for toks in (first, second, third):
        assert assert_reads_exact(b, toks) == len(toks)
    b.close()


def test_a_writer_of_this_process_holds_the_scan_off(tmp_path):
    with ImpressStore(tmp_path, _model(), cfg()) as store:
        put(store, [3, 4, 5, 6] * 4)
    leftover = _leftover(tmp_path)
    gate = CreationGate(tmp_path, 0o600)  # e.g. the reorganiser's or a remote link's write
    with gate.creating():
        store = ImpressStore(tmp_path, _model(), cfg())
        store.flush()
        assert leftover in _names(tmp_path)
    store.close()  # nothing written meanwhile: the scan is still to do, in the next session
    assert leftover in _names(tmp_path)
    with ImpressStore(tmp_path, _model(), cfg()) as store:
        store.flush()
        assert leftover not in _names(tmp_path)
    gate.close()


def test_foreign_entries_found_by_the_deferred_scan_are_reported_and_kept(tmp_path):
    with ImpressStore(tmp_path, _model(), cfg()) as store:
        put(store, [3, 4, 5, 6] * 4)
    (tmp_path / CHUNK_DIR / "notes.txt").write_text("mine")
    leftover = _leftover(tmp_path)
    store = ImpressStore(tmp_path, _model(), cfg())
    with pytest.raises(StoreFormatError, match="did not write"):
        store.flush()
    assert (tmp_path / CHUNK_DIR / "notes.txt").read_text() == "mine"
    assert leftover in _names(tmp_path)  # nothing removed in a folder with foreign files
    assert assert_reads_exact(store, [3, 4, 5, 6] * 4) == 16  # the store keeps serving
    store.close()


def test_a_file_missing_from_a_stale_view_is_not_a_leftover(tmp_path, monkeypatch):
    """Another store commits a file, and this store fails to follow the index (reading the
    change log, then reloading): the scan (which the next write retries) must not take
    the other store's file for a leftover."""
    from impress_cache.index.sqlite import Index
    from impress_cache.store.catalog import Catalog
    from impress_cache.store.leftovers import remove_leftovers

    first, second = [3, 4, 5, 6] * 4, [7, 8, 9, 10] * 4
    with ImpressStore(tmp_path, _model(), cfg()) as a, ImpressStore(tmp_path, _model(), cfg()) as b:
        put(a, first)
        a.flush()
        put(b, second)
        b.flush()
        real = Catalog._load
        calls = []

        def failing(self):
            calls.append(1)
            if len(calls) == 1:
                raise OSError("injected: the index could not be read")
            return real(self)

        def log_fails(self, *args):
            raise OSError("injected: the change log could not be read")

        monkeypatch.setattr(Catalog, "_load", failing)
        monkeypatch.setattr(Index, "changes_since", log_fails)
        with pytest.raises(OSError):
            a._catalog.refresh()  # sees b's commit, fails to follow it (the tree is left stale)
        assert a._catalog.stale
        with pytest.raises(OSError):
            a._catalog.refresh()  # fails to reload
        monkeypatch.undo()
        before = _names(tmp_path)
        assert remove_leftovers(a._catalog, cfg().file_mode)
        assert _names(tmp_path) == before
        assert assert_reads_exact(a, second) == len(second)
    with ImpressStore(tmp_path, _model(), cfg()) as c:
        assert assert_reads_exact(c, second) == len(second) and assert_reads_exact(c, first) == len(first)


def test_a_rewritten_nodes_old_file_waits_for_its_lease(tmp_path):
    """The old file of a rewritten node leaves the index but is unlinked only when the last
    lease on it goes: the scan leaves it to the lease table."""
    from impress_cache.store.leftovers import remove_leftovers
    from test_reorder import scatter

    toks = list(range(3, 67))
    with ImpressStore(tmp_path, _model(), cfg()) as store:
        put(store, toks)
        for _ in range(4):
            scatter(store, toks)
        (old,) = _names(tmp_path)
        # (a lease that is not a request's: the rewrite waits for requests to finish)
        lease = store._leases.hold([seg.file_id for seg in store.match(toks).segments], request=False)
        assert store.reorganize(force=True)["rewritten"] == 1
        assert old in _names(tmp_path) and old in store._leases.deferred_names()
        assert remove_leftovers(store._catalog, cfg().file_mode, store._leases.deferred_names)
        assert old in _names(tmp_path)  # a request holding the lease may still read it
        lease.release()
        store._leases.unlinker.drain()  # (files are unlinked on a thread of their own)
        assert old not in _names(tmp_path)


def test_the_scans_lock_is_released_although_a_forked_child_shares_it(tmp_path):
    import fcntl
    import os

    gate = CreationGate(tmp_path, 0o600)
    r, w = os.pipe()
    with gate.exclusive() as free:
        assert free
        pid = os.fork()
        if pid == 0:  # the child holds copies of every descriptor until told to exit
            os.read(r, 1)
            os._exit(0)
    try:
        fd = os.open(tmp_path / "writers.lock", os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # raises if the child kept the lock
        finally:
            os.close(fd)
    finally:
        os.write(w, b"x")
        os.waitpid(pid, 0)
        os.close(r)
        os.close(w)


def test_a_file_gone_since_the_listing_is_neither_foreign_nor_kept(tmp_path):
    """A chunk file removed between the directory listing and its check (by a writer or
    the budget of another process) must not make the store refuse to open as if a
    foreign file were there."""
    import os

    from impress_cache.store.leftovers import _is_file

    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        (tmp_path / "x.safetensors").write_bytes(b"")
        os.symlink("x.safetensors", tmp_path / "link.safetensors")
        assert _is_file(fd, "x.safetensors") is True
        assert _is_file(fd, "link.safetensors") is False  # foreign: a link
        assert _is_file(fd, "gone.safetensors") is None
    finally:
        os.close(fd)
