"""The chunk files a store opens: their block tables, read from the index and checked
against the store's naming rules, their descriptors, and a match checked against what
its files say about themselves."""

from __future__ import annotations

import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import CorruptBlockError, StoreFormatError
from ..index.files import FileRecord, FileTable
from ..index.radix import Match
from ..index.sqlite import Index
from ..storage.base import BlockTable, context_digest, file_seed

#: names the store gives its chunk files; anything else in the index is damage
FILE_NAME = re.compile(r"^[0-9a-f]{32}\.(safetensors|h5)\Z")
_OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


@dataclass
class OpenFile:
    """A chunk file this process has looked up: its record, path, block table and fd."""

    record: FileRecord
    path: Path
    table: BlockTable
    fd: int | None = None
    #: ``perm[layer, r]``, the physical row of logical row ``r``, of a reordered file
    perm: np.ndarray | None = None


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
    seed = file_seed(bytes.fromhex(record.name[:32]), record.context, record.first_pos, record.tokens, perm)
    table = BlockTable.build(*arrays, seed, record.n_tokens, record.chunk_tokens, row_bytes)
    return OpenFile(record, chunks / record.name, table, perm=perm)


def open_chunk(f: OpenFile, chunks_fd: int) -> int:
    """A new read-only descriptor of ``f``'s chunk file (relative to the directory
    ``chunks_fd``): no symbolic links, regular files only, never blocking on a FIFO."""
    try:
        fd = os.open(f.record.name, _OPEN_FLAGS, dir_fd=chunks_fd)
    except OSError as exc:
        raise CorruptBlockError(f"cannot open chunk file {f.path}: {exc}", f.record.id) from exc
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise CorruptBlockError(f"chunk file {f.path} is not a regular file", f.record.id)
        # blocks are read where the request needs them: no kernel read-ahead past them
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
    except BaseException:
        os.close(fd)
        raise
    return fd


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
