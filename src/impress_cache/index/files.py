"""The chunk files an index records, held compactly in memory.

A store of millions of stored tokens has tens of thousands of chunk files. `FileTable`
keeps the files loaded from the index as columns (numpy arrays: a few dozen bytes per
file) and the token ids of all of them in one shared buffer (``uint16`` when every id
fits, else ``int32``), and hands out a `FileRecord` only when one is asked for. Files
added or replaced after the load are kept as records (as before: a few hundred bytes
each) until the next load. No SQL here: `sqlite.Index.load_tree` streams the rows in.
"""

from __future__ import annotations

import ctypes
import gc
import re
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np

from .columns import scratch

#: names the store gives its chunk files, kept as 16 bytes plus a suffix code
_NAME = re.compile(r"([0-9a-f]{32})\.([a-z0-9]{1,16})")
_SUFFIX = re.compile(r"[a-z0-9]{1,16}")
#: the value of each lowercase hex digit by its ASCII code (16: not one)
_HEX = np.full(256, 16, np.uint8)
_HEX[np.frombuffer(b"0123456789abcdef", np.uint8)] = np.arange(16, dtype=np.uint8)


def release_free_heap() -> None:
    """Give the C heap's free memory back to the system (glibc's ``malloc_trim``): loading
    a large index makes tens of megabytes of temporary rows that would otherwise stay
    resident. Does nothing where the C library has no ``malloc_trim``."""
    global _malloc_trim
    if _malloc_trim is None:
        try:
            _malloc_trim = ctypes.CDLL(None).malloc_trim
        except (OSError, AttributeError):
            _malloc_trim = False
    if _malloc_trim:
        _malloc_trim(0)


_malloc_trim: Any = None


@contextmanager
def gc_paused() -> Iterator[None]:
    """The cyclic garbage collector off meanwhile: a load makes many objects and no
    garbage, and a collection during it would walk all of them (every tree node)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@dataclass(frozen=True, slots=True)
class FileRecord:
    """One chunk file as the index records it (without its block table)."""

    id: int
    name: str
    format: str
    #: position, in its prompt, of the file's first row
    first_pos: int
    n_tokens: int
    chunk_tokens: int
    layers: int
    #: bytes of the blocks (K/V and probe pieces)
    nbytes: int
    #: bytes the file takes on disk (header, padding and the file system's block
    #: rounding included: the larger of its size and its allocated blocks)
    file_bytes: int
    #: token ids of the file's rows (``int32 [n_tokens]``)
    tokens: np.ndarray
    #: SHA-256 of the token ids before the first row
    context: bytes
    #: whether the rows are stored in their own order per layer (`Index.file_perm`)
    reordered: bool = False

    @property
    def blocks(self) -> int:
        """Blocks per layer."""
        return -(-self.n_tokens // self.chunk_tokens)


@dataclass(frozen=True)
class NewFile:
    """What a writer hands to `Index.add_file`."""

    name: str
    format: str
    first_pos: int
    tokens: np.ndarray
    context: bytes
    chunk_tokens: int
    layers: int
    offsets: np.ndarray  # int64 [2, layers, blocks]
    checksums: np.ndarray  # uint32 [2, layers, blocks]
    nbytes: int
    file_bytes: int
    #: ``perm[layer, r]``: the physical row of logical row ``r`` (None: prompt order)
    perm: np.ndarray | None = None


#: ``typeof(perm)`` reads the type from the record header; ``perm IS NOT NULL`` walks the
#: row's overflow pages (offsets, checksums) to get there, which slows the load at open
FILE_COLUMNS = (
    "id, name, format, first_pos, n_tokens, chunk_tokens, layers, nbytes, file_bytes, tokens, context, typeof(perm) != 'null'"
)


def file_record(row: tuple) -> FileRecord:
    """A file record from a row of `FILE_COLUMNS` (checked: `check_record`)."""
    return check_record(FileRecord(*row[:9], np.frombuffer(row[9], dtype="<i4"), bytes(row[10]), bool(row[11])))


def check_record(rec: FileRecord) -> FileRecord:
    """``rec`` if its values are possible, else `ValueError` (a damaged index row)."""
    if (
        len(rec.tokens) != rec.n_tokens or len(rec.context) != 32 or rec.first_pos < 0 or rec.n_tokens < 1
        or rec.chunk_tokens < 1 or rec.layers < 1
    ):
        raise ValueError(f"file {rec.id} ({rec.name!r}) has a malformed record")
    return rec


#: the scalar columns, in the order `FileTable.Builder.add` takes them
_INT_COLUMNS = ("first_pos", "n_tokens", "chunk_tokens", "layers", "nbytes", "file_bytes")


def _dedupe(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Rows of 32 bytes as ``(distinct rows, index of each row's)``: grouped by their
    first eight bytes, then checked whole (kept as they are if two differ in the rest)."""
    if not len(rows):
        return rows.copy(), np.zeros(0, np.int64)
    keys, index = np.unique(np.ascontiguousarray(rows).view("<u8")[:, 0], return_inverse=True)
    first = np.empty(len(keys), np.int64)
    first[index] = np.arange(len(rows))
    table = rows[first]
    if not (table[index] == rows).all():
        return rows.copy(), _narrow(np.arange(len(rows)))
    return table, _narrow(index.reshape(-1))


def _narrow(a: np.ndarray) -> np.ndarray:
    """``a`` (integers) in the smallest of 1, 2, 4 and 8 bytes that holds its values (a
    column of lengths, sizes or offsets usually fits in one to four)."""
    if not len(a):
        return a.astype(np.int64)
    lo, hi = int(a.min()), int(a.max())
    for t in (np.uint8, np.int8, np.uint16, np.int16, np.uint32, np.int32):
        info = np.iinfo(t)
        if info.min <= lo and hi <= info.max:
            return a.astype(t)
    return a.astype(np.int64)


def find_sorted(column: np.ndarray, value: int) -> int:
    """Index of ``value`` in a sorted integer column (any width, see `_narrow`), or -1.

    A binary search of the column as it is: ``column.searchsorted(value)`` with a Python
    int would first convert a narrow column to 64-bit integers, a copy of the whole
    column per lookup (O(n): tens of microseconds at 50,000 ids)."""
    if not len(column) or not int(column[0]) <= value <= int(column[-1]):
        return -1
    i = int(column.searchsorted(column.dtype.type(value)))  # (in range: it fits the type)
    return i if column[i] == value else -1


class _Sorted:
    """A set of 16-byte keys (``uint8 [n, 16]``) for vectorised lookups: one sorted copy
    of them as 16-byte strings (compared as whole bytes), searched. The copy is sorted
    in place in a `scratch` array: the scan runs on the writer thread, whose heap would
    keep the pages of an index array and of the copy resident after it."""

    def __init__(self, keys: np.ndarray) -> None:
        self.keys = scratch(len(keys), "S16")
        self.keys[:] = np.ascontiguousarray(keys).view("S16").reshape(-1)
        self.keys.sort()

    def has(self, queries: np.ndarray) -> np.ndarray:
        if not len(self.keys) or not len(queries):
            return np.zeros(len(queries), bool)
        q = np.ascontiguousarray(queries).view("S16").reshape(-1)
        i = np.minimum(np.searchsorted(self.keys, q), len(self.keys) - 1)
        return self.keys[i] == q


class FileTable:
    """File records by id, as compact columns (a read-mostly mapping ``id -> FileRecord``).

    Supports what the catalog needs of a dict: ``get``, ``[]``, ``in``, ``len``,
    iteration over ids, ``values``, ``[id] = record`` and ``pop``. Not thread-safe (the
    catalog's lock guards it).
    """

    class Builder:
        """Builds a table from index rows ``(id, name, format, first_pos, n_tokens,
        chunk_tokens, layers, nbytes, file_bytes, tokens, context, reordered)`` given in
        chunks, in increasing id order; `ValueError` for a row whose values are
        impossible. Column by column (no Python work per row beyond a name check), the
        tokens copied into one buffer sized up front (``uint16`` until an id does not fit)."""

        def __init__(self, tokens_hint: int) -> None:
            self.parts: list[tuple] = []
            self.tokens = np.empty(max(0, tokens_hint), np.uint16)
            self.used = 0
            self.words: list[str] = []
            self.codes: dict[str, int] = {}
            self.odd: dict[int, str] = {}
            self.last_id = -1

        def _code(self, text: str) -> int:
            c = self.codes.get(text)
            if c is None:
                if len(self.words) == 255:
                    raise ValueError("more than 255 distinct file formats or name suffixes in one index")
                c = self.codes[text] = len(self.words)
                self.words.append(text)
            return c

        def add_rows(self, rows: list[tuple]) -> None:
            if not rows:
                return
            cols = list(zip(*rows))
            n = len(rows)
            ids = np.array(cols[0], np.int64)
            ints = np.array(cols[3:9], np.int64).reshape(len(_INT_COLUMNS), n)
            first_pos, n_tokens, chunk_tokens, layers = ints[:4]
            tok_len = np.fromiter(map(len, cols[9]), np.int64, n)
            ctx_len = np.fromiter(map(len, cols[10]), np.int64, n)
            bad = (
                (tok_len != 4 * n_tokens) | (ctx_len != 32) | (first_pos < 0) | (n_tokens < 1) | (chunk_tokens < 1)
                | (layers < 1) | (ids <= np.concatenate([[self.last_id], ids[:-1]])) | (ints[:4].max(axis=0) > 2**31 - 1)
            )
            if bad.any():
                i = int(np.flatnonzero(bad)[0])
                raise ValueError(f"file {int(ids[i])} ({cols[1][i]!r}) has a malformed record")
            self.last_id = int(ids[-1])
            uuids, suffixes = self._names(cols[0], cols[1])
            tokens = np.frombuffer(b"".join(cols[9]), "<i4")
            if self.tokens.dtype == np.uint16 and tokens.size and (int(tokens.min()) < 0 or int(tokens.max()) > 0xFFFF):
                self.tokens = self.tokens.astype(np.int32)  # an id past 65,535: four bytes per token
            if self.used + len(tokens) > len(self.tokens):  # more rows than counted
                grown = np.empty(max(2 * len(self.tokens), self.used + len(tokens)), self.tokens.dtype)
                grown[: self.used] = self.tokens[: self.used]
                self.tokens = grown
            self.tokens[self.used : self.used + len(tokens)] = tokens
            self.used += len(tokens)
            self.parts.append((
                ids, ints, np.fromiter(map({f: self._code(f) for f in set(cols[2])}.__getitem__, cols[2]), np.uint8, n), np.array(suffixes, np.uint8),
                uuids, b"".join(cols[10]), np.array(cols[11], bool),
            ))

        def _names(self, ids: tuple[int, ...], names: tuple[str, ...]) -> tuple[bytes, list[int]]:
            """16 bytes and a suffix code per name: all at once when every name is 32
            lowercase hex digits, a dot and a known suffix, else name by name (a name
            that is not of this form is kept as it is)."""
            hexes = "".join([n[:32] for n in names])
            suffixes = [n[33:] for n in names]
            codes = {x: self._code(x) for x in set(suffixes) if _SUFFIX.fullmatch(x)}
            if (
                len(hexes) == 32 * len(names) and {n[32:33] for n in names} == {"."} and hexes == hexes.lower()
                and len(codes) == len(set(suffixes))
            ):
                try:
                    raw = bytes.fromhex(hexes)
                except ValueError:
                    raw = b""  # a character that is not a hex digit
                if len(raw) == 16 * len(names):  # (fromhex skips white space)
                    return raw, [codes[x] for x in suffixes]
            out, codes_out = [], []
            for fid, name in zip(ids, names):
                m = _NAME.fullmatch(name)
                if m is None:
                    self.odd[fid] = name
                    out.append(bytes(16))
                    codes_out.append(0)
                else:
                    out.append(bytes.fromhex(m.group(1)))
                    codes_out.append(self._code(m.group(2)))
            return b"".join(out), codes_out

        def build(self) -> FileTable:
            table = FileTable()
            if not self.parts:
                return table
            ids = np.concatenate([p[0] for p in self.parts])
            ints_all = np.concatenate([p[1] for p in self.parts], axis=1)
            tok_start = np.zeros(len(ids), np.int64)
            np.cumsum(ints_all[1][:-1], out=tok_start[1:])
            tok_start = _narrow(tok_start)
            ints = {c: _narrow(ints_all[k]) for k, c in enumerate(_INT_COLUMNS)}
            tokens = self.tokens if self.used == len(self.tokens) else self.tokens[: self.used].copy()
            table._set_columns(
                _narrow(ids) if ids[0] >= 0 else ids, ints, np.concatenate([p[6] for p in self.parts]),
                np.concatenate([p[2] for p in self.parts]), np.concatenate([p[3] for p in self.parts]),
                np.frombuffer(b"".join(p[4] for p in self.parts), np.uint8).reshape(-1, 16).copy(),
                _dedupe(np.frombuffer(b"".join(p[5] for p in self.parts), np.uint8).reshape(-1, 32)),
                tok_start, tokens, self.words, self.odd,
            )
            self.parts = []
            return table

    def __init__(self) -> None:
        self._set_columns(
            np.zeros(0, np.int64), {c: np.zeros(0, np.int64) for c in _INT_COLUMNS}, np.zeros(0, bool),
            np.zeros(0, np.uint8), np.zeros(0, np.uint8), np.zeros((0, 16), np.uint8),
            (np.zeros((0, 32), np.uint8), np.zeros(0, np.int64)), np.zeros(0, np.int64), np.zeros(0, np.int32), [], {},
        )

    def _set_columns(self, ids, ints, reordered, fmt, suffix, uuid, context, tok_start, tokens, words, odd) -> None:
        self._ids = ids
        self._ints = ints
        self._reordered = reordered
        self._fmt = fmt
        self._suffix = suffix
        self._uuid = uuid
        #: the distinct context digests and each file's (files that extend one shared
        #: prefix, e.g. a system prompt, have the same one)
        self._contexts, self._context_of = context
        self._tok_start = tok_start
        #: token ids of every file in the columns, one after the other (read-only: records
        #: and tree nodes are views of it, and a write through one would change the others)
        tokens.flags.writeable = False
        self.tokens = tokens
        self._words = words
        self._odd = odd
        self._alive = np.ones(len(ids), bool)
        self._n_alive = len(ids)
        #: records added (or replaced) since the columns were built
        self._added: dict[int, FileRecord] = {}
        #: ``sum(file_bytes)`` of the live files
        self.file_bytes = int(ints["file_bytes"].sum()) if len(ids) else 0

    # -- lookups -----------------------------------------------------------------------
    def _row(self, file_id: int) -> int:
        """Row of a live file in the columns, or -1."""
        i = find_sorted(self._ids, file_id)
        return i if i >= 0 and self._alive[i] else -1

    def _materialise(self, i: int) -> FileRecord:
        fid = int(self._ids[i])
        ints = [int(self._ints[c][i]) for c in _INT_COLUMNS]
        name = self._odd.get(fid)
        if name is None:
            name = f"{self._uuid[i].tobytes().hex()}.{self._words[self._suffix[i]]}"
        start = int(self._tok_start[i])
        tokens = self.tokens[start : start + ints[1]]
        if tokens.dtype != np.int32:
            tokens = tokens.astype(np.int32)
        return FileRecord(
            fid, name, self._words[self._fmt[i]], *ints, tokens, self._contexts[self._context_of[i]].tobytes(), bool(self._reordered[i])
        )

    def get(self, file_id: int, default: FileRecord | None = None) -> FileRecord | None:
        rec = self._added.get(file_id)
        if rec is not None:
            return rec
        i = self._row(file_id)
        return default if i < 0 else self._materialise(i)

    def __getitem__(self, file_id: int) -> FileRecord:
        rec = self.get(file_id)
        if rec is None:
            raise KeyError(file_id)
        return rec

    def __contains__(self, file_id: object) -> bool:
        return isinstance(file_id, (int, np.integer)) and (file_id in self._added or self._row(int(file_id)) >= 0)

    def __len__(self) -> int:
        return self._n_alive + len(self._added)

    def __iter__(self) -> Iterator[int]:
        for i in np.flatnonzero(self._alive).tolist():
            fid = int(self._ids[i])
            if fid not in self._added:
                yield fid
        yield from list(self._added)

    def keys(self) -> Iterator[int]:
        return iter(self)

    def values(self) -> Iterator[FileRecord]:
        for fid in list(self):
            rec = self.get(fid)
            if rec is not None:
                yield rec

    def rows_of(self, file_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """For the tree loader: each id's ``(found, n_tokens, token start)`` in the columns."""
        ids = self._ids
        i = np.minimum(np.searchsorted(ids, file_ids), max(0, len(ids) - 1))
        if not len(ids):
            z = np.zeros(len(file_ids), np.int64)
            return np.zeros(len(file_ids), bool), z, z
        found = (ids[i] == file_ids) & self._alive[i]
        return found, self._ints["n_tokens"][i], self._tok_start[i]

    def names(self) -> set[str]:
        """Every file's name."""
        out = {rec.name for rec in self._added.values()}
        rows = np.flatnonzero(self._alive)
        if self._odd:
            out.update(self._odd[fid] for fid in self._ids[rows].tolist() if fid in self._odd)
            rows = rows[~np.isin(self._ids[rows], np.fromiter(self._odd, np.int64, len(self._odd)))]
        hexes, words = self._uuid[rows].tobytes().hex(), self._words
        out.update(f"{hexes[32 * j : 32 * j + 32]}.{words[c]}" for j, c in enumerate(self._suffix[rows].tolist()))
        return out

    def unlisted(self, batches: Iterable[list[str]], suffixes: tuple[str, ...]) -> list[str]:
        """The entries of a directory listing (given in ``batches`` of names) that are not
        the name of a file held in the columns in the standard form (32 lowercase hex
        digits, a dot and its suffix, one of ``suffixes``): usually none. Records added
        since the load and odd names are never matched. Vectorised: no string per file
        is made, and a batch's names are dropped before the next is listed."""
        listed = self._alive.copy()
        if self._odd:
            listed &= ~np.isin(self._ids, np.fromiter(self._odd, np.int64, len(self._odd)))
        known = {w: _Sorted(self._uuids_where(listed & (self._suffix == self._words.index(w)))) for w in suffixes if w in self._words}
        out: list[str] = []
        for names in batches:
            lengths = np.fromiter(map(len, names), np.int64, len(names))
            matched = np.zeros(len(names), bool)
            for word, table in known.items():
                at = np.flatnonzero(lengths == 33 + len(word))
                group = [names[i] for i in at.tolist()]
                ascii_ = np.fromiter(map(str.isascii, group), bool, len(group))
                if not ascii_.all():  # (not a name of ours)
                    at, group = at[ascii_], [g for g, a in zip(group, ascii_.tolist()) if a]
                if not group:
                    continue
                chars = np.frombuffer("".join(group).encode("ascii"), np.uint8).reshape(len(group), 33 + len(word))
                nibbles = _HEX[chars[:, :32]]
                ok = (
                    (nibbles < 16).all(axis=1) & (chars[:, 32] == ord("."))
                    & (chars[:, 33:] == np.frombuffer(word.encode(), np.uint8)).all(axis=1)
                )
                ok &= table.has((nibbles[:, 0::2] << 4 | nibbles[:, 1::2]).astype(np.uint8))
                matched[at[ok]] = True
            out += [names[i] for i in np.flatnonzero(~matched).tolist()]
        return out

    def _uuids_where(self, mask: np.ndarray) -> np.ndarray:
        """The 16-byte names of the rows ``mask`` selects: the column itself when it
        selects every row, else a copy in a `scratch` array."""
        if mask.all():
            return self._uuid
        rows = np.flatnonzero(mask)
        out = scratch((len(rows), 16), np.uint8)
        np.take(self._uuid, rows, axis=0, out=out)
        return out

    def odd_names(self) -> set[str]:
        """The names that are not 32 lowercase hex digits, a dot and a short suffix (and
        those of records added since the load, whatever they are)."""
        return set(self._odd.values()) | {rec.name for rec in self._added.values()}

    # -- updates -----------------------------------------------------------------------
    def __setitem__(self, file_id: int, record: FileRecord) -> None:
        self.pop(file_id, None)
        self._added[file_id] = record
        self.file_bytes += record.file_bytes

    def pop(self, file_id: int, default: FileRecord | None = None) -> FileRecord | None:
        rec = self._added.pop(file_id, None)
        if rec is None:
            i = self._row(file_id)
            if i < 0:
                return default
            rec = self._materialise(i)
            self._alive[i] = False
            self._n_alive -= 1
        self.file_bytes -= rec.file_bytes
        return rec
