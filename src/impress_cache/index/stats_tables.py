"""The statistics tables of the index: the memory tiers' block statistics, the disk
budget's node statistics and the reorganiser's row importance, saved together in one
transaction and read back at open (`store/persist.py` decides what and when).

A mixin of `Index` (which guards these methods like its own): it uses the index's
connection, lock and transactions.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from ..storage.base import BlockKey
from .columns import scratch
from .files import gc_paused, release_free_heap
from .guard import MALFORMED, float_rows


@contextmanager
def read_snapshot(conn: sqlite3.Connection) -> Iterator[None]:
    """One read snapshot meanwhile (a read transaction, unless one is open already)."""
    own = not conn.in_transaction
    if own:
        conn.execute("BEGIN")
    try:
        yield
    finally:
        if own:
            conn.execute("COMMIT")


class StatisticsTables:
    """Saving and loading the statistics tables (see the module)."""

    _conn: sqlite3.Connection
    _lock: Any
    _reading: Any
    transaction: Any

    def save_statistics(
        self,
        saved_at: float,
        nodes: dict[int, dict[str, Any]] | None = None,
        importance: dict[int, tuple[np.ndarray, float, int]] | None = None,
        blocks: dict[BlockKey, dict[str, Any]] | None = None,
    ) -> tuple[int, int, int]:
        """Upsert node statistics (``node -> policy record``: ``count``, ``freq``,
        ``share``, ``age_s``, ``seq``, as of ``saved_at``, wall-clock seconds), node
        importance (``node -> (scores [layers, length], requests, pending)``, stored as
        float16) and block statistics (``block key -> policy record``) in one
        transaction that does not wait for the disk
        (``durable=False``: a power cut may undo it, as statistics may be lost; the next
        durable commit, a prompt's, makes it durable too). Returns the rows written of
        each; rows of removed nodes or files are skipped."""
        node_rows = [
            (
                int(k), int(r.get("count", 0)), float(r.get("freq", 0.0)), float(r.get("share", 1.0)),
                float(r.get("age_s", 0.0)), int(r.get("seq", 0)), float(saved_at), int(k),
            )
            for k, r in (nodes or {}).items()
        ]
        importance_rows = [
            (
                int(k), int(a.shape[0]), int(a.shape[1]), np.ascontiguousarray(a, dtype="<f2").tobytes(),
                float(req), int(pend), float(saved_at), int(k),
            )
            for k, (a, req, pend) in (importance or {}).items()
        ]
        block_rows = [
            (
                int(k[0]), int(k[1]), int(k[2]), int(k[3]),
                int(r.get("count", 0)), float(r.get("freq", 0.0)), float(r.get("share", 1.0)),
                float(r.get("age_s", 0.0)), int(r.get("seq", 0)), float(saved_at), int(k[0]),
            )
            for k, r in (blocks or {}).items()
        ]
        if not (node_rows or importance_rows or block_rows):
            return 0, 0, 0
        with self.transaction(durable=False) as conn:
            return (
                _upsert_if_owned(conn, "node_stats", "node_id, count, freq, share, age_s, seq, saved_at", "nodes", node_rows),
                _upsert_if_owned(
                    conn, "node_importance", "node_id, layers, length, scores, requests, pending, saved_at", "nodes",
                    importance_rows,
                ),
                _upsert_if_owned(
                    conn, "block_stats", "file_id, kind, layer, block, count, freq, share, age_s, seq, saved_at", "files",
                    block_rows,
                ),
            )

    def load_block_stats(self) -> list[tuple[BlockKey, dict[str, Any]]]:
        """Every saved block statistic whose file is still in the index (``count``,
        ``freq``, ``share``, ``age_s``, ``seq`` and ``saved_at``, wall-clock seconds)."""
        with self._reading() as conn:
            rows = conn.execute(
                "SELECT s.file_id, s.kind, s.layer, s.block, s.count, s.freq, s.share, s.age_s, s.seq, s.saved_at "
                "FROM block_stats s JOIN files f ON f.id = s.file_id"
            ).fetchall()
        return [
            (
                (r[0], r[1], r[2], r[3]),
                {"count": r[4], "freq": r[5], "share": r[6], "age_s": r[7], "seq": r[8], "saved_at": r[9]},
            )
            for r in rows
        ]


    # -- node statistics (the disk budget's value of a stored prefix) ---------------------
    def load_importance(self) -> dict[int, tuple[np.ndarray, float, int, float]]:
        """Saved per-node importance: ``node -> (scores float16, requests, pending, saved_at)``
        (``scores`` None where the saved bytes are not ``layers x`` the node's length
        float16 values: the store skips that row, not all)."""
        with self._reading() as conn:
            rows = conn.execute(
                "SELECT i.node_id, i.layers, n.length, i.scores, i.requests, i.pending, i.saved_at FROM node_importance i "
                "JOIN nodes n ON n.id = i.node_id"  # (a lookup per row: no temporary table of every node id)
            ).fetchall()
        return {
            r[0]: (_scores(r[3], r[1], r[2]), r[4], r[5], r[6])
            for r in rows
        }

    def load_node_stats(self) -> tuple[np.ndarray, np.ndarray]:
        """Saved per-node statistics (a node's go with it: trigger ``node_removed``), as
        columns: node ids (``int64``, increasing) and ``float64 [n, 6]`` of ``count,
        freq, share, age_s, seq, saved_at`` (wall-clock seconds), copied a chunk at a time
        into `scratch` arrays sized up front (unmapped once the caller drops them)."""
        # rows of plain values (no garbage cycles to look for); the count and the rows of one snapshot
        with self._reading() as conn, gc_paused():
            with read_snapshot(conn):
                (n,) = conn.execute("SELECT COUNT(*) FROM node_stats").fetchone()
                ids, data, k, block = scratch(n, np.int64), scratch((6, n), np.float64), 0, None
                cur = conn.execute("SELECT node_id, count, freq, share, age_s, seq, saved_at FROM node_stats ORDER BY node_id")
                while rows := cur.fetchmany(256):  # (small: rows are Python objects; freed pools stay resident)
                    block = float_rows(rows)  # (a value that is not a number: NaN, skipped by the store)
                    ids[k : k + len(rows)], data[:, k : k + len(rows)] = block[:, 0], block[:, 1:].T
                    k += len(rows)
            conn.execute("PRAGMA shrink_memory")
        del rows, block
        release_free_heap()
        return ids, data.T


def _scores(blob: Any, layers: Any, length: Any) -> np.ndarray | None:
    """Saved importance scores as ``float16 [layers, length]``, or None if malformed."""
    try:
        return np.frombuffer(blob, dtype="<f2").reshape(layers, length).astype(np.float16)
    except MALFORMED:
        return None


def _upsert_if_owned(conn: sqlite3.Connection, table: str, columns: str, owner: str, rows: list[tuple]) -> int:
    """``INSERT OR REPLACE`` ``rows`` into ``table`` inside ``conn``'s transaction (the
    values of ``columns``, then the id of the row of ``owner`` they belong to, which must
    exist: rows of removed files or nodes are skipped); returns the number of rows written."""
    if not rows:
        return 0
    marks = ",".join("?" * len(columns.split(",")))
    before = conn.total_changes
    conn.executemany(
        f"INSERT OR REPLACE INTO {table}({columns}) SELECT {marks} WHERE EXISTS (SELECT 1 FROM {owner} WHERE id=?)",
        rows,
    )
    return conn.total_changes - before
