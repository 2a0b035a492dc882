"""The SQLite index of a store: model record, chunk files, radix nodes and statistics.

Only this module speaks SQL. The index is the source of truth: a chunk file that the
index does not reference is garbage (left by a crash between rename and commit) and is
removed when the store is opened. File and node ids come from ``AUTOINCREMENT`` keys,
so an id is never used twice in the life of a store, not even after its row is deleted.

Schema 3: a file row carries everything the read path and the tree need about the file
in four blobs (its rows' token ids, the digest of the tokens before them, every block's
offset and checksum), so opening a file costs one row, not one row per block; a node row
is a run of a file's rows (its tokens are that file's tokens, not a copy).
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading
import time
import urllib.parse
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import CorruptBlockError, ReadOnlyStoreError, StoreFormatError
from .guard import MALFORMED, _check_regular, _guarded, index_error, is_damage
from ..storage.base import create_file, disk_bytes
from .files import FILE_COLUMNS, FileRecord, FileTable, NewFile, file_record, gc_paused, release_free_heap
from .log_table import ChangeLogTable
from .stats_tables import StatisticsTables, read_snapshot
from .radix import RadixTree

from .locks import INDEX, INDEX_READ, OrderedLock
from .schema import CHANGE_LOG, INVARIANTS, SCHEMA, SCHEMA_VERSION, SCHEMA_VERSIONS, TRIGGERS, WAL_LIMIT


class Index(StatisticsTables, ChangeLogTable):
    """A WAL-mode SQLite database; every method is safe to call from any thread.

    Every SQLite error (and every malformed value read back) is raised as an
    `ImpressError` naming the index file: `StoreIOError` when the disk or the
    permissions are the cause (full, I/O error, locked, read-only), `StoreFormatError`
    (damage: rebuild with ``impress-cache verify --repair``) otherwise.

    ``read_only``: open without writing anything (``mode=ro``; on a read-only volume
    without the WAL's shared-memory file, ``immutable=1``). ``file_mode``: permission bits
    of a new index file (SQLite gives its ``-wal`` and ``-shm`` files the same).
    """

    def __init__(self, path: Path, read_only: bool = False, file_mode: int = 0o600) -> None:
        self.path = path = Path(path)
        self.read_only = read_only
        for p in (path, Path(f"{path}-wal"), Path(f"{path}-shm")):
            _check_regular(p)
        try:
            self._conn = self._connect(path, read_only, file_mode)
        except (sqlite3.Error, UnicodeDecodeError) as exc:  # (damaged schema text may fail to decode)
            raise index_error(path, exc) from exc
        # (read-only: the one connection only reads, taken like the read connection)
        self._lock = OrderedLock(INDEX_READ if read_only else INDEX, "index")
        self._in_transaction = False
        self._tx_thread = 0
        #: write transactions since this process last trimmed the change log (``None``:
        #: not before the open's own transaction has made sure the log exists)
        self._untrimmed: int | None = None
        self._trim_mark: int | None = None  # the log's newest entry at the previous trim
        try:
            with self._lock:
                if read_only:
                    self._check_version(self._conn)
                else:
                    _switch_to_wal(self._conn)
                    self._conn.execute("PRAGMA synchronous=FULL")
                    # a checkpoint that empties the WAL also shrinks it to this size
                    self._conn.execute(f"PRAGMA journal_size_limit={WAL_LIMIT}")
                    with self.transaction() as conn:
                        version = self._check_version(conn)
                        for statement in [*SCHEMA.split(";"), *TRIGGERS, *INVARIANTS, *CHANGE_LOG]:  # (stores made before the triggers get them)
                            if statement.strip():
                                conn.execute(statement)
                        if version is None:
                            conn.execute(
                                "INSERT OR IGNORE INTO meta(key, value) VALUES ('schema_version', ?)", (SCHEMA_VERSION,)
                            )
                    self._untrimmed = 0
            self._reader, self._read_lock = self._conn, self._lock  # (read-only: the one connection)
            if not read_only:
                self._reader, self._read_lock = self._connect(path, False, file_mode), OrderedLock(INDEX_READ, "index reader")
                self._reader.execute("PRAGMA query_only=1")
                self._reader.execute("PRAGMA cache_size=-512")  # (KiB: small reads; SQLite's default is 2 MiB)
            self._seen_version = self.data_version()
        except BaseException as exc:
            for conn in {id(c): c for c in (self._conn, getattr(self, "_reader", self._conn))}.values():
                conn.close()
            if is_damage(exc):
                raise index_error(path, exc) from exc
            raise

    @staticmethod
    def _connect(path: Path, read_only: bool, file_mode: int) -> sqlite3.Connection:
        def connect(target: str, uri: bool = False) -> sqlite3.Connection:
            return sqlite3.connect(
                target, timeout=30.0, check_same_thread=False, isolation_level=None, uri=uri
            )

        if not read_only:
            try:  # a new index gets the store's file mode (SQLite would follow the umask)
                os.close(create_file(None, path, file_mode))
            except FileExistsError:
                pass
            return connect(str(path))
        if not path.exists():
            raise StoreFormatError(f"{path.parent} holds no impress_cache store (no {path.name}); a read-only store cannot be created")
        target = "file:" + urllib.parse.quote(str(path.resolve()))
        conn = connect(target + "?mode=ro", uri=True)
        try:
            conn.execute("SELECT 1 FROM sqlite_master LIMIT 1").fetchall()
            return conn
        except sqlite3.OperationalError:
            # a WAL-mode database on a read-only volume without its -shm file: nobody can
            # be writing it, so it is read as immutable
            conn.close()
            return connect(target + "?immutable=1", uri=True)

    def _check_version(self, conn: sqlite3.Connection) -> str | None:
        version = conn.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone() if _has_meta(conn) else None
        if version is None and self.read_only:
            raise StoreFormatError(f"the index {self.path} records no schema version: it is not an impress_cache store")
        if version is not None and version[0] not in SCHEMA_VERSIONS:
            raise StoreFormatError(
                f"the index {self.path} has schema version {version[0]}; this version of impress_cache "
                f"reads schema {SCHEMA_VERSION}. Stores of older versions cannot be upgraded in place: "
                "open a new store directory (or delete this one) and let it fill again."
            )
        return None if version is None else version[0]

    def close(self) -> None:
        with self._lock, self._read_lock:
            self._reader.close()
            self._conn.close()

    @contextmanager
    def _reading(self) -> Iterator[sqlite3.Connection]:
        """The read connection, for the reads requests make (block tables, the change
        log): a write connection of its own would keep them waiting for this process's
        write transactions and checkpoints, which in WAL mode never block a reader.
        Inside this thread's own transaction: that transaction (it reads its own writes)."""
        with self._lock if self.in_transaction() else self._read_lock:
            yield self._conn if self.in_transaction() else self._reader

    # -- transactions ----------------------------------------------------------------
    def writing(self) -> Any:
        """The write connection's lock (rank `INDEX`, reentrant), for a caller that keeps
        this process's other writers out past a `transaction`'s ``COMMIT``
        (`Catalog.transaction`: until the tree follows it)."""
        return self._lock

    def in_transaction(self) -> bool:
        """Whether the calling thread is inside `transaction` (the index's lock is
        reentrant: no other thread runs one meanwhile)."""
        return self._in_transaction and self._tx_thread == threading.get_ident()

    @contextmanager
    def transaction(self, durable: bool = True) -> Iterator[sqlite3.Connection]:
        """``BEGIN IMMEDIATE`` .. ``COMMIT``; rolls back on any exception. A failed
        ``COMMIT`` (disk full, I/O error) is rolled back and raised as `StoreIOError`. A
        transaction that is not ``durable`` commits without waiting for the disk
        (``synchronous=NORMAL``: atomic, but a power cut may undo it)."""
        if self.read_only:
            raise ReadOnlyStoreError(f"the store of {self.path} is open read-only; it writes nothing")
        with self._lock:
            if not durable:
                if self._conn.in_transaction:  # (left open by an interrupted one: no PRAGMA inside it)
                    self._conn.execute("ROLLBACK")
                self._conn.execute("PRAGMA synchronous=NORMAL")
            try:
                with self._transaction() as conn:
                    yield conn
            finally:
                if not durable:
                    self._conn.execute("PRAGMA synchronous=FULL")

    @contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            if self._in_transaction:  # the lock is reentrant: a nested one would roll back the outer
                raise RuntimeError("nested index transaction")
            try:
                if self._conn.in_transaction:  # left open by a failed statement outside a transaction
                    self._conn.execute("ROLLBACK")
                self._conn.execute("BEGIN IMMEDIATE")
            except sqlite3.Error as exc:
                raise index_error(self.path, exc) from exc
            self._in_transaction, self._tx_thread = True, threading.get_ident()
            try:
                try:
                    self._trim_log()
                    yield self._conn
                except BaseException as exc:
                    self._rollback()
                    if is_damage(exc):
                        raise index_error(self.path, exc) from exc
                    raise
                try:
                    self._conn.execute("COMMIT")
                except sqlite3.Error as exc:
                    self._rollback()
                    raise index_error(self.path, exc) from exc
            finally:
                self._in_transaction = False

    def _rollback(self) -> None:
        try:
            if self._conn.in_transaction:
                self._conn.execute("ROLLBACK")
        except sqlite3.Error:
            pass

    def data_version(self) -> int:
        """``PRAGMA data_version`` of the read connection: it changes with every commit of
        another connection, this process's writes included."""
        with self._read_lock:
            return int(self._reader.execute("PRAGMA data_version").fetchone()[0])

    def changed_elsewhere(self) -> bool:
        """True once after a commit to the index (another process's, or this process's
        own: following that changes nothing); never waits for this process's writes."""
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

    def get_json(self, key: str) -> Any:
        raw = self.get_meta(key)
        return None if raw is None else json.loads(raw)

    def set_schema_version(self, version: str) -> None:
        """Record the schema version (`schema.CODEC_SCHEMA_VERSION` for a store with a
        ``kv_codec``, so that older versions refuse it)."""
        if version not in SCHEMA_VERSIONS:
            raise ValueError(f"unknown schema version {version!r}")
        with self.transaction() as conn:
            conn.execute("UPDATE meta SET value=? WHERE key='schema_version' AND value != ?", (version, version))

    def get_or_set_json(self, key: str, value: Any) -> Any:
        """The stored value of ``key``, after storing ``value`` if there was none; one
        transaction, so of two processes creating a store only one sets it."""
        with self.transaction() as conn:
            row = conn.execute("SELECT value FROM meta WHERE key=?", (key,)).fetchone()
            if row is not None:
                return json.loads(row[0])
            conn.execute("INSERT INTO meta(key, value) VALUES (?, ?)", (key, json.dumps(value)))
            return value

    # -- namespaces ------------------------------------------------------------------
    def namespace_id(self, digest: str, create: bool = False, wait: bool = True) -> int | None:
        """The id of the namespace named by ``digest`` (`store.namespaces`; ids are never
        used twice), given one now with ``create``; None when it has none (or when a
        read-only index of a store made before namespaces has no such table). Not
        ``wait`` (and not ``create``): None at once when another thread is using the index."""
        if create:
            with self.transaction() as conn:
                conn.execute("INSERT OR IGNORE INTO namespaces(digest) VALUES (?)", (digest,))
                return int(conn.execute("SELECT id FROM namespaces WHERE digest=?", (digest,)).fetchone()[0])
        if not self._lock.acquire(blocking=wait):
            return None
        try:
            if self._conn.execute("SELECT 1 FROM sqlite_master WHERE type='table' AND name='namespaces'").fetchone() is None:
                return None
            row = self._conn.execute("SELECT id FROM namespaces WHERE digest=?", (digest,)).fetchone()
        finally:
            self._lock.release()
        return None if row is None else int(row[0])

    def namespaces(self) -> dict[int, str]:
        """Every namespace's ``id -> digest`` (for a repair, which keeps them)."""
        with self._lock:
            if self._conn.execute("SELECT 1 FROM sqlite_master WHERE type='table' AND name='namespaces'").fetchone() is None:
                return {}
            return {int(i): str(d) for i, d in self._conn.execute("SELECT id, digest FROM namespaces")}

    def keep_namespaces(self, rows: dict[int, str]) -> None:
        """Record namespaces under the ids they had (a repaired index)."""
        with self.transaction() as conn:
            conn.executemany("INSERT INTO namespaces(id, digest) VALUES (?, ?)", sorted(rows.items()))

    # -- files -------------------------------------------------------------------------
    def add_file(self, conn: sqlite3.Connection, f: NewFile) -> int:
        cur = conn.execute(
            "INSERT INTO files(name, format, first_pos, n_tokens, chunk_tokens, layers, nbytes, file_bytes, "
            "tokens, context, offsets, checksums, perm, created) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
            (
                f.name, f.format, f.first_pos, len(f.tokens), f.chunk_tokens, f.layers, f.nbytes, f.file_bytes,
                np.ascontiguousarray(f.tokens, dtype="<i4").tobytes(), f.context,
                np.ascontiguousarray(f.offsets, dtype="<i8").tobytes(),
                np.ascontiguousarray(f.checksums, dtype="<u4").tobytes(),
                None if f.perm is None else np.ascontiguousarray(f.perm, dtype="<i4").tobytes(), time.time(),
            ),
        )
        return int(cur.lastrowid)

    def file(self, file_id: int) -> FileRecord | None:
        with self._reading() as conn:
            row = conn.execute(f"SELECT {FILE_COLUMNS} FROM files WHERE id=?", (file_id,)).fetchone()
        return None if row is None else file_record(row)

    def files(self) -> list[FileRecord]:
        with self._lock:
            rows = self._conn.execute(f"SELECT {FILE_COLUMNS} FROM files").fetchall()
        return [file_record(r) for r in rows]

    def has_file(self, name: str) -> bool:
        """Whether a file of that name is in the index (an indexed lookup)."""
        with self._lock:
            return self._conn.execute("SELECT 1 FROM files WHERE name=?", (name,)).fetchone() is not None

    def file_names(self) -> dict[int, str]:
        with self._lock:
            return dict(self._conn.execute("SELECT id, name FROM files").fetchall())

    def block_table(self, file_id: int) -> tuple[np.ndarray, np.ndarray] | None:
        """``(offsets, checksums)`` of a file: ``int64`` and ``uint32`` ``[2, layers, blocks]``."""
        with self._reading() as conn:
            row = conn.execute(
                "SELECT layers, n_tokens, chunk_tokens, offsets, checksums FROM files WHERE id=?", (file_id,)
            ).fetchone()
        if row is None:
            return None
        layers, n, ct, offsets, checksums = row
        try:
            shape = (2, layers, -(-n // ct))
            return np.frombuffer(offsets, dtype="<i8").reshape(shape), np.frombuffer(checksums, dtype="<u4").reshape(shape)
        except (*MALFORMED, ZeroDivisionError) as exc:
            raise _inconsistent(file_id, "block table", exc) from exc

    def file_perm(self, file_id: int) -> np.ndarray | None:
        """``perm[layer, r]`` of a reordered file (the physical row of logical row ``r``)."""
        with self._reading() as conn:
            row = conn.execute("SELECT layers, n_tokens, perm FROM files WHERE id=?", (file_id,)).fetchone()
        if row is None or row[2] is None:
            return None
        try:
            return np.frombuffer(row[2], dtype="<i4").reshape(row[0], row[1])
        except MALFORMED as exc:
            raise _inconsistent(file_id, "row permutation", exc) from exc

    def delete_file(self, conn: sqlite3.Connection, file_id: int) -> None:
        """Forget a file and (trigger ``file_removed``) its blocks' statistics (inside a transaction)."""
        conn.execute("DELETE FROM files WHERE id=?", (file_id,))

    def delete_file_if_unreferenced(self, conn: sqlite3.Connection, file_id: int) -> bool:
        """`delete_file` if no node points at the file any more (one indexed statement);
        whether it was deleted."""
        cur = conn.execute(
            "DELETE FROM files WHERE id=? AND NOT EXISTS (SELECT 1 FROM nodes WHERE file_id=?)", (file_id, file_id)
        )
        return cur.rowcount > 0

    def unreferenced_files(self, conn: sqlite3.Connection) -> list[int]:
        rows = conn.execute("SELECT id FROM files WHERE id NOT IN (SELECT DISTINCT file_id FROM nodes)").fetchall()
        return [r[0] for r in rows]

    def footprint(self, wal: bool = True, main: bool = True) -> int:
        """Bytes the index, its WAL and shared-memory file take on disk (as ``du``);
        not ``wal``: all but the WAL; not ``main``: the WAL only."""
        total = 0
        for suffix in ("", "-wal", "-shm") if wal and main else ("", "-shm") if main else ("-wal",):
            try:
                st = os.stat(f"{self.path}{suffix}")
            except FileNotFoundError:
                continue
            total += disk_bytes(st)
        return total

    def wal_bytes(self) -> int:
        try:
            return os.stat(f"{self.path}-wal").st_size
        except FileNotFoundError:
            return 0

    def checkpoint(self) -> bool:
        """``wal_checkpoint(TRUNCATE)``; False when another process's reader kept it from finishing."""
        if self.read_only:
            return False
        with self._lock:
            busy = self._conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()[0]
        return not busy

    def total_bytes(self) -> int:
        """Bytes of the chunk files the index references, as they are on disk."""
        with self._lock:
            return int(self._conn.execute("SELECT COALESCE(SUM(file_bytes), 0) FROM files").fetchone()[0])

    # -- nodes -----------------------------------------------------------------------
    def add_node(self, conn: sqlite3.Connection, parent: int, file_id: int, file_row: int, length: int, terminal: int) -> int:
        cur = conn.execute(
            "INSERT INTO nodes(parent, file_id, file_row, length, terminal) VALUES (?,?,?,?,?)",
            (parent, file_id, file_row, length, terminal),
        )
        return int(cur.lastrowid)

    def reparent(self, conn: sqlite3.Connection, old_parent: int, new_parent: int) -> None:
        conn.execute("UPDATE nodes SET parent=? WHERE parent=?", (new_parent, old_parent))

    def add_terminal(self, conn: sqlite3.Connection, node_id: int) -> None:
        conn.execute("UPDATE nodes SET terminal=terminal+1 WHERE id=?", (node_id,))

    def delete_node(self, conn: sqlite3.Connection, node_id: int) -> None:
        """Forget a node and (trigger ``node_removed``) its statistics (inside a transaction)."""
        conn.execute("DELETE FROM nodes WHERE id=?", (node_id,))

    def load_tree(self) -> tuple[RadixTree, FileTable]:
        """Rebuild the radix tree from the node table, in time proportional to the number
        of nodes and files: file rows are streamed into a `FileTable` (their token blobs
        copied into one buffer), node rows become compact nodes whose tokens are runs of
        that buffer; both tables are read in one snapshot. Returns the tree and the file
        records by id. The cyclic garbage collector is paused meanwhile (the load makes a
        few objects per node and no garbage; collections would walk them all), and the
        load's temporaries and pages are given back afterwards."""
        try:
            with gc_paused():
                return self._load_tree()
        finally:
            with self._reading() as conn:
                conn.execute("PRAGMA shrink_memory")  # the pages the load read: not needed again
            release_free_heap()

    def _load_tree(self) -> tuple[RadixTree, FileTable]:
        # one snapshot of both tables (and the log's position), through the read connection:
        # a reload under the catalog's lock does not wait for this process's writes
        with self._reading() as conn, read_snapshot(conn):
            seq = self._log_position(conn)
            files = self._load_files(conn)
            cur = conn.execute("SELECT id, parent, file_id, file_row, length, terminal FROM nodes")
            parts = [np.zeros((0, 6), np.int64)]
            while rows := cur.fetchmany(4096):
                parts.append(np.array(rows, dtype=np.int64).reshape(-1, 6))
        nodes = np.concatenate(parts)
        del parts, rows
        found, n_tokens, start = files.rows_of(nodes[:, 2])
        bad = ~found | (nodes[:, 3] < 0) | (nodes[:, 4] < 1) | (nodes[:, 3] + nodes[:, 4] > n_tokens)
        if bad.any():
            node_id, _, file_id, file_row, length, _ = nodes[np.flatnonzero(bad)[0]].tolist()
            raise StoreFormatError(
                f"the index {self.path} is damaged: node {node_id} points at rows "
                f"{file_row}..{file_row + length} of file {file_id}, which "
                + ("is not indexed" if not found[bad][0] else f"has {int(n_tokens[bad][0])} rows")
                + ". Rebuild the index with `impress-cache verify --repair`."
            )
        try:
            tree = RadixTree.from_columns(nodes, start + nodes[:, 3], files.tokens)
        except ValueError as exc:
            raise StoreFormatError(
                f"the index {self.path} is damaged: {exc}. Rebuild the index with `impress-cache verify --repair`."
            ) from exc
        tree.log_seq = seq
        return tree, files

    def _load_files(self, conn: sqlite3.Connection) -> FileTable:
        """Every file row as a `FileTable` (in ``conn``'s read transaction)."""
        _, total = conn.execute("SELECT COUNT(*), COALESCE(SUM(n_tokens), 0) FROM files").fetchone()
        builder = FileTable.Builder(total)
        cur = conn.execute(f"SELECT {FILE_COLUMNS} FROM files ORDER BY id")
        while rows := cur.fetchmany(512):  # a chunk at a time: little transient memory
            builder.add_rows(rows)
        return builder.build()


#: the methods that decode values read back (where a malformed value means damage)
_DECODING = {
    "get_json", "get_or_set_json", "file", "files", "block_table", "file_perm", "total_bytes", "load_tree",
    "load_block_stats", "load_node_stats", "load_importance", "changes_since",
}
for _name, _fn in [*vars(StatisticsTables).items(), *vars(ChangeLogTable).items(), *vars(Index).items()]:
    if callable(_fn) and not _name.startswith("_") and _name not in ("transaction", "close"):
        setattr(Index, _name, _guarded(_fn, decoding=_name in _DECODING))


def _inconsistent(file_id: int, what: str, exc: BaseException) -> CorruptBlockError:
    """A file's record whose arrays contradict its header fields (layers, rows, rows per
    block): the file cannot be read as indexed, so it is treated as a damaged file (its
    request recomputes, the file is quarantined), not as a damaged index."""
    return CorruptBlockError(f"the index's {what} of file {file_id} does not match its record ({exc})", file_id)


def _has_meta(conn: sqlite3.Connection) -> bool:
    return conn.execute("SELECT 1 FROM sqlite_master WHERE type='table' AND name='meta'").fetchone() is not None


def _switch_to_wal(conn: sqlite3.Connection, timeout_s: float = 30.0) -> None:
    """``PRAGMA journal_mode=WAL``, retried while the database is locked: switching a
    new index to WAL needs an exclusive lock, and with two processes creating one store
    at once it failed with "database is locked" although the busy timeout had not
    passed (seen once in tests/store/test_safety.py)."""
    deadline = time.monotonic() + timeout_s
    delay = 0.005
    while True:
        try:
            conn.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or time.monotonic() > deadline:
                raise
            time.sleep(delay)
            delay = min(0.2, delay * 2)
