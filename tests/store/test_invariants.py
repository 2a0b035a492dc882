"""The index keeps its own invariants, and a write re-checks its plan inside its transaction.

Issue 25, item 1: three processes sharing a store with a disk budget damaged the index.
A writer that found its prompt fully stored committed a node for it anyway; when another
process's budget had evicted the prompt between the writer's look and its transaction,
that node pointed at file -1 at negative rows, and every later open refused the store.

Now a prompt already stored writes nothing (no transaction), a write matches again
inside its transaction and stores only what is still missing, and the index's triggers
refuse a node outside an indexed file, a node without its parent, a node removed with
children and a file removed while a node references it (`IndexRefusedError`, not
"damaged"). Everything here runs on real files, real SQLite and real processes.
"""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from impress_cache import ImpressStore, StoreFormatError
from impress_cache.errors import IndexRefusedError
from impress_cache.index.schema import INVARIANT_NAMES
from test_budget import prompts
from test_reorder import _model, assert_reads_exact, cfg, put

ROOT = Path(__file__).resolve().parents[2]
PATHS = [str(ROOT / "src"), str(ROOT / "tests"), str(ROOT / "tests" / "store")]

#: another process applies a disk budget of one byte to the store: everything it may remove goes
_EVICT_ALL = """
import sys
sys.path[:0] = {paths!r}
from impress_cache import ImpressStore
from test_reorder import _model, cfg
with ImpressStore({store!r}, _model(), cfg(disk_bytes=1)) as store:
    store.enforce_disk_budget()
    print(store.stats()["prefixes_evicted"])
"""


def _evict_all_elsewhere(path: Path) -> int:
    proc = subprocess.run(
        [sys.executable, "-c", _EVICT_ALL.format(paths=PATHS, store=str(path))], capture_output=True, text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return int(proc.stdout.strip().splitlines()[-1])


class _BeforeBegin:
    """The store's real SQLite connection; once `armed`, its next ``BEGIN IMMEDIATE``
    first runs ``before`` (here: another process evicting everything), as if that
    process had taken the write lock between the writer's plan and its transaction."""

    def __init__(self, conn: Any, before: Any) -> None:
        self._conn = conn
        self._before = before
        self.armed = False
        self.ran = 0
        self.commits = 0

    def execute(self, sql: str, *args: Any) -> Any:
        if sql == "BEGIN IMMEDIATE" and self.armed:
            self.armed = False
            self.ran += self._before()
        if sql == "COMMIT":
            self.commits += 1
        return self._conn.execute(sql, *args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._conn, name)


def _hooked(store: ImpressStore, before: Any) -> _BeforeBegin:
    hook = _BeforeBegin(store.index._conn, before)
    store.index._conn = hook
    return hook


def _nodes_inside_files(path: Path) -> None:
    """Every node of the index lies inside an indexed file and has its parent (read with
    plain SQL, not through the store)."""
    conn = sqlite3.connect(path / "index.sqlite")
    try:
        bad = conn.execute(
            "SELECT n.id, n.file_id, n.file_row, n.length FROM nodes n LEFT JOIN files f ON f.id = n.file_id "
            "WHERE f.id IS NULL OR n.file_row < 0 OR n.length < 1 OR n.file_row + n.length > f.n_tokens "
            "OR (n.parent != 0 AND NOT EXISTS (SELECT 1 FROM nodes p WHERE p.id = n.parent))"
        ).fetchall()
    finally:
        conn.close()
    assert bad == []


@pytest.mark.parametrize("again", ["whole", "longer"])
def test_a_prompt_evicted_by_another_process_between_plan_and_commit_leaves_the_index_whole(tmp_path, again):
    """The issue's recipe: store P; the next transaction of this store first lets another
    process with ``disk_bytes=1`` apply its budget (P goes); then P is requested again
    (``whole``: P itself, stored already when the writer looks; ``longer``: P and a tail,
    whose file extends P). Before the fix, ``whole`` committed a node at file -1 and the
    store could not be opened again; now P writes nothing, and the longer prompt's write
    is dropped (the prefix it extends is gone). The store opens, serves and stores again."""
    p = prompts(5, 1)[0]
    asked = p if again == "whole" else p + [7, 8, 9, 10, 11]
    with ImpressStore(tmp_path, _model(), cfg()) as store:
        put(store, p)
        hook = _hooked(store, lambda: _evict_all_elsewhere(tmp_path))
        hook.armed = True
        if again == "longer":
            put(store, asked)  # the writer matched P, wrote the tail's file; P goes before its transaction
            assert hook.ran == 1  # (the other process did evict P)
        else:
            put(store, p)
            hook.ran += _evict_all_elsewhere(tmp_path) if hook.armed else 0  # P goes all the same
        store.flush()
        assert store.stats()["write_failures"] == 0
        assert store.match(asked).length == 0  # nothing was stored over the hole
    _nodes_inside_files(tmp_path)
    with ImpressStore(tmp_path, _model(), cfg()) as store:  # a fresh open: before the fix, StoreFormatError
        assert store.match(asked).length == 0
        put(store, asked)
        assert assert_reads_exact(store, asked) == len(asked)
        assert assert_reads_exact(store, p) == len(p)


def test_a_prompt_already_stored_writes_nothing(tmp_path):
    p = prompts(6, 1)[0]
    with ImpressStore(tmp_path, _model(), cfg()) as store:
        put(store, p)
        store.flush()
        hook = _hooked(store, lambda: 0)
        version = store.index.data_version()
        put(store, p)
        store.flush()
        assert hook.commits == 0  # no transaction at all, durable or not
        assert store.index.data_version() == version
        assert assert_reads_exact(store, p) == len(p)


def test_a_write_stores_only_what_another_process_added_meanwhile_is_missing(tmp_path):
    """The writer matched P and wrote a file for P + tail; before its transaction another
    process stores P + a shorter tail. The write indexes only the rows still missing (its
    file's rows after the other's), and reads back exact."""
    p = prompts(7, 1)[0]
    longer = p + list(range(60, 80))
    shorter = longer[:-12]
    script = (
        f"import sys; sys.path[:0] = {PATHS!r}\n"
        "from impress_cache import ImpressStore\nfrom test_reorder import _model, cfg, put\n"
        f"with ImpressStore({str(tmp_path)!r}, _model(), cfg()) as store:\n    put(store, {shorter!r})\n"
    )

    def other() -> int:
        proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
        return 1

    with ImpressStore(tmp_path, _model(), cfg()) as store:
        put(store, p)
        hook = _hooked(store, other)
        hook.armed = True
        put(store, longer)
        assert hook.ran == 1
        m = store.match(longer)
        assert m.length == len(longer) and len(m.segments) == 3  # P, the other's tail, the rest from ours
        assert m.segments[-1].file_row == len(shorter) - len(p)  # our file's rows after the other's
        for toks in (p, shorter, longer):
            assert assert_reads_exact(store, toks) == len(toks)
    _nodes_inside_files(tmp_path)


def test_the_index_refuses_what_would_break_its_invariants(tmp_path):
    p = prompts(8, 1)[0]
    q = p[:20] + [9, 9, 9, 9]
    with ImpressStore(tmp_path, _model(), cfg()) as store:
        put(store, p)
        put(store, q)
        index = store.index
        top = next(n for n in store.tree.nodes() if n.parent is not None and n.children)
        leaf = next(iter(top.children.values()))
        record = store._catalog.records[leaf.file_id]
        refusals = [
            lambda conn: index.add_node(conn, top.id, -1, -3, 3, 1),  # the old bug's node
            lambda conn: index.add_node(conn, top.id, leaf.file_id, record.n_tokens - 1, 2, 1),  # past its file's end
            lambda conn: index.add_node(conn, 999_999, leaf.file_id, 0, 1, 1),  # no such parent
            lambda conn: conn.execute("UPDATE nodes SET file_row = -1 WHERE id = ?", (leaf.id,)),
            lambda conn: conn.execute("UPDATE nodes SET parent = 999999 WHERE id = ?", (leaf.id,)),
            lambda conn: index.delete_node(conn, top.id),  # it has children
            lambda conn: index.delete_file(conn, leaf.file_id),  # a node references it
        ]
        for refused in refusals:
            with pytest.raises(IndexRefusedError) as err:
                with index.transaction() as conn:
                    refused(conn)
            assert not isinstance(err.value, StoreFormatError) and "invariant" in str(err.value)
        # nothing was committed, the store is healthy
        for toks in (p, q):
            assert assert_reads_exact(store, toks) == len(toks)
        put(store, p + [5, 6, 7])
        assert store.stats()["write_failures"] == 0
    _nodes_inside_files(tmp_path)


def test_a_store_made_before_the_invariants_gets_them_when_opened(tmp_path):
    p = prompts(9, 1)[0]
    with ImpressStore(tmp_path, _model(), cfg()) as store:
        put(store, p)
    conn = sqlite3.connect(tmp_path / "index.sqlite")
    for name in INVARIANT_NAMES:
        conn.execute(f"DROP TRIGGER {name}")
    conn.commit()
    conn.close()
    with ImpressStore(tmp_path, _model(), cfg(), read_only=True) as store:  # a read-only open changes nothing
        assert assert_reads_exact(store, p) == len(p)
    with ImpressStore(tmp_path, _model(), cfg()) as store:
        assert assert_reads_exact(store, p) == len(p)
        names = {r[0] for r in store.index._conn.execute("SELECT name FROM sqlite_master WHERE type = 'trigger'")}
        assert set(INVARIANT_NAMES) <= names


def test_a_refused_write_is_dropped_with_a_warning_and_the_store_stays_healthy(tmp_path, caplog):
    """A write whose plan the index refuses (here: the node it extends removed from the
    index behind the tree's back, so that the tree is stale) is counted as a write
    failure and logged; nothing is committed and the store serves on."""
    p = prompts(10, 1)[0]
    with ImpressStore(tmp_path, _model(), cfg()) as store:
        put(store, p)
        catalog = store._catalog
        (node,) = [n for n in store.tree.nodes() if n.parent is not None]
        # the tree still holds P's node, the index no longer does (nor its file)
        index = store.index
        with index.transaction() as conn:
            index.delete_node(conn, node.id)
            index.delete_file(conn, node.file_id)
        index._seen_version = index.data_version()  # (a commit the tree is not told of)
        assert catalog.tree.get(node.id) is not None
        put(store, p + [1, 2, 3])  # plans on P's node, which the index no longer has
        assert store.stats()["write_failures"] == 1
        assert "refused" in caplog.text
    _nodes_inside_files(tmp_path)
    with ImpressStore(tmp_path, _model(), cfg()) as store:
        assert store.match(p).length == 0
        put(store, p + [1, 2, 3])
        assert assert_reads_exact(store, p + [1, 2, 3]) == len(p) + 3


# -- several processes with a disk budget ---------------------------------------------------------------
_WORKER = """
import json, sys, time
sys.path[:0] = {paths!r}
from impress_cache import ImpressStore
from impress_cache.errors import CorruptBlockError
from test_reorder import _model, cfg, kv_of, put
from test_budget import prompts
import torch
pool = prompts(11, 8) + [t + [1, 2, 3] for t in prompts(11, 4)]
reused = requests = 0
with ImpressStore({store!r}, _model(), cfg(disk_bytes={budget})) as store:
    deadline = time.monotonic() + {seconds}
    i = {seed}
    while time.monotonic() < deadline:
        toks = pool[(i * 7 + 3) % len(pool)]
        i += 1
        requests += 1
        m = store.match(toks)
        if m.length:
            lease = store.lease([m])
            try:
                if not lease.stale:
                    try:
                        loaded = store.load(m.segments)
                    except CorruptBlockError as exc:  # removed by another process after the lease
                        store.quarantine(exc.file_id, str(exc))
                    else:
                        ks, vs = kv_of(toks[: m.length])
                        assert torch.equal(loaded.keys, torch.stack(ks)) and torch.equal(loaded.values, torch.stack(vs))
                        reused += m.length
            finally:
                lease.release()
        put(store, toks)
    store.flush()
    stats = store.stats()
print(json.dumps({{"reused": reused, "requests": requests, "write_failures": stats["write_failures"],
                  "evicted": stats["prefixes_evicted"]}}))
"""


def test_three_processes_with_a_disk_budget_keep_the_index_whole_and_keep_reusing(tmp_path):
    """Three processes ask for, reuse and store prompts of one pool for a few seconds,
    with a disk budget of about three prompts, so that each evicts what the others are
    about to store again. Every process keeps reusing (its reads exact), no write is
    refused or fails, and a fresh process opens the store and serves it exactly."""
    pool = prompts(11, 8) + [t + [1, 2, 3] for t in prompts(11, 4)]
    with ImpressStore(tmp_path, _model(), cfg()) as store:
        put(store, pool[0])
        prefix = store._catalog.chunk_bytes
        base = store.disk_bytes()
    budget = base + 3 * prefix
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _WORKER.format(paths=PATHS, store=str(tmp_path), budget=budget, seconds=4, seed=s)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for s in range(3)
    ]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-3000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    assert all(r["write_failures"] == 0 for r in results), results
    assert sum(r["evicted"] for r in results) > 0, results  # the budget did evict
    assert all(r["reused"] > 0 for r in results), results
    _nodes_inside_files(tmp_path)
    with ImpressStore(tmp_path, _model(), cfg()) as store:  # the fresh process
        for toks in pool:
            assert assert_reads_exact(store, toks) >= 0
            put(store, toks)
            assert assert_reads_exact(store, toks) == len(toks)
        assert store.stats()["write_failures"] == 0


def test_a_lease_collected_inside_the_lease_tables_lock_does_not_deadlock():
    """A lease dropped without `release` is handed back by garbage collection, which can
    run while the same thread holds the lease table's (non-reentrant) lock. Its finalizer
    only queues the release; the next call into the table applies it. Before, the
    finalizer took that lock: the thread waited for itself for ever."""
    import gc
    import threading

    from impress_cache.store.leases import FREE, LEASED, LeaseTable

    unlinked: list[str] = []
    table = LeaseTable(clock=lambda: 0.0, unlink=unlinked.append, grace_s=0.0)
    lease = table.hold([7])
    lease.cycle = lease  # only the cyclic collector frees it
    del lease
    assert table.protection(7, 0.0) == LEASED
    table.defer_unlink(7, "doomed")
    done = threading.Event()

    def collect_inside_the_lock() -> None:
        was = gc.isenabled()
        gc.disable()
        try:
            with table._lock:
                gc.collect()
        finally:
            if was:
                gc.enable()
        done.set()

    t = threading.Thread(target=collect_inside_the_lock, daemon=True)
    t.start()
    assert done.wait(20), "the finalizer waited for the lock its own thread holds"
    assert table.protection(7, 0.0) == FREE  # the queued release applied
    table.unlinker.drain()
    assert unlinked == ["doomed"]
    table.unlinker.close()


class _CommitLevels:
    """The store's real SQLite connection; records SQLite's ``synchronous`` setting and
    the chunk files present at every ``COMMIT``."""

    def __init__(self, conn: Any, chunks: Path) -> None:
        self._conn, self._chunks = conn, chunks
        self.commits: list[tuple[int, set[str]]] = []

    def execute(self, sql: str, *args: Any) -> Any:
        if sql == "COMMIT":
            level = self._conn.execute("PRAGMA synchronous").fetchone()[0]  # (1: NORMAL, 2: FULL)
            self.commits.append((level, {p.name for p in self._chunks.iterdir()}))
        return self._conn.execute(sql, *args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._conn, name)


def test_the_budgets_removals_are_durable_before_their_files_go(tmp_path):
    """Files the disk budget removes are unlinked only after a durable commit of their
    removal (synchronous=FULL), so a power cut cannot leave nodes whose files are gone."""
    with ImpressStore(tmp_path, _model(), cfg()) as store:
        for toks in prompts(16, 6):
            put(store, toks)
        store.flush()
        before = {p.name for p in (tmp_path / "chunks").iterdir()}
        levels = _CommitLevels(store.index._conn, tmp_path / "chunks")
        store.index._conn = levels
        store.config.disk_bytes = store.disk_bytes() - 2 * store._catalog.chunk_bytes // 6
        removed = store.enforce_disk_budget()
        store.flush()
        store.index._conn = levels._conn
        assert removed["removed_files"] > 0 and levels.commits
        assert all(level == 2 for level, _ in levels.commits)
        assert all(present == before for _, present in levels.commits)  # nothing unlinked before a commit
        assert len({p.name for p in (tmp_path / "chunks").iterdir()}) == len(before) - removed["removed_files"]


def test_the_leftover_scan_keeps_a_leased_file_that_left_the_index_during_it(tmp_path):
    """A file that leaves the index while a request leases it waits for the lease
    (`defer_unlink`). The leftover scan must see it among those waiting: it reads them in
    the same view as the index's files. Here the file leaves (a quarantine of the file
    before it) while the scan is under way; before, the scan had read the waiting files
    before it looked at the index, took the file for a crash leftover and deleted it
    under the lease."""
    import threading

    from impress_cache.store.leftovers import remove_leftovers
    from test_commit_handover import _waiting

    p = prompts(17, 1)[0]
    longer = p + [3, 4, 5, 6, 7]
    with ImpressStore(tmp_path, _model(), cfg()) as store:
        put(store, p)
        put(store, longer)
        store.flush()
        m = store.match(longer)
        first, tail = m.segments[0].file_id, m.segments[-1].file_id
        tail_name = store._catalog.records[tail].name
        lease = store.lease([m])
        asked = threading.Event()

        def deferred() -> set[str]:
            names = store._leases.deferred_names()
            asked.set()
            return names

        catalog = store._catalog
        out: list = []
        quarantined: list = []
        with catalog.lock:  # the scan waits for this lock once it starts looking at the index
            t = threading.Thread(target=lambda: out.append(remove_leftovers(catalog, 0o600, deferred)), daemon=True)
            t.start()
            asked.wait(2.0)  # (the old scan reads the waiting files first, before it takes the lock)
            # the tail's file leaves the index (leased, it waits): a quarantine whose transaction
            # has begun and waits for this lock too (it plans under it)
            q = threading.Thread(target=lambda: quarantined.append(store.quarantine(first, "a test")), daemon=True)
            q.start()
            _waiting()
        for thread in (t, q):
            thread.join(60)
        assert out == [True] and quarantined == [True]
        assert (tmp_path / "chunks" / tail_name).exists()  # still there for the lease
        lease.release()
        store.flush()
        assert not (tmp_path / "chunks" / tail_name).exists()  # gone with the lease

