"""The SQLite index's schema (docs: Storage format, The SQLite index); `sqlite.py`
creates it, and it and `stats_tables.py` are the only modules that run SQL."""

SCHEMA_VERSION = "3"
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
"""

#: a node's and a file's statistics go with them (one statement per removal: the disk
#: budget removes a leaf and perhaps its file with each write at the budget)
TRIGGERS = (
    "CREATE TRIGGER IF NOT EXISTS node_removed AFTER DELETE ON nodes BEGIN "
    "DELETE FROM node_stats WHERE node_id = OLD.id; DELETE FROM node_importance WHERE node_id = OLD.id; END",
    "CREATE TRIGGER IF NOT EXISTS file_removed AFTER DELETE ON files BEGIN "
    "DELETE FROM block_stats WHERE file_id = OLD.id; END",
)
