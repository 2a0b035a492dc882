"""The SQLite index's schema (docs: Storage format, The SQLite index); `sqlite.py`
creates it, and it and `stats_tables.py` are the only modules that run SQL."""

SCHEMA_VERSION = "3"
#: the schema version of a store whose K/V blocks are encoded (``kv_codec``): the same
#: tables, but versions before the codec, which would read its blocks as raw K/V (and
#: quarantine every file when the checksums fail), refuse it by its version
CODEC_SCHEMA_VERSION = "4"
#: the versions this code reads
SCHEMA_VERSIONS = (SCHEMA_VERSION, CODEC_SCHEMA_VERSION)
#: bytes the WAL keeps after a checkpoint that emptied it (``PRAGMA journal_size_limit``)
WAL_LIMIT = 1 << 20

SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS files (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    name TEXT NOT NULL UNIQUE,
    format TEXT NOT NULL,
    first_pos INTEGER NOT NULL,
    n_tokens INTEGER NOT NULL,
    chunk_tokens INTEGER NOT NULL,
    layers INTEGER NOT NULL,
    nbytes INTEGER NOT NULL,
    file_bytes INTEGER NOT NULL,
    tokens BLOB NOT NULL,
    context BLOB NOT NULL,
    offsets BLOB NOT NULL,
    checksums BLOB NOT NULL,
    perm BLOB,
    created REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS nodes (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    parent INTEGER NOT NULL,
    file_id INTEGER NOT NULL,
    file_row INTEGER NOT NULL,
    length INTEGER NOT NULL,
    terminal INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS nodes_by_file ON nodes (file_id);
CREATE INDEX IF NOT EXISTS nodes_by_parent ON nodes (parent);
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
CREATE TABLE IF NOT EXISTS node_importance (
    node_id INTEGER PRIMARY KEY,
    layers INTEGER NOT NULL,
    length INTEGER NOT NULL,
    scores BLOB NOT NULL,
    requests REAL NOT NULL,
    pending INTEGER NOT NULL,
    saved_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS node_stats (
    node_id INTEGER PRIMARY KEY,
    count INTEGER NOT NULL,
    freq REAL NOT NULL,
    share REAL NOT NULL,
    age_s REAL NOT NULL,
    seq INTEGER NOT NULL,
    saved_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS namespaces (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    digest TEXT NOT NULL UNIQUE
);
CREATE TABLE IF NOT EXISTS changes (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    kind INTEGER NOT NULL,
    id INTEGER NOT NULL
);
"""

#: `changes` rows: which table a logged change touched
NODE_CHANGE, FILE_CHANGE = 0, 1
#: the change log keeps about this many entries: every `LOG_TRIM_EVERY`-th write
#: transaction of a process deletes, right after its ``BEGIN``, the entries `LOG_KEEP` or
#: more older than the newest, except those logged since that process's previous trim
#: (`Index._trim_log`; a process further behind reloads). So one transaction that logs
#: more than `LOG_KEEP` entries (a split of a node with thousands of children) is still
#: followed through the log. About 4 entries per stored prompt: 1,024 let a process lag
#: some 250 writes behind and cost about 13 KB of index (4,096 cost about 53 KB: in a
#: small store with a disk budget, a prompt's worth of room, which the budget then took
#: from the chunk files)
LOG_KEEP = 1024
LOG_TRIM_EVERY = 32


def _logged(table: str, kind: int, event: str, row: str) -> str:
    return (
        f"CREATE TRIGGER IF NOT EXISTS {table}_{event.lower()}_logged AFTER {event} ON {table} BEGIN "
        f"INSERT INTO changes(kind, id) VALUES ({kind}, {row}.id); END"
    )


#: the change log (docs: Concurrency): every insert, update and delete of a node or file
#: row appends the row's id to `changes` in the same transaction, so another process
#: applies what changed (`Index.changes_since`, `changelog.apply_changes`) instead of
#: reloading the whole tree; SQL-only, so any writer of the index fills it. Created when
#: a store is opened for writing, like `TRIGGERS` (a store made before it gets it; the
#: schema version stays, and a version that does not know the table ignores it).
CHANGE_LOG = (
    *(_logged("nodes", NODE_CHANGE, e, "OLD" if e == "DELETE" else "NEW") for e in ("INSERT", "UPDATE", "DELETE")),
    *(_logged("files", FILE_CHANGE, e, "OLD" if e == "DELETE" else "NEW") for e in ("INSERT", "UPDATE", "DELETE")),
    # (the trigger that trimmed it inside the transaction that logged, before 2026-12-05)
    "DROP TRIGGER IF EXISTS changes_trimmed",
)

#: a node's and a file's statistics go with them (one statement per removal: the disk
#: budget removes a leaf and perhaps its file with each write at the budget)
TRIGGERS = (
    "CREATE TRIGGER IF NOT EXISTS node_removed AFTER DELETE ON nodes BEGIN "
    "DELETE FROM node_stats WHERE node_id = OLD.id; DELETE FROM node_importance WHERE node_id = OLD.id; END",
    "CREATE TRIGGER IF NOT EXISTS file_removed AFTER DELETE ON files BEGIN "
    "DELETE FROM block_stats WHERE file_id = OLD.id; END",
)

#: the prefix of every message the invariant triggers raise (`guard.index_error` turns
#: such a refusal into `IndexRefusedError`, not "index damaged")
REFUSAL = "impress_cache invariant"


def _refuse(why: str) -> str:
    return "BEGIN SELECT RAISE(ABORT, '" + f"{REFUSAL}: {why}".replace("'", "''") + "'); END"

_OUTSIDE = (
    "NOT EXISTS (SELECT 1 FROM files WHERE id = NEW.file_id AND NEW.file_row >= 0 AND NEW.length >= 1 "
    "AND NEW.file_row + NEW.length <= n_tokens)"
)
_ORPHAN = "NEW.parent != 0 AND NOT EXISTS (SELECT 1 FROM nodes WHERE id = NEW.parent)"

#: the radix tree's invariants, enforced by the index itself (created when a store is
#: opened for writing, so a store made before them gets them): a node's rows lie inside
#: an indexed file and its parent exists; a file is not removed while a node references
#: it, nor a node while it has children. A plan made from a stale view of the index is
#: refused here whatever path made it.
INVARIANTS = (
    f"CREATE TRIGGER IF NOT EXISTS node_inside_file BEFORE INSERT ON nodes WHEN {_OUTSIDE} "
    + _refuse("a node's rows must lie inside an indexed file"),
    f"CREATE TRIGGER IF NOT EXISTS node_moved_inside_file BEFORE UPDATE OF file_id, file_row, length ON nodes "
    f"WHEN {_OUTSIDE} " + _refuse("a node's rows must lie inside an indexed file"),
    f"CREATE TRIGGER IF NOT EXISTS node_has_parent BEFORE INSERT ON nodes WHEN {_ORPHAN} "
    + _refuse("a node's parent must exist"),
    f"CREATE TRIGGER IF NOT EXISTS node_moved_has_parent BEFORE UPDATE OF parent ON nodes WHEN {_ORPHAN} "
    + _refuse("a node's parent must exist"),
    "CREATE TRIGGER IF NOT EXISTS node_without_children BEFORE DELETE ON nodes "
    "WHEN EXISTS (SELECT 1 FROM nodes WHERE parent = OLD.id) " + _refuse("a node with children cannot go"),
    "CREATE TRIGGER IF NOT EXISTS file_unreferenced BEFORE DELETE ON files "
    "WHEN EXISTS (SELECT 1 FROM nodes WHERE file_id = OLD.id) " + _refuse("a file a node references cannot go"),
)

#: the names of the `INVARIANTS` triggers
INVARIANT_NAMES = tuple(sql.split()[5] for sql in INVARIANTS)
