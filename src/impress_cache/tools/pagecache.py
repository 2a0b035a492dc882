"""Evicting a store's chunk files from the page cache, for cold-read measurements."""

from __future__ import annotations

import os
from pathlib import Path

from ..store.catalog import CHUNK_DIR


def drop_file(path: str | os.PathLike[str]) -> None:
    """Evict one file from this machine's page cache (``fsync``, then
    ``POSIX_FADV_DONTNEED``); ``FileNotFoundError`` if it is gone."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def drop_page_cache(store_dir: str | os.PathLike[str]) -> None:
    """Evict a store's chunk files from this machine's page cache.

    ``fsync`` then ``POSIX_FADV_DONTNEED`` on every chunk file, so the next reads come from
    the device ("guest-cold": in a VM the hypervisor may still cache them).
    """
    for f in (Path(store_dir) / CHUNK_DIR).iterdir():
        try:
            drop_file(f)
        except FileNotFoundError:  # a temporary file renamed, or a file evicted, since the listing
            continue
