"""How the index reports trouble: every SQLite error, and every malformed value read
back, becomes an `ImpressError` naming the index file."""

from __future__ import annotations

import functools
import os
import shutil
import sqlite3
import stat
from pathlib import Path
from typing import Any

from ..errors import ImpressError, ReadOnlyStoreError, StoreFormatError, StoreIOError

#: what a damaged index raises while it is read (values that do not decode, blobs of the wrong size)
_DAMAGE = (sqlite3.Error, ValueError, TypeError, KeyError, IndexError, UnicodeError)
_IO_CODES = {
    sqlite3.SQLITE_FULL, sqlite3.SQLITE_IOERR, sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED, sqlite3.SQLITE_READONLY,
    sqlite3.SQLITE_CANTOPEN, sqlite3.SQLITE_PERM, sqlite3.SQLITE_NOMEM, sqlite3.SQLITE_INTERRUPT,
    sqlite3.SQLITE_NOLFS, sqlite3.SQLITE_PROTOCOL, sqlite3.SQLITE_AUTH,
}


def index_error(path: Path, exc: BaseException) -> ImpressError:
    """The `ImpressError` for an error met while using the index at ``path``."""
    code = (getattr(exc, "sqlite_errorcode", None) or 0) & 0xFF
    if isinstance(exc, sqlite3.Error) and code in _IO_CODES:
        what = f"cannot use the index {path}: {exc}"
        if code in (sqlite3.SQLITE_FULL, sqlite3.SQLITE_IOERR, sqlite3.SQLITE_CANTOPEN):
            try:
                free = shutil.disk_usage(path.parent).free
                what += f" ({free} bytes free on its file system{'; the disk is full' if free < 1 << 20 else ''})"
            except OSError:
                pass
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


def _check_regular(path: Path) -> None:
    """Refuse an index path that is a symbolic link or anything but a regular file."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISREG(st.st_mode):
        kind = "a symbolic link" if stat.S_ISLNK(st.st_mode) else "not a regular file"
        raise StoreFormatError(
            f"{path} is {kind}; impress_cache only opens an index file it created. Remove it or choose another "
            "store directory."
        )


def _guarded(fn: Any) -> Any:
    @functools.wraps(fn)
    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(self, *args, **kwargs)
        except _DAMAGE as exc:
            raise index_error(self.path, exc) from exc

    return method


