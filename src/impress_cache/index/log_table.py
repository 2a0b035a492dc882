"""The change log's SQL (a mixin of `Index`): its trimming and its reads.

The log itself, a table the index's triggers fill (`schema.CHANGE_LOG`), is described in
`index.changelog`, which applies what these reads return to the tree.
"""

from __future__ import annotations

import sqlite3
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

from . import schema
from .changelog import ChangeSet
from .files import FILE_COLUMNS, file_record
from .schema import FILE_CHANGE, NODE_CHANGE
from .stats_tables import read_snapshot


class ChangeLogTable:
    """Needs ``_conn`` (the write connection), ``_lock``, ``_reading()`` (the read
    connection, or this thread's transaction), ``in_transaction()``, ``_untrimmed`` and
    ``_trim_mark`` from `Index`."""

    _conn: sqlite3.Connection
    _lock: Any
    _untrimmed: int | None
    _trim_mark: int | None
    if TYPE_CHECKING:
        def _reading(self) -> AbstractContextManager[sqlite3.Connection]: ...

        def in_transaction(self) -> bool: ...

    def _trim_log(self) -> None:
        """Every `schema.LOG_TRIM_EVERY`-th write transaction, right after its ``BEGIN``
        (never among its own entries): delete the change log's entries `schema.LOG_KEEP`
        or more older than the newest that are also no newer than the newest at this
        process's previous trim (what was logged since then stays, however much)."""
        if self._untrimmed is None:
            return
        self._untrimmed += 1
        if self._untrimmed < schema.LOG_TRIM_EVERY:
            return
        self._untrimmed = 0
        (last,) = self._conn.execute("SELECT MAX(seq) FROM changes").fetchone()
        if last is not None and self._trim_mark is not None:
            self._conn.execute("DELETE FROM changes WHERE seq <= ?", (min(last - schema.LOG_KEEP, self._trim_mark),))
        self._trim_mark = last

    def _log_position(self, conn: sqlite3.Connection) -> int | None:
        """The change log's last sequence number (0: none yet); ``None`` without a log."""
        if conn.execute("SELECT 1 FROM sqlite_master WHERE type='table' AND name='changes'").fetchone() is None:
            return None
        row = conn.execute("SELECT seq FROM sqlite_sequence WHERE name='changes'").fetchone()
        return 0 if row is None else int(row[0])

    def changes_since(self, seq: int | None, conn: sqlite3.Connection | None = None) -> ChangeSet | None:
        """What the change log holds after entry ``seq``: the ids of the node and file rows
        inserted, updated or deleted since, and the current rows of those still there, all
        in one read snapshot of the read connection (never waiting for this process's
        writes). ``None`` when the log cannot tell (no log, or its entries after ``seq``
        were trimmed away): the caller reloads the whole tree. ``conn``: this thread's
        open write transaction, read right before its ``COMMIT`` (its own uncommitted
        rows and entries included): under the write lock no other process commits, so
        that is the index once ``COMMIT`` returns."""
        if conn is not None and (conn is not self._conn or not self.in_transaction()):
            raise RuntimeError("changes_since(conn=...) reads inside this thread's own index transaction only")
        if seq is None:
            return None
        if conn is not None:
            with self._lock:
                return self._changes_since(conn, seq)
        with self._reading() as reader:
            return self._changes_since(reader, seq)

    def _changes_since(self, conn: sqlite3.Connection, seq: int) -> ChangeSet | None:
        with read_snapshot(conn):  # (inside a write transaction: read with it, no BEGIN)
            last = self._log_position(conn)
            if last is None:
                return None
            if last == seq:
                return ChangeSet(seq)
            first = conn.execute("SELECT MIN(seq) FROM changes").fetchone()[0]
            if last < seq or first is None or first > seq + 1:
                return None
            touched = "SELECT id FROM changes WHERE seq > ? AND kind = ?"
            node_ids = {r[0] for r in conn.execute(touched, (seq, NODE_CHANGE))}
            file_ids = {r[0] for r in conn.execute(touched, (seq, FILE_CHANGE))}
            nodes = conn.execute(
                f"SELECT id, parent, file_id, file_row, length, terminal FROM nodes WHERE id IN ({touched})",
                (seq, NODE_CHANGE),
            ).fetchall()
            files = conn.execute(f"SELECT {FILE_COLUMNS} FROM files WHERE id IN ({touched})", (seq, FILE_CHANGE)).fetchall()
        return ChangeSet(last, node_ids, [tuple(map(int, r)) for r in nodes], file_ids, [file_record(r) for r in files])
