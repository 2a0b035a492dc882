"""The index's error mapping: damage is a `StoreFormatError` naming the file; a wrong call
in the package's own code is raised as it is, never disguised as a damaged store."""

from __future__ import annotations

import sqlite3

import numpy as np
import pytest

from impress_cache.errors import ImpressError, StoreFormatError
from impress_cache.index.sqlite import Index, NewFile


def _index_with_a_file(tmp_path) -> tuple[Index, int]:
    index = Index(tmp_path / "index.sqlite")
    tokens = np.arange(3, 11, dtype=np.int32)
    shape = (2, 1, 2)
    new = NewFile("a" * 32 + ".safetensors", "safetensors", 0, tokens, bytes(32), 4, 1,
                  np.zeros(shape, np.int64), np.zeros(shape, np.uint32), 64, 4096)
    with index.transaction() as conn:
        file_id = index.add_file(conn, new)
    return index, file_id


def test_a_malformed_value_read_back_is_a_format_error_naming_the_index(tmp_path):
    index, file_id = _index_with_a_file(tmp_path)
    assert index.file(file_id).n_tokens == 8
    conn = sqlite3.connect(tmp_path / "index.sqlite")
    conn.execute("UPDATE files SET tokens = x'00'")  # a blob of the wrong size
    conn.commit()
    conn.close()
    with pytest.raises(StoreFormatError, match="index.sqlite"):
        index.file(file_id)
    with pytest.raises(StoreFormatError, match="verify --repair"):
        index.load_tree()
    index.close()


def test_a_wrong_call_is_raised_as_it_is(tmp_path):
    index, file_id = _index_with_a_file(tmp_path)
    # a bad value handed to a method that writes: our bug, not a damaged index
    with pytest.raises(ValueError) as err:
        index.save_statistics(0.0, nodes={1: {"count": "many"}})
    assert not isinstance(err.value, ImpressError)
    with pytest.raises(TypeError) as err:
        index.save_statistics(0.0, importance={1: (np.zeros((1, 2)), 1.0, None)})
    assert not isinstance(err.value, ImpressError)
    index.close()
    # SQLite's ProgrammingError (here: a closed connection) is a wrong call too
    with pytest.raises(sqlite3.ProgrammingError):
        index.file(file_id)


def test_schema_text_that_does_not_decode_is_damage(tmp_path):
    """A flipped byte in the schema's SQL text (more of it since the invariant triggers)
    makes SQLite report a malformed schema whose message does not decode as UTF-8: that
    is damage too, not a raw ``UnicodeDecodeError`` (found by benchmarks/faults.py)."""
    Index(tmp_path / "index.sqlite").close()
    conn = sqlite3.connect(tmp_path / "index.sqlite")
    (sql,) = conn.execute("SELECT sql FROM sqlite_master WHERE name = 'node_inside_file'").fetchone()
    raw = sql.encode()
    damaged = raw[:40] + b"\xce" + raw[41:]  # not UTF-8, and no longer valid SQL (reported with the bad byte)
    conn.execute("PRAGMA writable_schema = ON")
    conn.execute("UPDATE sqlite_master SET sql = CAST(? AS TEXT) WHERE name = 'node_inside_file'", (damaged,))
    conn.commit()
    conn.close()
    with pytest.raises(StoreFormatError, match="verify --repair"):
        Index(tmp_path / "index.sqlite")
