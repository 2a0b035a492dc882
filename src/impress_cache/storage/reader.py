"""Read sets of blocks straight into caller-owned memory with coalesced ``os.preadv``.

Memory-mapped partial reads pull whole files through the kernel's read-ahead (8 MiB on
the machines this project is measured on), so blocks are read with ``preadv`` at the
offsets the index recorded. Blocks that are neighbours in a file (separated only by
alignment padding) are merged into one request whose iovecs scatter each block into its
own destination (adjacent destinations share one iovec) and the padding into a scratch
buffer; requests run on a thread pool so several are in flight at once. Every block is
verified against its checksum (CRC-32C from the block's seed, in the reading thread,
without the GIL) before the batch is reported done. A group with a `RowPlacement` is read
in cache-sized runs through a staging buffer and its rows placed where they belong
(`placed`: straight into a layer's buffer, each block verified before it is copied),
with ``O_DIRECT`` where the group has such a descriptor (`DirectCounts`).
"""

from __future__ import annotations

import errno
import os
import stat
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import CorruptBlockError, StoreIOError
from .base import ALIGN, align_up, checksum
from .pagecache import cached_bytes
from .placed import STAGE_BYTES, RowPlacement, place, stage_buffer

#: reader tasks per group of placed rows (`placed`): two shares keep two reads of a layer in
#: flight beside the loader's window of layers; more only add thread switches on the GIL
#: (measured on 2 cores: docs/performance.md, "Exact reuse from disk")
PLACED_SHARES = 2

#: iovecs per ``preadv`` call (Linux IOV_MAX is 1024; a block may need a gap iovec)
_MAX_IOV = 1000


@dataclass(frozen=True)
class Extent:
    """One block to read: ``nbytes`` at ``offset`` of ``path`` into ``dest[:nbytes]``,
    expected to have checksum ``expected`` from ``seed``."""

    file_id: int
    path: Path
    offset: int
    nbytes: int
    expected: int
    dest: memoryview
    seed: int = 0


class DirectCounts:
    """How the runs of placed reads were read: ``direct`` with ``O_DIRECT``; ``buffered``
    through the page cache because the group had no ``O_DIRECT`` descriptor or the run
    did not start 4 KiB aligned; ``refused``: tried with ``O_DIRECT``, refused by the
    file system (``EINVAL``, ``EOPNOTSUPP``), then read through the page cache. Shared by reader threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.direct = self.buffered = self.refused = 0

    def add(self, direct: int = 0, buffered: int = 0, refused: int = 0) -> None:
        with self._lock:
            self.direct += direct
            self.buffered += buffered
            self.refused += refused


@dataclass
class FileBlocks:
    """Blocks of one file to read into one destination buffer (arrays of equal length)."""

    file_id: int
    path: Path
    fd: int | None
    offsets: np.ndarray  # int64
    nbytes: np.ndarray  # int64
    expected: np.ndarray  # uint32
    seeds: np.ndarray  # uint32
    dest: np.ndarray  # int64 byte offsets into the destination buffer
    #: called on a reader thread before the blocks are read (e.g. to fetch them from a
    #: remote tier into the file); its `CorruptBlockError` fails the read like a bad block
    before: Callable[[], None] | None = None
    #: rows placed into their positions (`placed`) instead of whole blocks at ``dest``
    place: RowPlacement | None = None
    #: placed rows only: a descriptor of the same file opened with ``O_DIRECT`` (runs read
    #: past the page cache), and where to count how each run was read
    direct_fd: int | None = None
    counts: DirectCounts | None = None
    #: with ``direct_fd``: read a share of runs that is mostly in the page cache through
    #: it (`pagecache.cached_bytes`), the rest with ``O_DIRECT``
    unless_cached: bool = False
    #: called once when no read of the group uses ``fd`` or ``direct_fd`` any more (they
    #: were lent for it: `OpenFiles.lend`), by `BlockReader.submit` (see there)
    done: Callable[[], None] | None = None


def release_all(groups: Sequence[FileBlocks]) -> None:
    """Call every group's ``done``: groups made but never handed to `BlockReader.submit`."""
    for g in groups:
        if g.done is not None:
            g.done()


class _Tally:
    """Calls a group's ``done`` when the last of its reads has ended: one count for
    the submission of its reads, one more for each read task queued."""

    __slots__ = ("_done", "_n", "_lock")

    def __init__(self, done: Callable[[], None] | None) -> None:
        self._done, self._n, self._lock = done, 1, threading.Lock()

    def add(self) -> None:
        with self._lock:
            self._n += 1

    def end(self) -> None:
        with self._lock:
            self._n -= 1
            last = self._n == 0
        if last and self._done is not None:
            self._done()

    def if_cancelled(self, fut: Future[int]) -> None:
        if fut.cancelled():  # (never ran: its own `end` never came)
            self.end()


def _counted(tally: _Tally, fn: Callable[..., int], *args: object) -> int:
    """``fn(*args)`` as one read task of a group: counted out when it ends, before its
    future is done (a `ReadBatch.wait` that returns finds the group's ``done`` called)."""
    try:
        return fn(*args)
    finally:
        tally.end()


class ReadBatch:
    """Reads in flight; `wait` returns the bytes read from the device (gaps included)."""

    def __init__(self, futures: list[Future[int]]) -> None:
        self._futures = futures

    def done(self) -> bool:
        return all(f.done() for f in self._futures)

    def wait(self) -> int:
        """Block until every run is read and verified; raise the first error, a damaged
        block's or any other (`StoreIOError`...), only once every run has ended: no
        reader thread writes into the destination after this returns or raises (a
        caller that recomputes reuses it)."""
        total, error = 0, None
        for fut in self._futures:
            try:
                total += fut.result()
            except Exception as exc:  # noqa: BLE001 - raised below, after the other runs
                error = error or exc
        if error is not None:
            raise error
        return total


class BlockReader:
    """Reads blocks on a thread pool of ``threads`` workers."""

    def __init__(self, threads: int = 8, max_merge_bytes: int = 8 * 2**20) -> None:
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="impress-read")
        self._threads = threads
        self.max_merge_bytes = max_merge_bytes

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def read_into(self, extents: Sequence[Extent]) -> int:
        """Read and verify every extent (each into its own destination); return the bytes
        read from the device. Raises `CorruptBlockError` (with the offending
        ``file_id``) when a file is missing, not a regular file or short, or a block fails
        its checksum."""
        futures = []
        for e in extents:
            group = FileBlocks(
                e.file_id, e.path, None, np.array([e.offset]), np.array([e.nbytes]),
                np.array([e.expected], dtype=np.uint32), np.array([e.seed], dtype=np.uint32), np.array([0]),
            )
            self._submit_group(group, e.dest, _Tally(None), futures)
        return ReadBatch(futures).wait()

    def submit(self, groups: Sequence[FileBlocks], dest: memoryview, inline: bool = False) -> ReadBatch:
        """Start reading every group's blocks into ``dest`` at their ``dest`` offsets.
        ``inline``: read them now, in this thread, every run asked for first
        (`_ask_ahead`), except the groups whose blocks must be fetched first (a remote
        tier's linked files: `FileBlocks.before`), which go to the reader threads before
        the others are read; errors still surface at `ReadBatch.wait`.

        Takes over every group's ``done``: each is called once, when the last read of its
        group has ended, whether it read, failed or never started (this call raised
        before it), and before `ReadBatch.wait` returns."""
        futures: list[Future[int]] = []
        began = 0
        try:
            if inline:  # (stable: the fetched groups first, each kind in the given order)
                groups = sorted(groups, key=lambda g: g.before is None)
            ahead = _ask_ahead(groups, self._runs) if inline else [None] * len(groups)
            for g, runs in zip(groups, ahead):
                tally = _Tally(g.done)
                began += 1
                try:
                    if g.place is not None:
                        g.place.check(g.nbytes)
                    if inline and g.before is None:
                        futures.append(_now(self._read_all, g, dest, runs))
                    elif g.before is None:
                        self._submit_group(g, dest, tally, futures)
                    else:  # one task: make the blocks present, then read them all
                        self._queue(tally, futures, self._before_then_read, g, dest)
                finally:
                    tally.end()
        except BaseException:
            release_all(groups[began:])
            raise
        return ReadBatch(futures)

    def _queue(self, tally: _Tally, futures: list[Future[int]], fn: Callable[..., int], *args: object) -> None:
        """One read task of a group on the pool, counted in its ``tally``."""
        tally.add()
        try:
            fut = self._pool.submit(_counted, tally, fn, *args)
        except BaseException:
            tally.end()
            raise
        fut.add_done_callback(tally.if_cancelled)
        futures.append(fut)

    def _before_then_read(self, g: FileBlocks, dest: memoryview) -> int:
        assert g.before is not None
        g.before()
        return self._read_all(g, dest)

    def _read_all(self, g: FileBlocks, dest: memoryview, runs: list[np.ndarray] | None = None) -> int:
        if g.place is not None:
            return _read_placed(g, self._runs(g, STAGE_BYTES))
        return sum(_read_run(g, idx, dest) for idx in (self._runs(g) if runs is None else runs))

    def _submit_group(self, g: FileBlocks, dest: memoryview, tally: _Tally, futures: list[Future[int]]) -> None:
        if g.place is None:
            for idx in self._runs(g):
                self._queue(tally, futures, _read_run, g, idx, dest)
            return
        # placed rows: the runs in up to `PLACED_SHARES` contiguous shares, each read in
        # file order by one reader thread through its own staging buffer
        runs = self._runs(g, STAGE_BYTES)
        k = min(len(runs), PLACED_SHARES, self._threads)
        cuts = [i * len(runs) // k for i in range(k + 1)]
        ends = g.offsets + g.nbytes  # (a share after the first counts the gap before it: ``after``)
        for a, b in zip(cuts[:-1], cuts[1:]):
            self._queue(tally, futures, _read_placed, g, runs[a:b], None if a == 0 else int(ends[runs[a - 1][-1]]))

    def _runs(self, g: FileBlocks, max_bytes: int | None = None) -> list[np.ndarray]:
        """The group's blocks cut into runs, each read with one ``preadv`` (a run is at
        most ``max_bytes`` long unless one block is longer; default `max_merge_bytes`)."""
        limit = self.max_merge_bytes if max_bytes is None else min(max_bytes, self.max_merge_bytes)
        order = np.argsort(g.offsets, kind="stable")
        off, size = g.offsets[order], g.nbytes[order]
        ends = off + size
        # a new run starts where the gap to the previous block is negative or a whole
        # page or more, or where the run would grow too large
        gap = np.empty_like(off)
        gap[0] = 0
        gap[1:] = off[1:] - ends[:-1]
        breaks = np.flatnonzero((gap < 0) | (gap >= ALIGN))
        starts = [0, *breaks.tolist(), len(off)]
        runs = []
        for a, b in zip(starts[:-1], starts[1:]):
            lo = a
            while lo < b:
                hi = lo + 1
                while hi < b and ends[hi] - off[lo] <= limit and hi - lo < _MAX_IOV // 2:
                    hi += 1
                runs.append(order[lo:hi])
                lo = hi
        return runs


def _ask_ahead(
    groups: Sequence[FileBlocks], runs_of: Callable[[FileBlocks], list[np.ndarray]]
) -> list[list[np.ndarray] | None]:
    """Ask the kernel for every run of the groups an inline read reads in turn
    (``POSIX_FADV_WILLNEED``) before reading the first: the device then reads them side
    by side, as the reader threads' reads would, without handing each run to a thread
    (a run in the page cache costs a lookup). Returns each group's runs (``None`` for a
    group not asked for: without a kept descriptor, placed, or filled first)."""
    out: list[list[np.ndarray] | None] = []
    hint = True
    for g in groups:
        if g.fd is None or g.place is not None or g.before is not None:
            out.append(None)
            continue
        runs = runs_of(g)
        out.append(runs)
        ends = g.offsets + g.nbytes
        for idx in runs if hint else ():
            start = int(g.offsets[idx[0]])
            try:
                os.posix_fadvise(g.fd, start, int(ends[idx[-1]]) - start, os.POSIX_FADV_WILLNEED)
            except OSError:  # a hint only: none more
                hint = False
                break
    return out


def _now(fn: Callable[..., int], *args: object) -> Future[int]:
    """``fn(*args)`` run here, as a finished future (its exception kept for `ReadBatch.wait`)."""
    fut: Future[int] = Future()
    try:
        fut.set_result(fn(*args))
    except Exception as exc:  # noqa: BLE001 - raised again by ReadBatch.wait, like a pool task's
        fut.set_exception(exc)
    return fut


#: errors of a read that say nothing about the file (out of descriptors or memory, a
#: signal): the request recomputes, the file is not quarantined
TRANSIENT = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.EAGAIN, errno.EINTR, errno.ENOBUFS})


def read_failed(what: str, exc: OSError, file_id: int) -> CorruptBlockError | StoreIOError:
    """The error for an ``OSError`` met while opening or reading a chunk file: a
    transient one (`TRANSIENT`) is a `StoreIOError` (recompute, remove nothing), any
    other one says the file is damaged or gone (`CorruptBlockError`: quarantine)."""
    if exc.errno in TRANSIENT:
        return StoreIOError(f"{what}: {exc} (a passing condition: nothing is removed, the request recomputes)")
    return CorruptBlockError(f"{what}: {exc}", file_id)


def open_chunk_file(path: str | Path, file_id: int, dir_fd: int | None = None, shown: Path | None = None) -> int:
    """A read-only descriptor of a chunk file (``path`` relative to ``dir_fd`` if given):
    no symbolic links, never blocking on a FIFO, regular files only; `CorruptBlockError`
    (naming ``shown``, else ``path``) otherwise."""
    name = shown if shown is not None else path
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError as exc:
        raise read_failed(f"cannot open chunk file {name}", exc, file_id) from exc
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise CorruptBlockError(f"chunk file {name} is not a regular file", file_id)
    return fd


def _read_run(g: FileBlocks, idx: np.ndarray, dest: memoryview) -> int:
    offsets, sizes, dests = g.offsets[idx], g.nbytes[idx], g.dest[idx]
    start = int(offsets[0])
    end = int(offsets[-1] + sizes[-1])
    # iovecs: destination ranges, merged when both the file and the destination continue
    spans: list[list[int]] = []  # [dest_start, length] or [-1, gap length]
    pos = start
    for off, n, d in zip(offsets.tolist(), sizes.tolist(), dests.tolist()):
        if off > pos:
            spans.append([-1, off - pos])
        elif spans and spans[-1][0] >= 0 and spans[-1][0] + spans[-1][1] == d:
            spans[-1][1] += n
            pos = off + n
            continue
        spans.append([d, n])
        pos = off + n
    iovecs = [memoryview(bytearray(n)) if d < 0 else dest[d : d + n] for d, n in spans]
    fd = g.fd if g.fd is not None else open_chunk_file(g.path, g.file_id)
    try:
        _preadv_all(fd, iovecs, start, g, end)
    finally:
        if g.fd is None:
            os.close(fd)
    for off, n, d, want, seed in zip(
        offsets.tolist(), sizes.tolist(), dests.tolist(), g.expected[idx].tolist(), g.seeds[idx].tolist()
    ):
        if checksum(dest[d : d + n], seed, release=n >= RELEASE_BYTES) != want:
            raise CorruptBlockError(f"checksum mismatch in {g.path} at offset {off} ({n} bytes)", g.file_id)
    return end - start


#: a block this large is verified with the GIL handed over (`checksum`); a smaller one is
#: verified holding it (no thread switch per block)
RELEASE_BYTES = 1 << 16


def _read_placed(g: FileBlocks, runs: list[np.ndarray], after: int | None = None) -> int:
    """Read each run of ``g`` (sorted by offset) into this thread's staging buffer with
    one read (``O_DIRECT`` where ``g`` has such a descriptor: `_read_direct`), verify
    every block there, then place its rows (`placed.place`).

    Returns the bytes read counted as `_read_run`'s merged reads count them: a gap of
    less than a page between two runs (cut only to fit the staging buffer; ``after``:
    where the run before the first one ends) counts as read, as inside one run."""
    assert g.place is not None
    fd = g.fd if g.fd is not None else open_chunk_file(g.path, g.file_id)
    dfd = g.direct_fd if g.fd is not None else None
    total = direct = buffered = refused = 0
    lo = int(g.offsets[runs[0][0]]) if runs else 0
    hi = int(g.offsets[runs[-1][-1]] + g.nbytes[runs[-1][-1]]) if runs else 0
    try:
        if dfd is not None and g.unless_cached:  # mostly cached: the page cache's copy is cheaper than the device
            cached = cached_bytes(fd, lo, hi - lo)
            if cached is not None and 2 * cached >= hi - lo:
                dfd = None
        if runs and dfd is None:  # the share's pages asked for at once: the device reads ahead of the small runs
            try:
                os.posix_fadvise(fd, lo, hi - lo, os.POSIX_FADV_WILLNEED)
            except OSError:  # a hint only
                pass
        for idx in runs:
            offsets, sizes = g.offsets[idx], g.nbytes[idx]
            start = int(offsets[0])
            end = int(offsets[-1] + sizes[-1])
            stage = stage_buffer(align_up(end - start))
            got = _read_direct(dfd, stage, start, end, g) if dfd is not None and start % ALIGN == 0 else 0
            direct, buffered, refused = direct + (got > 0), buffered + (got == 0), refused + (got < 0)
            if got < end - start:
                _preadv_all(fd, [stage[max(got, 0) : end - start]], start + max(got, 0), g, end)
            stage = stage[: end - start]
            rel = offsets - start
            # a run is cache-sized: its blocks are verified without handing the GIL over
            # per block (the read before and the copies after release it)
            for r, n, seed, want in zip(rel.tolist(), sizes.tolist(), g.seeds[idx].tolist(), g.expected[idx].tolist()):
                if checksum(stage[r : r + n], seed, release=False) != want:
                    raise CorruptBlockError(f"checksum mismatch in {g.path} at offset {start + r} ({n} bytes)", g.file_id)
            place(g.place, idx, rel, sizes, stage)
            total += end - start
            if after is not None and 0 <= start - after < ALIGN:
                total += start - after
            after = end
    finally:
        if g.fd is None:
            os.close(fd)
        if g.counts is not None:
            g.counts.add(direct, buffered, refused)
    return total


#: what a file system that does not do ``O_DIRECT`` reads says (the rest are the file's)
_REFUSED = frozenset({errno.EINVAL, errno.EOPNOTSUPP, getattr(errno, "ENOTSUP", errno.EOPNOTSUPP)})


def _read_direct(dfd: int, stage: memoryview, start: int, end: int, g: FileBlocks) -> int:
    """Read ``start .. end`` of the file (``start`` 4 KiB aligned) into the page-aligned
    ``stage`` with ``O_DIRECT``, in whole 4 KiB pages (the last one may run past ``end``
    or stop at the end of the file). Returns how many of the run's bytes are now in
    ``stage``: all of them, fewer where a read stopped early (the end of the file, a
    short read; the caller reads the rest through the page cache, which also reports a
    truncated file), or ``-1`` where the file system refused the read (`_REFUSED`)."""
    want, got = align_up(end - start), 0
    while got < end - start:
        try:
            n = os.preadv(dfd, [stage[got:want]], start + got)
        except OSError as exc:
            if exc.errno in _REFUSED:
                return got if got else -1
            raise read_failed(f"cannot read chunk file {g.path}", exc, g.file_id) from exc
        got += n
        if n == 0 or got % ALIGN:  # stopped inside a page: the end of the file, or a short read
            break
    return min(got, end - start)


def _preadv_all(fd: int, iovecs: list[memoryview], offset: int, g: FileBlocks, end: int) -> None:
    """``preadv`` until every iovec is full; a short file raises `CorruptBlockError`."""
    pending = list(iovecs)
    pos = offset
    while pending:
        try:
            n = os.preadv(fd, pending[:_MAX_IOV], pos)
        except OSError as exc:
            raise read_failed(f"cannot read chunk file {g.path}", exc, g.file_id) from exc
        if n == 0:
            raise CorruptBlockError(
                f"chunk file {g.path} is truncated: wanted bytes up to {end}, file ends at {pos}", g.file_id
            )
        pos += n
        while pending and n >= len(pending[0]):
            n -= len(pending[0])
            pending.pop(0)
        if n:
            pending[0] = pending[0][n:]

