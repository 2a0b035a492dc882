"""Bytes a directory takes on disk, for the benchmarks and tests that check a budget."""

from __future__ import annotations

import os
from pathlib import Path


def du(path: Path) -> int:
    """Bytes allocated under ``path``, directories included (``du -s --block-size=1``).

    Other processes may unlink chunk files while the walk runs (eviction); a file gone
    between its listing and its ``lstat`` counts as zero, as it no longer takes space.
    """
    total = os.lstat(path).st_blocks * 512
    for dirpath, dirnames, filenames in os.walk(path):
        for name in dirnames + filenames:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_blocks * 512
            except FileNotFoundError:
                pass
    return total
