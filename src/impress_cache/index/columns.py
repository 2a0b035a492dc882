"""Numeric columns held in fewer bytes without changing a value.

Saved statistics are read as ``float64`` columns, but most of their columns hold small
integers (counts, sequence numbers) or a few distinct values (the time of each save, a
frequency after one or two accesses): `PackedColumns` keeps each column in the
narrowest form that gives back exactly the same 64-bit values (the bit patterns are
compared: ``-0.0`` and NaN are kept as they are) and reads like the ``float64 [n, k]``
array it was made from.

`scratch` gives a large temporary array its own memory mapping, so that its pages go
back to the system when it is freed: a thread's C heap keeps the pages of freed
temporaries at its top resident (``malloc_trim`` releases free pages inside every
arena, but shrinks only the top of the main thread's heap).
"""

from __future__ import annotations

import mmap
from typing import Any

import numpy as np

#: the narrow types a column is tried in, smallest first
_NARROW = (np.uint8, np.uint16, np.float32, np.uint32)


#: rows per step of the checks and lookups below (small temporaries)
_STEP = 8192


def scratch(shape: int | tuple[int, ...], dtype: Any) -> np.ndarray:
    """A zeroed array in an anonymous mapping of its own (unmapped once the array and
    its views are gone); an ordinary one when it is empty."""
    dtype = np.dtype(dtype)
    size = int(np.prod(shape)) * dtype.itemsize
    if size == 0:
        return np.zeros(shape, dtype)
    private = {"flags": mmap.MAP_PRIVATE} if hasattr(mmap, "MAP_PRIVATE") else {}  # (not shared with a forked child)
    return np.frombuffer(mmap.mmap(-1, size, **private), dtype).reshape(shape)


def _index_type(n: int) -> type:
    for t in (np.uint8, np.uint16, np.uint32):
        if n <= np.iinfo(t).max + 1:
            return t
    return np.int64


def _holds(col: np.ndarray, t: type) -> bool:
    """Whether type ``t`` holds every value of ``col`` (``float64``) bit for bit."""
    with np.errstate(invalid="ignore", over="ignore"):
        for k in range(0, len(col), _STEP):
            c = col[k : k + _STEP]
            if not np.array_equal(c.astype(t).astype(np.float64).view(np.int64), c.view(np.int64)):
                return False
    return True


def _pack(col: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
    """One ``float64`` column as ``(values, None)`` in a narrower type that holds it
    exactly, or as ``(index, table)`` of its distinct values, whichever takes fewer
    bytes (a ``float64`` copy when neither is smaller). Temporaries of a few steps'
    rows, and the sort in a `scratch` array."""
    t = next((t for t in _NARROW if _holds(col, t)), np.float64)
    size = len(col) * np.dtype(t).itemsize
    if len(col) > 1 and np.dtype(t).itemsize > 1:
        bits = scratch(len(col), np.int64)
        bits[:] = col.view(np.int64) if col.flags.c_contiguous else np.ascontiguousarray(col).view(np.int64)
        bits.sort(kind="stable")
        distinct = bits[np.concatenate(([True], bits[1:] != bits[:-1]))]
        del bits
        it = _index_type(len(distinct))
        if len(distinct) * 8 + len(col) * np.dtype(it).itemsize < size:
            index = np.empty(len(col), it)
            for k in range(0, len(col), _STEP):
                c = np.ascontiguousarray(col[k : k + _STEP]).view(np.int64)
                index[k : k + _STEP] = np.searchsorted(distinct, c)
            return index, distinct.view(np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        return col.astype(t), None


class PackedColumns:
    """A read-only ``float64 [n, k]`` array kept as narrow columns (`_pack`). Indexing
    gives what the array would: ``[i]`` a row, ``[rows]`` (an index array or a slice)
    the rows, ``[rows, j]`` one column of them (all ``float64``)."""

    __slots__ = ("shape", "_cols")

    def __init__(self, array: np.ndarray) -> None:
        if array.dtype != np.float64:
            array = np.asarray(array, np.float64)
        if array.ndim != 2:
            raise ValueError(f"columns need a 2-D array, not {array.ndim}-D")
        self.shape = array.shape
        self._cols = [_pack(array[:, j]) for j in range(array.shape[1])]

    def __len__(self) -> int:
        return self.shape[0]

    @property
    def nbytes(self) -> int:
        return sum(v.nbytes + (0 if t is None else t.nbytes) for v, t in self._cols)

    def column(self, j: int, rows: Any = slice(None)) -> np.ndarray:
        values, table = self._cols[j]
        picked = values[rows]
        return table[picked] if table is not None else np.asarray(picked, np.float64)

    def __getitem__(self, key: Any) -> np.ndarray:
        if isinstance(key, tuple):
            rows, j = key
            return self.column(j, rows)
        if isinstance(key, (int, np.integer)):
            return np.array([float(self.column(j, key)) for j in range(self.shape[1])], np.float64)
        cols = [self.column(j, key) for j in range(self.shape[1])]
        if not cols:
            return np.zeros((len(np.zeros(self.shape[0])[key]), 0), np.float64)
        return np.stack(cols, axis=1)

    def to_array(self) -> np.ndarray:
        return self[slice(None)]
