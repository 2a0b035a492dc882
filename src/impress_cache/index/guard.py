"""How the index reports trouble: every error of the database (SQLite's, from its content
or its disk), and every malformed value a reading method decodes, becomes an
`ImpressError` naming the index file. A wrong call in the package's own code (SQLite's
``ProgrammingError`` and ``InterfaceError``: bad SQL or bindings, a closed connection;
a ``TypeError`` or ``ValueError`` in a method that only writes what it is given) is a
bug and is raised as it is, never disguised as a damaged store."""

from __future__ import annotations

import errno
import functools
import resource
import shutil
import sqlite3
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ImpressError, IndexRefusedError, ReadOnlyStoreError, StoreFormatError, StoreIOError
from ..storage.base import kind_of
from .schema import REFUSAL

#: what a value read back from a damaged index raises while it is decoded (blobs of the
#: wrong size, text that is not JSON, numbers where there should be bytes)
MALFORMED = (ValueError, TypeError, KeyError, IndexError, UnicodeError)
_IO_CODES = {
    sqlite3.SQLITE_FULL, sqlite3.SQLITE_IOERR, sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED, sqlite3.SQLITE_READONLY,
    sqlite3.SQLITE_CANTOPEN, sqlite3.SQLITE_PERM, sqlite3.SQLITE_NOMEM, sqlite3.SQLITE_INTERRUPT,
    sqlite3.SQLITE_NOLFS, sqlite3.SQLITE_PROTOCOL, sqlite3.SQLITE_AUTH,
}


def index_error(path: Path, exc: BaseException) -> ImpressError:
    """The `ImpressError` for an error met while using the index at ``path``."""
    code = (getattr(exc, "sqlite_errorcode", None) or 0) & 0xFF
    if isinstance(exc, sqlite3.IntegrityError) and REFUSAL in str(exc):
        return IndexRefusedError(
            f"the index {path} refused a change planned from a state that changed meanwhile ({exc}); "
            "nothing was committed and the index is intact"
        )
    if isinstance(exc, sqlite3.Error) and code in _IO_CODES:
        what = f"cannot use the index {path}: {exc}"
        if code in (sqlite3.SQLITE_FULL, sqlite3.SQLITE_IOERR, sqlite3.SQLITE_CANTOPEN):
            what += room_left(path.parent)
        if code == sqlite3.SQLITE_FULL:
            what += WAY_OUT
        if code == sqlite3.SQLITE_READONLY:
            return ReadOnlyStoreError(
                what + ". A store on a read-only path can only serve: open it with "
                "ImpressStore(path, model, config, read_only=True)"
            )
        return StoreIOError(what)
    return StoreFormatError(
        f"the index {path} is damaged ({type(exc).__name__}: {exc}). Rebuild it from the chunk files with "
        f"`impress-cache verify --repair {path.parent}`."
    )


#: what to do when the store cannot write (a full disk, a file-size limit)
WAY_OUT = (
    ". Free some space (or raise the limit) or lower the store's disk_bytes; to keep serving what is "
    "stored without writing, open it with ImpressStore(path, model, config, read_only=True)"
)
#: ``errno`` values that say the store has no room to write
NO_ROOM = frozenset({errno.ENOSPC, errno.EFBIG, errno.EDQUOT})


def room_left(directory: Path) -> str:
    """What limits writes in ``directory``: the process's file-size limit when one is set
    (``RLIMIT_FSIZE``: a write past it fails with ``EFBIG`` however much space is free),
    and the bytes free on its file system."""
    parts = []
    try:
        limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
        if limit != resource.RLIM_INFINITY:
            parts.append(f"this process may write files of at most {limit} bytes (RLIMIT_FSIZE, `ulimit -f`)")
    except (OSError, ValueError):
        pass
    try:
        free = shutil.disk_usage(directory).free
        parts.append(f"{free} bytes free on its file system{'; the disk is full' if free < 1 << 20 else ''}")
    except OSError:
        pass
    return f" ({'; '.join(parts)})" if parts else ""


def is_damage(exc: BaseException, decoding: bool = False) -> bool:
    """Whether ``exc`` comes from the index (its content or its disk) rather than from a
    wrong call in our code; ``decoding``: raised while values read back were decoded."""
    if isinstance(exc, (ImpressError, sqlite3.ProgrammingError, sqlite3.InterfaceError)):
        return False
    # (an error SQLite reports about damaged schema text can itself fail to decode)
    return isinstance(exc, (sqlite3.Error, UnicodeDecodeError)) or (decoding and isinstance(exc, MALFORMED))


def float_rows(rows: list[tuple] | list[list]) -> np.ndarray:
    """Rows of numbers read back as ``float64 [n, m]``. A value that is not a number (a
    damaged row's text, bytes or NULL) becomes NaN: its caller skips that row, not all."""
    try:
        out = np.array(rows, dtype=np.float64)
    except (ValueError, TypeError):  # (rare: one value per call from here on)
        out = np.array([[v if isinstance(v, (int, float)) else np.nan for v in r] for r in rows], np.float64)
    return out.reshape(len(rows), -1)


def _check_regular(path: Path) -> None:
    """Refuse an index path that is a symbolic link or anything but a regular file."""
    kind = kind_of(path)
    if kind not in (None, "file"):
        described = "a symbolic link" if kind == "link" else "not a regular file"
        raise StoreFormatError(
            f"{path} is {described}; impress_cache only opens an index file it created. Remove it or choose "
            "another store directory."
        )


def _guarded(fn: Any, decoding: bool = False) -> Any:
    """``fn`` with the errors `is_damage` names raised as `index_error`."""

    @functools.wraps(fn)
    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(self, *args, **kwargs)
        except Exception as exc:
            if not is_damage(exc, decoding):
                raise
            raise index_error(self.path, exc) from exc

    return method


