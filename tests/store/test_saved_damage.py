"""Saved statistics with a damaged row: the row is skipped (counted, logged once) and every
other row installed as saved, so a later save keeps them; a failed read of the index is
tried again; a thread inside an index transaction can trigger the deferred read."""

from __future__ import annotations

import logging
import sqlite3
import threading

import numpy as np
import pytest

from impress_cache import ImpressStore
from impress_cache.errors import StoreIOError
from impress_cache.store.saved import DeferredLoad
from test_reorder import _model, cfg, put, scatter
from test_saved_values import Clock, _hold_writer, _prompts

A, B = list(range(3, 35)), list(range(40, 72))  # two prompts without a shared prefix


def _sql(path, *statements, args=()):
    conn = sqlite3.connect(path / "index.sqlite")
    try:
        out = [conn.execute(s, args).fetchall() for s in statements]
        conn.commit()
        return out[-1]
    finally:
        conn.close()


def _counts(path) -> dict[int, int]:
    return dict(_sql(path, "SELECT node_id, count FROM node_stats"))


def _save_node_values(path) -> dict[int, int]:
    """A store whose nodes were accessed 1 to 3 times each; returns the saved counts."""
    clock = Clock()
    with ImpressStore(path, _model(), cfg(policy="lfu"), clock=clock) as store:
        for toks in _prompts():
            put(store, toks)
            clock.t += 1.0
        for k, node in enumerate(sorted(n.id for n in store.tree.nodes() if n.parent is not None)):
            for _ in range(k % 3 + 1):
                store._values.access([node])
    saved = _counts(path)
    assert len(saved) >= 5 and len(set(saved.values())) > 1
    return saved


def _installed(store: ImpressStore, ids) -> dict[int, int]:
    """The counts the store holds for ``ids`` (taking their saved records first)."""
    for i in ids:
        store._values.sort_key(i)
    return {i: store._values._policy.stats_of(i)["count"] for i in ids if i in store._values._policy}


@pytest.mark.parametrize("column, value", [
    ("count", "-5"), ("share", "1.5"), ("freq", "'many'"), ("age_s", "9e999"),
    ("count", "1e19"), ("seq", "1e19"),  # (a REAL past SQLite's integers: every later save would fail)
])
def test_a_damaged_node_statistic_is_skipped_and_the_others_are_kept(tmp_path, caplog, column, value):
    saved = _save_node_values(tmp_path)
    bad, used = sorted(saved)[1], sorted(saved)[2]
    _sql(tmp_path, f"UPDATE node_stats SET {column} = {value} WHERE node_id = ?", args=(bad,))
    good = {k: v for k, v in saved.items() if k != bad}
    with caplog.at_level(logging.WARNING, logger="impress_cache"):
        with ImpressStore(tmp_path, _model(), cfg(policy="lfu")) as store:
            store.flush()  # the writer thread read them
            assert store.stats()["saved_rows_skipped"]["node statistics"] == 1
            assert _installed(store, saved) == good  # every other row as saved; none for the damaged one
            store._values.access([used])  # a request uses a node: its next save counts on top
    damaged = [r for r in caplog.records if "impossible" in r.getMessage()]
    assert len(damaged) == 1 and f"1 of {len(saved)} saved node statistics" in damaged[0].getMessage()
    assert not [r for r in caplog.records if "not usable" in r.getMessage()]
    after = _counts(tmp_path)
    assert {k: after[k] for k in good} == {**good, used: good[used] + 1}
    with ImpressStore(tmp_path, _model(), cfg(policy="lfu")) as store:
        assert _installed(store, good) == {**good, used: good[used] + 1}


def _save_importance(path) -> dict[int, object]:
    """Two nodes with row importance; returns what each holds."""
    with ImpressStore(path, _model(), cfg(half_life_s=None)) as store:
        for toks in (A, B):
            put(store, toks)
            scatter(store, toks)
        return {store.match(t).segments[-1].node.id: store._importance.get(store.match(t).segments[-1].node.id) for t in (A, B)}


@pytest.mark.parametrize("column, value", [
    ("scores", "X'0000'"), ("requests", "-1"), ("layers", "3"), ("scores", "substr(scores, 1, 64), length = 16"),
])
def test_a_damaged_importance_row_is_skipped_and_the_others_are_kept(tmp_path, caplog, column, value):
    saved = _save_importance(tmp_path)
    bad, good = list(saved)
    _sql(tmp_path, f"UPDATE node_importance SET {column} = {value} WHERE node_id = ?", args=(bad,))
    with caplog.at_level(logging.WARNING, logger="impress_cache"):
        with ImpressStore(tmp_path, _model(), cfg(half_life_s=None)) as store:
            store.flush()
            assert store.stats()["saved_rows_skipped"]["importance statistics"] == 1
            assert store._importance.get(bad) is None
            kept = store._importance.get(good)
            assert kept.requests == saved[good].requests and np.array_equal(kept.scores, saved[good].scores)
            scatter(store, B)  # a later request adds to the saved sums; the save keeps them
    assert len([r for r in caplog.records if "1 of 2 saved importance statistics" in r.getMessage()]) == 1
    with ImpressStore(tmp_path, _model(), cfg(half_life_s=None)) as store:
        now = store._importance.get(good)
        assert now.requests == saved[good].requests + 1
        assert np.array_equal(now.scores, 2 * saved[good].scores)


@pytest.mark.parametrize("column, value", [("share", "2.0"), ("count", "-1")])
def test_a_damaged_block_statistic_is_skipped_and_the_store_opens(tmp_path, caplog, column, value):
    config = cfg(host_bytes=1 << 20, important_ratio=1.0)
    with ImpressStore(tmp_path, _model(), config) as store:
        put(store, A)
        store.load(store.match(A).segments)  # through the memory tiers: block statistics
    rows = _sql(tmp_path, "SELECT file_id, kind, layer, block, count FROM block_stats ORDER BY 1, 2, 3, 4")
    assert len(rows) > 2
    _sql(tmp_path, f"UPDATE block_stats SET {column} = {value} WHERE file_id = ? AND kind = ? AND layer = ? AND block = ?", args=rows[0][:4])
    with caplog.at_level(logging.WARNING, logger="impress_cache"):
        with ImpressStore(tmp_path, _model(), config) as store:
            assert store.stats()["saved_rows_skipped"] == {"block statistics": 1, "node statistics": 0, "importance statistics": 0}
            held = {k: store.tiers._policy.stats_of(k)["count"] for k in store.tiers._policy.keys()}
    assert held == {tuple(r[:4]): r[4] for r in rows[1:]}
    assert len([r for r in caplog.records if f"1 of {len(rows)} saved block statistics" in r.getMessage()]) == 1


def test_a_failed_read_of_the_saved_statistics_is_tried_again(tmp_path, monkeypatch, caplog):
    """The index refuses the reads (SQLite's authorizer: ``SQLITE_AUTH``, a `StoreIOError`):
    nothing is installed and the reads stay pending; the next call reads them."""
    saved = _save_node_values(tmp_path)
    with ImpressStore(tmp_path, _model(), cfg(policy="lfu", half_life_s=None)) as store:
        put(store, A)
        scatter(store, A)
        node = store.match(A).segments[-1].node.id
        importance = store._importance.get(node)
    go = _hold_writer(monkeypatch)
    store = ImpressStore(tmp_path, _model(), cfg(policy="lfu", half_life_s=None))
    try:
        conns = (store.index._conn, store.index._reader)  # (the reads go through the read connection)
        tables = {"node_stats", "node_importance"}
        for conn in conns:
            conn.set_authorizer(lambda action, table, *_: sqlite3.SQLITE_DENY if table in tables else sqlite3.SQLITE_OK)
        with caplog.at_level(logging.WARNING, logger="impress_cache"):
            first = min(saved)
            store._values.sort_key(first)
            assert store._importance.get(node) is None
        assert store._values.saved.pending and store._importance.saved.pending
        assert first not in store._values._policy
        assert len([r for r in caplog.records if "trying again" in r.getMessage()]) == 2
        for conn in conns:
            conn.set_authorizer(None)
        assert _installed(store, saved) == saved  # the next call read them
        assert store._importance.get(node).requests == importance.requests
        assert not store._values.saved.pending and not store._importance.saved.pending
    finally:
        store.index._conn.set_authorizer(None)
        store.index._reader.set_authorizer(None)
        go.set()
        store.close()


class _Announcing:
    """The catalog's lock, announcing every thread but ``owner`` that starts to wait for it."""

    def __init__(self, lock, owner: threading.Thread | None = None) -> None:
        self.lock, self.owner, self.waiting = lock, owner, threading.Event()

    def __enter__(self):
        if threading.current_thread() is not self.owner:
            self.waiting.set()
        self.lock.acquire()

    def __exit__(self, *exc):
        self.lock.release()


def test_a_thread_inside_an_index_transaction_triggers_the_read_while_the_writer_thread_waits(tmp_path, monkeypatch):
    """The writer thread starts its deferred read and waits for the catalog's lock, which a
    thread inside an index transaction holds; that thread then needs the statistics: it
    reads them itself (no deadlock), and the writer thread finds them in place."""
    saved = _save_node_values(tmp_path)
    go = _hold_writer(monkeypatch)
    store = ImpressStore(tmp_path, _model(), cfg(policy="lfu"))
    inside, proceed, got = threading.Event(), threading.Event(), {}

    def in_transaction():
        with store.index.transaction(), store._catalog.lock:
            inside.set()
            proceed.wait(60)
            got.update(_installed(store, saved))

    worker = threading.Thread(target=in_transaction, daemon=True)
    guard = _Announcing(store._catalog.lock, worker)
    store._values.saved._guard = guard
    worker.start()
    assert inside.wait(60)
    go.set()  # the writer thread's first job: the deferred read, which waits for the lock
    assert guard.waiting.wait(60)
    proceed.set()
    worker.join(60)
    assert not worker.is_alive(), "deadlock: the thread inside the transaction waits for the writer thread"
    try:
        assert got == saved
        store.flush()
        assert not store._values.saved.pending and _installed(store, saved) == saved
    finally:
        store.close()


def test_deferred_load_gives_up_after_its_attempts_and_on_a_failing_install(caplog):
    """A read that keeps failing is tried `DeferredLoad.ATTEMPTS` times, then the owner
    starts without the statistics; an install that raises (a bug) is logged with its
    traceback once, not tried again by every later call."""
    lock, reads = threading.Lock(), []

    def failing_read():
        reads.append(1)
        raise StoreIOError("disk I/O error")

    load = DeferredLoad("test statistics", lock, lambda data: None)
    load.defer(failing_read, threading.RLock())
    with caplog.at_level(logging.WARNING, logger="impress_cache"):
        for _ in range(DeferredLoad.ATTEMPTS + 3):
            load.load()
    assert len(reads) == DeferredLoad.ATTEMPTS and not load.pending
    assert any("starting without them" in r.getMessage() for r in caplog.records)

    installs = []

    def install(data):
        installs.append(data)
        raise KeyError("a bug")

    load = DeferredLoad("test statistics", lock, install)
    load.defer(lambda: "data", threading.RLock())
    with caplog.at_level(logging.ERROR, logger="impress_cache"):
        load.load()
        load.load()
    assert installs == ["data"] and not load.pending
    assert [r.exc_info[0] for r in caplog.records if r.levelno == logging.ERROR] == [KeyError]


def test_a_failed_read_inside_an_index_transaction_is_raised(tmp_path):
    """A thread inside an index transaction that triggers a read that fails gets the error
    (SQLite may have rolled its transaction back); `Index.in_transaction` is per thread."""
    with ImpressStore(tmp_path, _model(), cfg()) as store:
        index, seen = store.index, {}
        load = DeferredLoad("test statistics", threading.Lock(), lambda data: None)
        load.defer(lambda: (_ for _ in ()).throw(StoreIOError("disk I/O error")), store._catalog.lock, index.in_transaction)
        with index.transaction(), store._catalog.lock:
            other = threading.Thread(target=lambda: seen.update(other=index.in_transaction()))
            other.start()
            other.join(60)
            assert index.in_transaction() and seen == {"other": False}
            with pytest.raises(StoreIOError):
                load.load()
        assert not index.in_transaction() and load.pending
        load.load()  # outside a transaction: logged, tried again later
        assert load.pending and load.failures == 2
