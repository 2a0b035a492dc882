"""The chunk files a store opens (`OpenFiles`, the catalog's open-file table): their
block tables, read from the index and checked against the store's naming rules, their
descriptors (lent to each read until it is done with them: `Loan`), and a match checked
against what its files say about themselves."""

from __future__ import annotations

import logging
import os
import re
import resource
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import CorruptBlockError, StoreFormatError
from ..index.files import FileRecord, FileTable, NewFile
from ..index.locks import LEAF, OrderedLock
from ..index.radix import Match
from ..index.sqlite import Index
from ..storage.reader import TRANSIENT, open_chunk_file
from ..storage.base import BlockTable, context_digest, file_seed

log = logging.getLogger(__name__)

#: files whose block tables `OpenFiles` keeps from their writing until first read (`seed`)
WRITTEN_KEEP = 64


def descriptor_cap() -> int:
    """How many chunk-file descriptors the stores of this process keep open at most,
    together: a quarter of its descriptor limit (``ulimit -n``; 256 of the usual 1024),
    at least 16."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return 4096 if soft == resource.RLIM_INFINITY else max(16, soft // 4)


class DescriptorBudget:
    """The descriptors every store of this process keeps with its chunk files, at most
    ``cap`` (`descriptor_cap`): one budget, so that many open stores (a server's tenants)
    cannot run the process out of descriptors between them. Its lock is a leaf: nothing
    is taken while it is held."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.used = 0
        self._lock = threading.Lock()

    def take(self) -> bool:
        with self._lock:
            if self.used >= self.cap:
                return False
            self.used += 1
            return True

    def give(self) -> None:
        with self._lock:
            self.used -= 1


#: the budget of every store of this process
DESCRIPTORS = DescriptorBudget(descriptor_cap())


#: `open_direct`: no ``O_DIRECT`` descriptor for this read, none refused either (`TRANSIENT`)
NOT_NOW = -2
#: names the store gives its chunk files; anything else in the index is damage
FILE_NAME = re.compile(r"^[0-9a-f]{32}\.(safetensors|h5)\Z")


@dataclass
class OpenFile:
    """A chunk file this process has looked up: its record, path, block table and fd.
    The descriptor fields change under `OpenFiles`' descriptor lock; readers get them
    through `OpenFiles.lend`, never from these fields."""

    record: FileRecord
    path: Path
    table: BlockTable
    fd: int | None = None
    #: a second descriptor of the same file opened with ``O_DIRECT`` (`open_direct`);
    #: ``-1``: the file system refused it (or the platform has no ``O_DIRECT``)
    dfd: int | None = None
    #: ``perm[layer, r]``, the physical row of logical row ``r``, of a reordered file
    perm: np.ndarray | None = None
    #: ``(st_dev, st_ino)`` of the file ``fd`` has open (set with it)
    ident: tuple[int, int] | None = None
    #: readers that hold a `Loan` of this file's descriptors now
    users: int = 0
    #: descriptors `OpenFiles.drop` took from a file while readers held them: closed by
    #: the last reader's `Loan.release`
    closing: list[int] = field(default_factory=list)


class Loan:
    """A chunk file's descriptors lent to one reader (`OpenFiles.lend`): ``fd`` (read
    through the page cache) and ``dfd`` (``O_DIRECT``, or ``None``) stay open, and stay
    that file's, until `release`, whatever `OpenFiles.drop` does meanwhile (the file
    forgotten, evicted, quarantined, the store closed). `release` gives them back once;
    calling it again does nothing."""

    __slots__ = ("fd", "dfd", "_files", "_file")

    def __init__(self, files: OpenFiles, f: OpenFile, fd: int, dfd: int | None) -> None:
        self.fd, self.dfd = fd, dfd
        self._files: OpenFiles = files
        self._file: OpenFile | None = f

    def release(self) -> None:
        self._files._give_back(self)


def read_file(index: Index, chunks: Path, row_bytes: tuple[int, int], file_id: int, record: FileRecord | None) -> OpenFile:
    """A file's block table from the index (``record``: its record if known already)."""
    record = record or index.file(file_id)
    if record is None:
        raise CorruptBlockError(f"file {file_id} is not in the index", file_id)
    if not FILE_NAME.match(record.name):
        raise StoreFormatError(
            f"the index {index.path} is damaged: file {file_id} is named {record.name!r}, "
            "which is not a name this store gives its chunk files. Rebuild the index with "
            "`impress-cache verify --repair`."
        )
    arrays = index.block_table(file_id)
    if arrays is None:
        raise CorruptBlockError(f"file {file_id} is not in the index", file_id)
    perm = index.file_perm(file_id) if record.reordered else None
    if record.reordered and perm is None:
        raise CorruptBlockError(f"file {file_id} is reordered but the index has no permutation for it", file_id)
    return _open_file(record, arrays, perm, chunks, row_bytes)


def _open_file(
    record: FileRecord, arrays: tuple[np.ndarray, np.ndarray], perm: np.ndarray | None, chunks: Path,
    row_bytes: tuple[int, int],
) -> OpenFile:
    seed = file_seed(bytes.fromhex(record.name[:32]), record.context, record.first_pos, record.tokens, perm)
    table = BlockTable.build(*arrays, seed, record.n_tokens, record.chunk_tokens, row_bytes)
    return OpenFile(record, chunks / record.name, table, perm=perm)


def open_chunk(f: OpenFile, chunks_fd: int) -> int:
    """A new read-only descriptor of ``f``'s chunk file, relative to the directory
    ``chunks_fd`` (`reader.open_chunk_file`), without kernel read-ahead: blocks are read
    where the request needs them."""
    fd = open_chunk_file(f.record.name, f.record.id, dir_fd=chunks_fd, shown=f.path)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_direct(f: OpenFile, ident: tuple[int, int], chunks_fd: int) -> int:
    """A second read-only descriptor of ``f``'s chunk file that bypasses the page cache
    (``O_DIRECT``), or ``-1`` where the platform or the file system refuses it, or where
    the name no longer leads to the file ``ident`` (``(st_dev, st_ino)`` of the buffered
    descriptor's file) names (replaced meanwhile), or `NOT_NOW` where the process is out
    of descriptors or memory for now (`TRANSIENT`)."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return -1
    try:
        dfd = os.open(f.record.name, os.O_RDONLY | flag | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=chunks_fd)
    except OSError as exc:  # EINVAL: no O_DIRECT here; anything else: the buffered descriptor reports it
        return NOT_NOW if exc.errno in TRANSIENT else -1
    try:
        st = os.fstat(dfd)
        same = (st.st_dev, st.st_ino) == ident
    except OSError:
        same = False
    except BaseException:
        os.close(dfd)
        raise
    if not same:
        os.close(dfd)
        return -1
    return dfd


class OpenFiles:
    """The chunk files this process has looked up, by id, under the catalog's ``lock``.
    The index is read and the files are opened without that lock (a read may wait for a
    write's commit, an ``open`` for the directory, which a write's rename or a deletion
    may hold; requests need the lock to match): the first of two threads meanwhile
    installs what it got, the other drops its own."""

    def __init__(
        self, lock: Any, index: Index, chunks: Path, chunks_fd: int, row_bytes: tuple[int, int],
        records: Callable[[], FileTable],
    ) -> None:
        self._lock, self._index, self._chunks, self._chunks_fd = lock, index, chunks, chunks_fd
        self._row_bytes, self._records = row_bytes, records
        self._open: dict[int, OpenFile] = {}
        self._written: OrderedDict[int, NewFile] = OrderedDict()  # (`seed`)
        #: descriptors kept with files (`lend`), at most `max_fds` here and
        #: `DESCRIPTORS.cap` with the process's other stores: past either a read opens its
        #: file for itself (and through the page cache), so that stores with more files
        #: than the process may open never run it out of descriptors. Those of dropped
        #: files that readers still hold count until they are closed.
        self.max_fds = DESCRIPTORS.cap
        self._fds = 0
        #: the descriptor fields of the files, their readers and ``_fds`` change under it
        #: (taken under the catalog's lock or alone; nothing is taken while it is held)
        self._use = OrderedLock(LEAF, "open-file descriptors", reentrant=False)

    def ids(self) -> list[int]:
        with self._lock:
            return list(self._open)

    def get(self, file_id: int) -> OpenFile:
        """The block table of a file, checked against the store's naming rules
        (`read_file`), or built from what this process wrote if it is among the files
        it wrote last (`seed`). A file that leaves the catalog's file table
        (``records()``) while it is read is returned but not kept."""
        with self._lock:
            f = self._open.get(file_id)
            if f is not None:
                return f
            known = self._records().get(file_id)
            written = self._written.pop(file_id, None)
        if written is not None and known is not None and FILE_NAME.match(known.name):
            arrays = (np.asarray(written.offsets, "<i8"), np.asarray(written.checksums, "<u4"))  # (as the index gives them)
            perm = None if written.perm is None else np.asarray(written.perm, "<i4")
            f = _open_file(known, arrays, perm, self._chunks, self._row_bytes)
        else:
            f = read_file(self._index, self._chunks, self._row_bytes, file_id, known)
        with self._lock:
            if known is not None and file_id not in self._records():
                return f  # removed meanwhile: not kept (its `drop` has run or is due)
            return self._open.setdefault(file_id, f)

    def seed(self, file_id: int, new_file: NewFile) -> None:
        """Remember what this process wrote to a file it just committed (`NewFile`: its
        block table and permutation), so that the first request for its prompt does not
        read them back from the index (a read that may wait for another process's write
        or a checkpoint). Only the last `WRITTEN_KEEP` written files are remembered, and
        the table is built when first asked for (a write costs a dictionary insert)."""
        with self._lock:
            if file_id in self._open:
                return
            self._written[file_id] = new_file
            self._written.move_to_end(file_id)
            while len(self._written) > WRITTEN_KEEP:
                self._written.popitem(last=False)

    def lend(self, f: OpenFile, direct: bool = False) -> Loan | None:
        """``f``'s descriptors for one reader: the buffered one (`open_chunk`) and, with
        ``direct``, the ``O_DIRECT`` one (`open_direct`; ``Loan.dfd`` ``None`` where there
        is none: refused, not now: `NOT_NOW`), kept with ``f`` (opened here the first
        time). They stay open and stay ``f``'s until the reader calls `Loan.release`,
        even if `drop` forgets ``f`` meanwhile: the last reader closes them then.
        ``None`` where there is nothing to lend: ``f`` dropped or never kept (`get`), or
        no room under `max_fds` or `DESCRIPTORS`; the reader then opens the file for that
        read only (and through the page cache) and closes it after, or finds it gone."""
        if f.fd is None:  # (read without the lock: a hint; `_keep` looks again under it)
            self._keep(f)
        if direct and f.dfd is None and f.fd is not None:
            self._keep_direct(f)
        with self._use:
            fd, dfd = f.fd, f.dfd
            if fd is None:
                return None
            f.users += 1
            return Loan(self, f, fd, dfd if direct and dfd is not None and dfd >= 0 else None)

    def _room(self) -> bool:
        """Whether one more descriptor may be kept (read without the locks: a hint)."""
        return self._fds < self.max_fds and DESCRIPTORS.used < DESCRIPTORS.cap

    def _keep(self, f: OpenFile) -> None:
        """Open ``f``'s buffered descriptor and keep it with ``f`` if ``f`` is still
        kept here and there is room; else close it again."""
        if not self._room() or self._open.get(f.record.id) is not f:  # (hints, looked at again below)
            return
        fd = open_chunk(f, self._chunks_fd)
        taken = False
        try:
            st = os.fstat(fd)
            taken = DESCRIPTORS.take()
            with self._lock, self._use:  # (kept: in the table, which changes under the catalog's lock)
                if taken and self._open.get(f.record.id) is f and f.fd is None and self._fds < self.max_fds:
                    f.fd, f.ident, fd, taken = fd, (st.st_dev, st.st_ino), -1, False
                    self._fds += 1
        finally:
            if taken:
                DESCRIPTORS.give()
            if fd >= 0:
                os.close(fd)

    def _keep_direct(self, f: OpenFile) -> None:
        """Open ``f``'s ``O_DIRECT`` descriptor and keep it beside its buffered one if
        that one is still kept (``f`` not dropped meanwhile) and there is room; remember a
        refusal (``dfd`` ``-1``); keep nothing when it is `NOT_NOW` (a later read tries
        again)."""
        ident = f.ident
        if ident is None or not self._room():
            return
        dfd = open_direct(f, ident, self._chunks_fd)
        if dfd == NOT_NOW:
            return
        taken = False
        try:
            taken = dfd >= 0 and DESCRIPTORS.take()
            with self._use:  # (``f.fd`` set: ``f`` is kept, and ``ident`` is its file)
                if f.fd is not None and f.dfd is None and (dfd < 0 or (taken and self._fds < self.max_fds)):
                    self._fds += dfd >= 0
                    f.dfd, dfd, taken = dfd, -1, False
        finally:
            if taken:
                DESCRIPTORS.give()
            if dfd >= 0:
                os.close(dfd)

    def _give_back(self, loan: Loan) -> None:
        """`Loan.release`: the last reader of a dropped file closes its descriptors."""
        with self._use:
            f, loan._file = loan._file, None
            if f is None:
                return
            f.users -= 1
            shut, f.closing = (f.closing, []) if f.users == 0 else ([], f.closing)
        self._close(shut)

    def _close(self, fds: list[int]) -> None:
        """Close kept descriptors and count them out (each counted as kept until closed)."""
        for d in fds:
            try:
                os.close(d)
            except OSError as exc:  # (not expected: the descriptor is this table's alone)
                log.warning("closing a chunk file's descriptor %d failed: %r", d, exc)
            finally:
                with self._use:
                    self._fds -= 1
                DESCRIPTORS.give()

    def drop(self, file_ids: Iterable[int]) -> None:
        """Forget files at once and close their descriptors: now, or, for a file whose
        descriptors readers hold (`lend`), when the last of them calls `Loan.release`
        (counted as kept until then). A reader that looks the file up again gets a new
        `OpenFile` (and opens the file again, or finds it gone)."""
        shut: list[int] = []
        with self._lock:
            for fid in file_ids:
                self._written.pop(fid, None)
                f = self._open.pop(fid, None)
                if f is None:
                    continue
                with self._use:
                    fds = [d for d in (f.fd, f.dfd) if d is not None and d >= 0]
                    f.fd = f.dfd = None
                    (f.closing if f.users else shut).extend(fds)
            self._close(shut)


def check_match(records: FileTable, tokens: np.ndarray, match: Match) -> tuple[int, str] | None:
    """Check a match against what its files say about themselves (``records``: the
    store's file table): each segment's position is its file's first position plus its
    row, and the tokens before the file's first row are the ones the file was computed
    after (SHA-256). Returns ``(file_id, reason)`` for the first file that contradicts
    the index, else ``None``."""
    pos = 0
    digests: dict[int, bytes] = {}
    for seg in match.segments:
        rec = records.get(seg.file_id)
        if rec is None:
            return seg.file_id, "the index has no record of it"
        if rec.first_pos + seg.file_row != pos:
            return seg.file_id, f"a node places its row {seg.file_row} at position {pos}, not {rec.first_pos + seg.file_row}"
        if rec.first_pos not in digests:
            digests[rec.first_pos] = context_digest(tokens[: rec.first_pos])
        if digests[rec.first_pos] != rec.context:
            return seg.file_id, "the tokens before its first row are not the ones it was computed after"
        pos += seg.length
    return None


def check_tables(open_file: Callable[[int], OpenFile], match: Match) -> tuple[int, str] | None:
    """The first file of a match whose record cannot be read as its header fields say
    (a block table or permutation of the wrong size, `Index.block_table`): ``(file_id,
    reason)``, to quarantine like a file that fails its checksum. ``open_file`` keeps a
    file's table once read (`OpenFiles.get`): after that, a look-up per segment."""
    for seg in match.segments:
        try:
            open_file(seg.file_id)
        except CorruptBlockError as exc:
            return exc.file_id, str(exc)
    return None
