"""The SQLite index of a store: model record, chunk files, blocks and radix nodes.

Only this module speaks SQL. The index is the source of truth: a chunk file that the
index does not reference is garbage (left by a crash between rename and commit) and is
removed when the store is opened.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from array import array
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..storage.base import BlockInfo, BlockKey
from .radix import RadixNode, RadixTree

SCHEMA_VERSION = "2"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS files (
    id INTEGER PRIMARY KEY,
    name TEXT NOT NULL UNIQUE,
    format TEXT NOT NULL,
    n_tokens INTEGER NOT NULL,
    chunk_tokens INTEGER NOT NULL,
    nbytes INTEGER NOT NULL,
    created REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS blocks (
    file_id INTEGER NOT NULL,
    kind INTEGER NOT NULL,
    layer INTEGER NOT NULL,
    block INTEGER NOT NULL,
    rows INTEGER NOT NULL,
    offset INTEGER NOT NULL,
    nbytes INTEGER NOT NULL,
    crc32 INTEGER NOT NULL,
    PRIMARY KEY (file_id, kind, layer, block)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS nodes (
    id INTEGER PRIMARY KEY,
    parent INTEGER NOT NULL,
    tokens BLOB NOT NULL,
    file_id INTEGER NOT NULL,
    file_row INTEGER NOT NULL,
    terminal INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS nodes_by_file ON nodes (file_id);
CREATE TABLE IF NOT EXISTS block_stats (
    file_id INTEGER NOT NULL,
    kind INTEGER NOT NULL,
    layer INTEGER NOT NULL,
    block INTEGER NOT NULL,
    count INTEGER NOT NULL,
    freq REAL NOT NULL,
    share REAL NOT NULL,
    age_s REAL NOT NULL,
    seq INTEGER NOT NULL,
    saved_at REAL NOT NULL,
    PRIMARY KEY (file_id, kind, layer, block)
) WITHOUT ROWID;
"""

@dataclass(frozen=True)
class FileRecord:
    id: int
    name: str
    format: str
    n_tokens: int
    chunk_tokens: int
    nbytes: int


def pack_tokens(tokens: Iterable[int]) -> bytes:
    return array("i", tokens).tobytes()


def unpack_tokens(blob: bytes) -> tuple[int, ...]:
    a = array("i")
    a.frombytes(blob)
    return tuple(a)


class Index:
    """A WAL-mode SQLite database; every method is safe to call from any thread."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._conn = sqlite3.connect(path, timeout=30.0, check_same_thread=False, isolation_level=None)
        self._lock = threading.RLock()
        with self._lock:
            self._conn.execute("PRAGMA journal_mode=WAL")
            self._conn.execute("PRAGMA synchronous=FULL")
            self._conn.executescript(_SCHEMA)
            if self.get_meta("schema_version") is None:
                self.set_meta("schema_version", SCHEMA_VERSION)
        self._seen_version = self.data_version()

    def close(self) -> None:
        with self._lock:
            self._conn.close()

    # -- transactions ----------------------------------------------------------------
    @contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        """``BEGIN IMMEDIATE`` .. ``COMMIT``; rolls back on any exception."""
        with self._lock:
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                yield self._conn
            except BaseException:
                self._conn.execute("ROLLBACK")
                raise
            self._conn.execute("COMMIT")

    def data_version(self) -> int:
        with self._lock:
            return int(self._conn.execute("PRAGMA data_version").fetchone()[0])

    def changed_elsewhere(self) -> bool:
        """True once after another connection (process) committed a change."""
        v = self.data_version()
        if v != self._seen_version:
            self._seen_version = v
            return True
        return False

    # -- meta ------------------------------------------------------------------------
    def get_meta(self, key: str) -> str | None:
        with self._lock:
            row = self._conn.execute("SELECT value FROM meta WHERE key=?", (key,)).fetchone()
        return None if row is None else row[0]

    def set_meta(self, key: str, value: str) -> None:
        with self._lock:
            self._conn.execute("INSERT OR REPLACE INTO meta(key, value) VALUES (?, ?)", (key, value))

    def get_json(self, key: str) -> Any:
        raw = self.get_meta(key)
        return None if raw is None else json.loads(raw)

    # -- files and blocks --------------------------------------------------------------
    def add_file(
        self, conn: sqlite3.Connection, name: str, fmt: str, n_tokens: int, chunk_tokens: int,
        blocks: list[BlockInfo],
    ) -> int:
        nbytes = sum(b.nbytes for b in blocks)
        cur = conn.execute(
            "INSERT INTO files(name, format, n_tokens, chunk_tokens, nbytes, created) VALUES (?,?,?,?,?,?)",
            (name, fmt, n_tokens, chunk_tokens, nbytes, time.time()),
        )
        file_id = int(cur.lastrowid)
        conn.executemany(
            "INSERT INTO blocks(file_id, kind, layer, block, rows, offset, nbytes, crc32) VALUES (?,?,?,?,?,?,?,?)",
            [(file_id, b.kind, b.layer, b.block, b.rows, b.offset, b.nbytes, b.checksum) for b in blocks],
        )
        return file_id

    def file(self, file_id: int) -> FileRecord | None:
        with self._lock:
            row = self._conn.execute(
                "SELECT id, name, format, n_tokens, chunk_tokens, nbytes FROM files WHERE id=?", (file_id,)
            ).fetchone()
        return None if row is None else FileRecord(*row)

    def files(self) -> list[FileRecord]:
        with self._lock:
            rows = self._conn.execute(
                "SELECT id, name, format, n_tokens, chunk_tokens, nbytes FROM files"
            ).fetchall()
        return [FileRecord(*r) for r in rows]

    def blocks(self, file_id: int) -> dict[tuple[int, int, int], BlockInfo]:
        """``(kind, layer, block) -> BlockInfo`` of one file."""
        with self._lock:
            rows = self._conn.execute(
                "SELECT kind, layer, block, rows, offset, nbytes, crc32 FROM blocks WHERE file_id=?", (file_id,)
            ).fetchall()
        return {(r[0], r[1], r[2]): BlockInfo(*r) for r in rows}

    def delete_file(self, conn: sqlite3.Connection, file_id: int) -> None:
        """Forget a file, its blocks and their statistics (inside a transaction)."""
        conn.execute("DELETE FROM block_stats WHERE file_id=?", (file_id,))
        conn.execute("DELETE FROM blocks WHERE file_id=?", (file_id,))
        conn.execute("DELETE FROM files WHERE id=?", (file_id,))

    def unreferenced_files(self, conn: sqlite3.Connection) -> list[int]:
        rows = conn.execute(
            "SELECT id FROM files WHERE id NOT IN (SELECT DISTINCT file_id FROM nodes)"
        ).fetchall()
        return [r[0] for r in rows]

    def total_bytes(self) -> int:
        with self._lock:
            return int(self._conn.execute("SELECT COALESCE(SUM(nbytes), 0) FROM files").fetchone()[0])

    # -- block statistics (cold start of the memory tiers) ------------------------------
    def save_block_stats(self, records: dict[BlockKey, dict[str, Any]], saved_at: float) -> int:
        """Upsert per-block statistics in one transaction; blocks of unknown files are skipped.

        ``records`` maps a block key to a policy record (``count``, ``freq``, ``share``,
        ``age_s``, ``seq``) as of ``saved_at`` (wall-clock seconds). Returns the number
        of rows written.
        """
        rows = [
            (
                int(k[0]), int(k[1]), int(k[2]), int(k[3]),
                int(r.get("count", 0)), float(r.get("freq", 0.0)), float(r.get("share", 1.0)),
                float(r.get("age_s", 0.0)), int(r.get("seq", 0)), float(saved_at), int(k[0]),
            )
            for k, r in records.items()
        ]
        if not rows:
            return 0
        with self.transaction() as conn:
            before = conn.total_changes
            conn.executemany(
                "INSERT OR REPLACE INTO block_stats(file_id, kind, layer, block, count, freq, share, age_s, seq, saved_at) "
                "SELECT ?,?,?,?,?,?,?,?,?,? WHERE EXISTS (SELECT 1 FROM files WHERE id=?)",
                rows,
            )
            return conn.total_changes - before

    def load_block_stats(self) -> list[tuple[BlockKey, dict[str, Any]]]:
        """Every saved block statistic whose file is still in the index.

        Each record has ``count``, ``freq``, ``share``, ``age_s``, ``seq`` and
        ``saved_at`` (wall-clock seconds of the save).
        """
        with self._lock:
            rows = self._conn.execute(
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

    # -- nodes -----------------------------------------------------------------------
    def put_node(self, conn: sqlite3.Connection, node: RadixNode) -> None:
        assert node.parent is not None
        conn.execute(
            "INSERT OR REPLACE INTO nodes(id, parent, tokens, file_id, file_row, terminal) VALUES (?,?,?,?,?,?)",
            (node.id, node.parent.id, pack_tokens(node.tokens), node.file_id, node.file_row, node.terminal),
        )

    def delete_node(self, conn: sqlite3.Connection, node_id: int) -> None:
        conn.execute("DELETE FROM nodes WHERE id=?", (node_id,))

    def load_tree(self) -> RadixTree:
        """Rebuild the radix tree from the node table."""
        with self._lock:
            rows = self._conn.execute(
                "SELECT id, parent, tokens, file_id, file_row, terminal FROM nodes ORDER BY id"
            ).fetchall()
        tree = RadixTree()
        pending: dict[int, list[tuple]] = {}
        for row in rows:
            pending.setdefault(row[1], []).append(row)
        stack = [0]
        while stack:
            parent = tree.node(stack.pop())
            for node_id, _, blob, file_id, file_row, terminal in pending.pop(parent.id, []):
                tree.add_child(parent, unpack_tokens(blob), file_id, file_row, node_id=node_id, terminal=terminal)
                stack.append(node_id)
        if pending:
            # rows whose parent is gone can only come from an interrupted manual edit
            orphans = sum(len(v) for v in pending.values())
            raise RuntimeError(f"index {self.path} has {orphans} node(s) whose parent is missing")
        return tree
