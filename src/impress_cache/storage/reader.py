"""Read sets of blocks with explicit, coalesced ``os.preadv`` calls.

Memory-mapped partial reads pull whole files through the kernel's read-ahead (see
FACTS.md), so blocks are read with ``preadv`` at the offsets the index recorded.
Blocks that are neighbours in the file (separated only by alignment padding) are merged
into one request, and requests run on a thread pool so several are in flight at once.
Every block's CRC-32 is checked before its bytes are handed out.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from ..errors import CorruptBlockError
from .base import ALIGN, crc32


@dataclass(frozen=True)
class ReadRequest:
    """One block to read: ``nbytes`` at ``offset`` of ``path``, expected CRC-32."""

    file_id: int
    path: Path
    offset: int
    nbytes: int
    crc32: int


class BlockReader:
    """Reads blocks in parallel; counts the bytes it asked the device for."""

    def __init__(self, threads: int = 8, max_merge_bytes: int = 8 * 2**20) -> None:
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="impress-read")
        self.max_merge_bytes = max_merge_bytes

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def read(self, requests: Sequence[ReadRequest]) -> tuple[list[memoryview], int]:
        """Return each request's bytes (in request order) and the bytes read in total.

        Raises `CorruptBlockError` (with the offending ``file_id``) when a file
        is missing or short, or a block fails its checksum.
        """
        order = sorted(range(len(requests)), key=lambda i: (str(requests[i].path), requests[i].offset))
        runs: list[list[int]] = []
        for i in order:
            r = requests[i]
            if runs:
                last = requests[runs[-1][-1]]
                first = requests[runs[-1][0]]
                gap = r.offset - (last.offset + last.nbytes)
                if (
                    r.path == last.path
                    and 0 <= gap < ALIGN
                    and r.offset + r.nbytes - first.offset <= self.max_merge_bytes
                ):
                    runs[-1].append(i)
                    continue
            runs.append([i])
        out: list[memoryview | None] = [None] * len(requests)
        futures = [self._pool.submit(self._read_run, [requests[i] for i in run]) for run in runs]
        total = 0
        errors: list[BaseException] = []
        for run, fut in zip(runs, futures):
            try:
                views, n = fut.result()
            except CorruptBlockError as exc:
                errors.append(exc)
                continue
            total += n
            for i, view in zip(run, views):
                out[i] = view
        if errors:
            raise errors[0]
        return out, total  # type: ignore[return-value]

    @staticmethod
    def _read_run(run: list[ReadRequest]) -> tuple[list[memoryview], int]:
        start = run[0].offset
        end = run[-1].offset + run[-1].nbytes
        buf = bytearray(end - start)
        view = memoryview(buf)
        file_id = run[0].file_id
        try:
            fd = os.open(run[0].path, os.O_RDONLY)
        except OSError as exc:
            raise CorruptBlockError(f"cannot open chunk file {run[0].path}: {exc}", file_id) from exc
        try:
            got = 0
            while got < len(buf):
                n = os.preadv(fd, [view[got:]], start + got)
                if n == 0:
                    raise CorruptBlockError(
                        f"chunk file {run[0].path} is truncated: wanted bytes up to {end}, "
                        f"file ends at {start + got}",
                        file_id,
                    )
                got += n
        finally:
            os.close(fd)
        views = []
        for r in run:
            piece = view[r.offset - start : r.offset - start + r.nbytes]
            if crc32(piece) != r.crc32:
                raise CorruptBlockError(
                    f"checksum mismatch in {r.path} at offset {r.offset} ({r.nbytes} bytes)", file_id
                )
            views.append(piece)
        return views, len(buf)
