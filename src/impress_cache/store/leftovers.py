"""Crash leftovers in ``chunks/``: files the index does not list, removed when no writer
is at work on any file, and the quarantine folder damaged or unrecognised files move to.

A write creates ``<name>.tmp``, renames it and then commits it to the index; a crash in
between leaves an unlisted file. The scan lists ``chunks/`` and removes such files, but
only while it holds the exclusive side of the store's `CreationGate` (every writer of
every process holds the shared side from before it creates a file until the file is
committed or removed), so a file another writer is creating, or has just committed, is
never taken for a leftover. A store runs the scan on its writer thread before the first
write (`PromptWriter.start_scan`), so opening a large store does not wait for the
listing; a store whose index lists no files scans while it opens.
"""

from __future__ import annotations

import itertools
import logging
import os
import stat
from collections.abc import Callable

from ..errors import ImpressError, StoreFormatError
from ..index.files import release_free_heap
from ..storage import FORMATS
from .catalog import Catalog
from .chunkfiles import FILE_NAME
from .directory import dir_mode, ensure_dir

log = logging.getLogger(__name__)

QUARANTINE_DIR = "quarantine"
#: suffixes of `FILE_NAME` (an indexed name of 32 hex digits, a dot and one of these is one)
_SUFFIXES = (".safetensors", ".h5")
#: names listed and compared at a time (the listing's memory stays small: its strings are
#: Python objects, and Python keeps the pages of their freed pools)
_LIST_BATCH = 1024


def move_aside(catalog: Catalog, name: str, file_mode: int) -> None:
    """Move the chunk file ``name`` into the quarantine folder (never deleted)."""
    qdir = catalog.root / QUARANTINE_DIR
    try:
        ensure_dir(qdir, dir_mode(file_mode), "the quarantine folder")
    except ImpressError as exc:
        log.warning("%s; leaving %s in place", exc, name)
        return
    if qdir.is_symlink() or not qdir.is_dir():
        log.warning("%s is not a directory of this store; leaving %s in place", qdir, name)
        return
    qfd = os.open(qdir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        os.replace(name, name, src_dir_fd=catalog.chunks_fd, dst_dir_fd=qfd)
    except FileNotFoundError:
        pass
    finally:
        os.close(qfd)


def remove_leftovers(catalog: Catalog, file_mode: int, deferred: Callable[[], set[str]] | None = None) -> bool:
    """Delete temp files and chunk files the index does not know (crash leftovers), if no
    writer of any process is creating a file now. Returns False (nothing done) when one
    is; call again later. ``deferred()`` names files out of the index whose unlink waits
    for a lease (`LeaseTable.deferred_names`): a request may still read them, so they
    are not leftovers. Before a file is removed the index itself is asked (the
    catalog's view could lag behind it after a failed reload).

    Raises `StoreFormatError` when ``chunks/`` holds anything the store does not write
    (it never deletes files it did not create).
    """
    with catalog.gate.exclusive() as free:
        if not free:
            return False
        _scan(catalog, file_mode, deferred or set)
    return True


def _scan(catalog: Catalog, file_mode: int, deferred: Callable[[], set[str]]) -> None:
    # no writer is between creating a file and committing it: every file is listed in
    # the index as it is now (the catalog reloads if another process committed since it
    # loaded) or is a leftover
    with catalog.lock:
        catalog.refresh()
        # every name but those of indexed files in the standard form (usually none)
        with os.scandir(catalog.chunks_fd) as entries:
            batches = iter(lambda: [e.name for e in itertools.islice(entries, _LIST_BATCH)], [])
            rest = catalog.records.unlisted(batches, tuple(x[1:] for x in _SUFFIXES))
    foreign: list[str] = []
    orphans: list[str] = []
    if rest:
        with catalog.lock:  # one view: a file leaves the records and joins the deferred ones under this lock
            known = catalog.records.names()
            odd = catalog.records.odd_names()
            waiting = deferred() | catalog.moving_aside
        for name in rest:
            if name in known and name not in odd and name.endswith(_SUFFIXES):
                continue  # an indexed chunk file (one replaced by something else: quarantined when read)
            ours = FILE_NAME.match(name) or (name.endswith(".tmp") and FILE_NAME.match(name[:-4]))
            regular = _is_file(catalog.chunks_fd, name)
            if regular is None:
                continue  # gone since the listing: nothing to keep or remove
            if ours and name in known and not regular:
                continue  # an indexed file replaced by something else: quarantined when read
            if not ours or not regular:
                foreign.append(name)
            elif name not in known:
                orphans.append(name)
        del known
    if foreign:
        shown = ", ".join(sorted(foreign)[:5]) + (" ..." if len(foreign) > 5 else "")
        raise StoreFormatError(
            f"{catalog.chunks} holds {len(foreign)} entr{'y' if len(foreign) == 1 else 'ies'} this store did "
            f"not write ({shown}); impress_cache deletes files in its own folders, so it will not open "
            "a store there. Move them away or choose another store directory."
        )
    for name in orphans:
        if name in waiting:
            continue  # left the index; unlinked when the last lease on it goes (or being quarantined)
        if not name.endswith(".tmp") and catalog.index.has_file(name):
            log.warning("%s is in the index but not in this store's view of it; keeping it", name)
            catalog.mark_stale()
            continue
        if name.endswith(".tmp") or _has_own_header(catalog, name):
            log.info("removing unindexed file %s (left by an interrupted write)", name)
            catalog.unlink(name)
        else:  # named like ours but without our header: never deleted, moved aside
            log.warning("unindexed file %s has no impress_cache header; moving it to %s/", name, QUARANTINE_DIR)
            move_aside(catalog, name, file_mode)
    del rest, foreign, orphans
    release_free_heap()  # the scan's names


def _has_own_header(catalog: Catalog, name: str) -> bool:
    """Whether a chunk file's header says this store wrote it (its UUID is its name)."""
    fmt = next((cls for cls in FORMATS.values() if name.endswith("." + cls.suffix)), None)
    try:
        meta = fmt().read_metadata(catalog.chunks / name) if fmt is not None else {}
    except Exception:  # noqa: BLE001 - any unreadable header: not provably ours
        return False
    return "impress_cache" in meta and meta.get("uuid") == name[:32]


def _is_file(dir_fd: int, name: str) -> bool | None:
    """Whether ``name`` in the directory is a regular file (not following a link); None
    when it is gone since the directory was listed (removed by a writer or the budget)."""
    try:
        return stat.S_ISREG(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except FileNotFoundError:
        return None
    except OSError:
        return False
