"""The index's change log (issue 25): a process follows another's commits by applying what
changed, not by reloading the whole tree.

Another process (a real one, on the same store directory) stores prompts (with splits of
this process's nodes), evicts, quarantines; this process then matches, which looks at the
index, applies the logged changes and ends with the tree a fresh open loads, counted in
``log_applied`` and without a reload (``log_reloads``). A log trimmed past the tree's
position falls back to a reload; a store made before the log gets it when opened for
writing (without a new schema version), and a read-only open of such a store still works.
"""

from __future__ import annotations

import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest

from impress_cache import ImpressStore
from helpers import index_value
from test_budget import prompts
from test_invariants import PATHS
from test_reorder import _model, assert_reads_exact, cfg, put
from test_tree_after_commit import _count_reloads, assert_tree_is_the_index, index_rows, tree_rows

#: another process opens the store and runs ``ops`` (each a line of Python with ``store``)
_ELSEWHERE = """
import sys
sys.path[:0] = {paths!r}
from impress_cache import ImpressStore
from test_budget import prompts
from test_reorder import _model, cfg, put
with ImpressStore({store!r}, _model(), cfg()) as store:
{ops}
"""


def elsewhere(path: Path, *ops: str) -> str:
    code = _ELSEWHERE.format(paths=PATHS, store=str(path), ops="\n".join("    " + op for op in ops))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def _log_size(path: Path) -> int:
    return index_value(path, "SELECT COUNT(*) FROM changes")


@pytest.mark.parametrize("what", ["store", "extend", "evict", "quarantine", "mixed"])
def test_another_process_s_commits_are_applied_not_reloaded(tmp_path, monkeypatch, what):
    mine = prompts(1, 6)
    with ImpressStore(tmp_path, _model(), cfg()) as store:
        for t in mine:
            put(store, t)
        for t in mine:
            store.match(t)
        before = tree_rows(store)
        ops = {
            # new prompts sharing this process's system prompts: splits and new leaves
            "store": ["for t in prompts(9, 5): put(store, t)"],
            # this process's prompts grown by a tail: new children below its leaves
            "extend": [f"for t in {mine!r}: put(store, t + [7, 8, 9, 10, 11])"],
            "evict": ["store.config.disk_bytes = 1", "store.enforce_disk_budget()"],
            "quarantine": [f"store.quarantine(store.match({mine[0]!r}).segments[-1].file_id, 'a test')"],
            "mixed": [
                "for t in prompts(9, 5): put(store, t)",
                f"store.quarantine(store.match({mine[1]!r}).segments[-1].file_id, 'a test')",
                "for t in prompts(11, 3): put(store, t)",
                "store.config.disk_bytes = store.disk_bytes() - 1",
                "store.enforce_disk_budget()",
                "store.config.disk_bytes = None",
                f"put(store, {mine[2]!r} + [5, 6, 7])",
            ],
        }[what]
        elsewhere(tmp_path, *ops)
        reloads = _count_reloads(monkeypatch)
        stats0 = store.stats()
        store.match(mine[0])  # (looks at the index: another process committed)
        stats = store.stats()
        assert reloads == [] and stats["log_reloads"] == stats0["log_reloads"]
        assert stats["log_applied"] == stats0["log_applied"] + 1
        assert tree_rows(store) != before  # (something did change)
        assert_tree_is_the_index(store, tmp_path)
        for t in mine + prompts(9, 5):
            assert_reads_exact(store, t)  # (what is matched reads back exactly)
        # this process goes on writing on the followed tree
        extra = prompts(13, 3)
        for t in extra:
            put(store, t)
        for t in extra:
            assert assert_reads_exact(store, t) == len(t)
        assert reloads == []
        assert_tree_is_the_index(store, tmp_path)


#: a short change log, in this process and in the other one: every write transaction
#: trims it to the 8 entries before it
SHORT_LOG = "import impress_cache.index.schema as s; s.LOG_KEEP, s.LOG_TRIM_EVERY = 8, 1"


def _short_log(monkeypatch) -> None:
    from impress_cache.index import schema

    monkeypatch.setattr(schema, "LOG_KEEP", 8)
    monkeypatch.setattr(schema, "LOG_TRIM_EVERY", 1)


def test_a_log_trimmed_past_the_tree_s_position_falls_back_to_a_reload(tmp_path, monkeypatch):
    _short_log(monkeypatch)
    with ImpressStore(tmp_path, _model(), cfg()) as store:
        put(store, prompts(1, 1)[0])
    with ImpressStore(tmp_path, _model(), cfg()) as store:
        store.match(prompts(1, 1)[0])
        elsewhere(tmp_path, SHORT_LOG, "for t in prompts(9, 8): put(store, t)")
        # (the first entries after the tree's position are gone)
        assert index_value(tmp_path, "SELECT MIN(seq) FROM changes") > store._catalog._log_seq + 1
        reloads = _count_reloads(monkeypatch)
        store.match(prompts(9, 1)[0])
        assert reloads == [1] and store.stats()["log_reloads"] == 1
        assert_tree_is_the_index(store, tmp_path)
        # from the reloaded tree's position on, the log is followed again
        elsewhere(tmp_path, SHORT_LOG, "put(store, prompts(10, 1)[0])")
        store.match(prompts(9, 1)[0])
        assert reloads == [1] and store.stats()["log_applied"] == 1
        assert_tree_is_the_index(store, tmp_path)
        # this process's own writes, many more than the log keeps, move its position on
        # with them: another process's next commit is still followed through the log
        for t in prompts(12, 8):
            put(store, t)
        elsewhere(tmp_path, SHORT_LOG, "put(store, prompts(14, 1)[0])")
        store.match(prompts(9, 1)[0])
        assert reloads == [1] and store.stats()["log_applied"] == 2
        assert_tree_is_the_index(store, tmp_path)


def test_one_transaction_that_logs_more_than_the_log_keeps_is_still_followed(tmp_path, monkeypatch):
    """A split of a node with more children than the log keeps entries logs them all in
    one transaction; the log is trimmed before a transaction, never among its own
    entries, so the other process follows it (before, the transaction trimmed its own
    first entries and every process reloaded the whole tree)."""
    _short_log(monkeypatch)
    shared = list(range(40, 56))
    tails = [shared + [100 + i, 7, 8, 9] for i in range(12)]  # one node, 12 children
    with ImpressStore(tmp_path, _model(), cfg()) as store:
        for t in tails:
            put(store, t)
        for t in tails:
            store.match(t)
        before = index_value(tmp_path, "SELECT MAX(seq) FROM changes")
        # another process stores a prompt that leaves the shared part halfway: the shared
        # node splits and its 12 children move under the lower half, in one transaction
        elsewhere(tmp_path, SHORT_LOG, f"put(store, {shared[:8] + [200, 201, 202, 203]!r})")
        assert index_value(tmp_path, "SELECT MAX(seq) FROM changes") - before > 8
        reloads = _count_reloads(monkeypatch)
        applied = store.stats()["log_applied"]
        store.match(tails[0])
        assert reloads == [] and store.stats()["log_applied"] == applied + 1
        assert_tree_is_the_index(store, tmp_path)
        for t in tails:
            assert assert_reads_exact(store, t) == len(t)


def _as_before_the_log(path: Path) -> None:
    """Make the store's index look like one made before the change log."""
    conn = sqlite3.connect(path / "index.sqlite")
    for (name,) in conn.execute("SELECT name FROM sqlite_master WHERE type='trigger' AND sql LIKE '%changes%'").fetchall():
        conn.execute(f"DROP TRIGGER {name}")
    conn.execute("DROP TABLE changes")
    conn.commit()
    conn.close()


def test_a_store_made_before_the_log_opens_read_only_and_is_migrated_when_written(tmp_path, monkeypatch):
    mine = prompts(1, 4)
    with ImpressStore(tmp_path, _model(), cfg()) as store:
        for t in mine:
            put(store, t)
    _as_before_the_log(tmp_path)
    version = index_value(tmp_path, "SELECT value FROM meta WHERE key='schema_version'")
    with ImpressStore(tmp_path, _model(), cfg(), read_only=True) as ro:
        assert ro._catalog._log_seq is None  # (no log: another process's commit reloads)
        assert ro.match(mine[0]).length == len(mine[0])
        with ImpressStore(tmp_path, _model(), cfg()) as store:  # opened for writing: migrated
            assert store._catalog._log_seq == 0
            put(store, prompts(5, 1)[0])
            assert _log_size(tmp_path) > 0
        reloads = _count_reloads(monkeypatch)
        assert ro.match(prompts(5, 1)[0]).length == len(prompts(5, 1)[0])
        assert reloads == [1] and ro.stats()["log_reloads"] == 1
    conn = sqlite3.connect(tmp_path / "index.sqlite")
    assert conn.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()[0] == version
    conn.close()
    with ImpressStore(tmp_path, _model(), cfg()) as store:
        for t in mine:
            assert assert_reads_exact(store, t) == len(t)
        elsewhere(tmp_path, "for t in prompts(9, 3): put(store, t)")
        store.match(mine[0])
        assert store.stats()["log_applied"] == 1 and store.stats()["log_reloads"] == 0
        assert_tree_is_the_index(store, tmp_path)


@pytest.mark.parametrize("seed", range(6))
def test_random_changes_of_another_store_are_followed_exactly(tmp_path, monkeypatch, seed):
    """Two stores on one directory (two connections: each sees the other's commits as
    another process's): the other stores, extends, evicts and quarantines in random order,
    and after every step this store's tree and file table equal the index, followed
    through the log alone."""
    import random

    rng = random.Random(seed)
    pool = prompts(20 + seed, 12)
    with ImpressStore(tmp_path, _model(), cfg()) as mine, ImpressStore(tmp_path, _model(), cfg()) as other:
        for t in pool[:3]:
            put(mine, t)
        reloads = _count_reloads(monkeypatch)
        for step in range(25):
            op = rng.choice(["store", "store", "extend", "evict", "quarantine"])
            if op == "store":
                put(other, rng.choice(pool))
            elif op == "extend":
                base = rng.choice(pool)
                put(other, base[: rng.randint(5, len(base))] + [rng.randint(3, 200) for _ in range(rng.randint(1, 9))])
            elif op == "evict":
                other.config.disk_bytes = max(1, other.disk_bytes() - rng.randint(1, 3000))
                other.enforce_disk_budget()
                other.config.disk_bytes = None
            else:
                other.match(pool[0])
                files = list(other._catalog.records)
                if files:
                    other.quarantine(rng.choice(files), "a test")
            mine.match(pool[0])
            assert tree_rows(mine) == index_rows(tmp_path), (step, op)
            if rng.random() < 0.3:
                put(mine, rng.choice(pool))  # this store writes on the followed tree
                assert tree_rows(mine) == index_rows(tmp_path), (step, "mine")
        assert reloads == [] and mine.stats()["log_reloads"] == 0 and mine.stats()["log_applied"] > 0
        done = other.stats()
        assert done["prefixes_evicted"] + done["quarantined_files"] > 0  # (removals were followed too)
        for t in pool:
            assert_reads_exact(mine, t)


@contextmanager
def _budgeted(tmp_path: Path) -> Iterator[tuple[ImpressStore, list[list[int]], set[int]]]:
    """A store with a disk budget (so an eviction order), six prompts stored and read:
    the store, the prompts and the ids of the leaves this process holds statistics of."""
    mine = prompts(1, 6)
    with ImpressStore(tmp_path, _model(), cfg(disk_bytes=1 << 30)) as store:
        for t in mine:
            put(store, t)
        for t in mine:
            store.match(t)
        store.enforce_disk_budget()  # (the eviction order starts with the first budget check)
        values = store._values
        ids = {i for i in values._queued if i in values._policy}
        assert ids and values.ordering
        yield store, mine, ids


def test_nodes_another_process_removed_leave_this_process_s_statistics_and_eviction_order(tmp_path):
    """The change log's removals reach the node statistics: a budgeted store keeps no
    record, heap place or pending save for a node another process evicted (before, they
    stayed until the heap popped them, and the records for ever)."""
    with _budgeted(tmp_path) as (store, mine, ids):
        values = store._values
        elsewhere(tmp_path, "store.config.disk_bytes = 1", "store.enforce_disk_budget()")
        store.match(mine[0])  # (follows the other process's commit through the log)
        gone = {i for i in ids if store.tree.get(i) is None}
        assert gone, "the other process's budget removed nothing"
        assert not gone & values._queued
        assert not any(i in values._policy for i in gone)
        assert not gone & values.dirty


def test_a_split_another_process_makes_hands_this_process_s_statistics_to_both_halves(tmp_path):
    """Another process's write splits a leaf this process holds statistics of: when a
    request here follows the log, both halves inherit them and the old node's go
    (`Applied.successors`; before, the halves started from nothing in this process)."""
    with _budgeted(tmp_path) as (store, mine, ids):
        values, tree = store._values, store._catalog.tree
        leaf = store.match(mine[0]).segments[-1].node
        assert leaf.id in ids
        values._policy.load_stats(leaf.id, {**values._policy.stats_of(leaf.id), "count": 7})  # (as if read 7 times)
        before = values._policy.stats_of(leaf.id)
        cut = len(mine[0]) - leaf.length + leaf.length // 2
        elsewhere(tmp_path, f"put(store, {mine[0][:cut] + list(range(5, 25))!r})")
        halves = [seg.node for seg in store.match(mine[0]).segments[-2:]]
        assert tree.get(leaf.id) is None and [h.length for h in halves] == [leaf.length // 2, leaf.length - leaf.length // 2]
        assert leaf.id not in values._policy
        for half in halves:
            after = values._policy.stats_of(half.id)
            assert (after["count"], after["last_access"]) == (7, before["last_access"]), half.id


def test_successors_are_found_only_where_new_nodes_hold_the_old_node_s_tokens():
    """`apply_changes` reports a removed node's successors: a rewrite (one new node of
    its length, another file) and a split (two new nodes); a removal whose place a new,
    different prompt takes has none."""
    from impress_cache.index.changelog import ChangeSet, apply_changes
    from impress_cache.index.files import FileTable
    from impress_cache.index.radix import RadixTree

    def case(rows, node_ids):
        tree, records = RadixTree(), FileTable()
        for rec in _records(3):
            records[rec.id] = rec
        tree.add_child(tree.root, [1, 2, 3, 4, 5, 6], 0, 0, 10)
        changes = ChangeSet(seq=1, node_ids=set(node_ids), nodes=rows)
        return apply_changes(tree, records, changes).successors

    assert case([(11, 0, 1, 0, 6, 0)], [10, 11]) == [(10, (11,), 6)]  # rewritten into file 1
    assert case([(11, 0, 0, 0, 2, 0), (12, 11, 0, 2, 4, 0)], [10, 11, 12]) == [(10, (11, 12), 2)]  # split at 2
    assert case([(11, 0, 2, 0, 6, 0)], [10, 11]) == []  # file 2 holds other tokens
    assert case([], [10]) == []  # only removed


def _records(n):
    from impress_cache.index.files import FileRecord

    rows = {0: [1, 2, 3, 4, 5, 6], 1: [1, 2, 3, 4, 5, 6], 2: [1, 2, 9, 9, 9, 9]}
    return [
        FileRecord(i, f"{i:032x}.safetensors", "safetensors", 0, 6, 16, 1, 0, 0, np.array(rows[i], np.int32), b"")
        for i in range(n)
    ]
