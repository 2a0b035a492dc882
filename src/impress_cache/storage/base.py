"""The interface every chunk-file format implements, and the block layout they share.

A chunk file holds the K/V rows of ``n_tokens`` consecutive tokens for every layer, cut
into blocks of ``chunk_tokens`` tokens. One block of one layer is one contiguous,
4 KiB-aligned byte range holding a ``[2, kv_heads, rows, head_dim]`` array (K then V),
so any set of blocks can be read with plain ``preadv`` calls, without the format's own
reader. With a ``kv_codec`` a K/V block is ``uint8 [2, kv_heads, rows, head_dim + 4]``
instead (`kv_codec`: one-byte codes and a float32 scale per row). Formats differ only
in how they wrap those ranges; each one is one module in this package plus one line in
`FORMATS`.

Every block has a CRC-32C checksum started from a *seed* that binds the block's identity:
the file (its UUID, the tokens its rows hold, their first position and a digest of the
tokens before them) and the block's kind, layer and index (`file_seed`, `block_seeds`).
A block read for other tokens, from another file or from another place in its file
fails verification, even when its bytes are intact.
"""

from __future__ import annotations

import hashlib
import os
import stat
import struct
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import crc32c
import numpy as np

from ..errors import StoreLimitError
import torch

from . import kv_codec

ALIGN = 4096


def align_up(n: int, align: int = ALIGN) -> int:
    return (n + align - 1) // align * align


#: kind of a K/V block: ``[2, kv_heads, rows, head_dim]`` in the stored dtype
KV = 0
#: kind of a probe-key piece: ``uint8 [rows, record_bytes]`` (see `impress_cache.probe`)
PROBE = 1

#: ``(file_id, kind, layer, block)``: the unit of disk I/O and of the memory tiers
BlockKey = tuple[int, int, int, int]

_LAYER_BITS, _BLOCK_BITS, _FILE_BITS = 12, 20, 31
#: what a `block_code` holds: layers per model, blocks per layer of one file, file ids
MAX_LAYERS, MAX_BLOCKS, MAX_FILE_ID = 1 << _LAYER_BITS, 1 << _BLOCK_BITS, (1 << _FILE_BITS) - 1


def block_code(file_id, layer, block):  # type: ignore[no-untyped-def]
    """One integer for a block of one kind (ints or int64 numpy arrays): cheaper to
    build and look up than a `BlockKey` on the read path's hot loops. Raises
    `StoreLimitError` when a part is negative or too large for its bits (two blocks
    would share a code)."""
    if np.any((file_id >> _FILE_BITS) | (layer >> _LAYER_BITS) | (block >> _BLOCK_BITS)):  # negative: -1
        raise StoreLimitError(
            f"block code out of range: file ids, layers and blocks must be below {MAX_FILE_ID + 1}, {MAX_LAYERS} "
            f"and {MAX_BLOCKS} (got file {np.max(file_id)}, layer {np.max(layer)}, block {np.max(block)}, or a "
            "negative one); a longer prompt needs a larger chunk_tokens"
        )
    return (file_id << (_LAYER_BITS + _BLOCK_BITS)) | (layer << _BLOCK_BITS) | block


@dataclass
class BlockTable:
    """Where every block of one chunk file lives; arrays are indexed ``[kind, layer, block]``.

    Block ``b`` of a file holds its rows ``b * chunk_tokens .. (b + 1) * chunk_tokens``
    (fewer for the last block), for K/V blocks and probe pieces alike.
    """

    offsets: np.ndarray  # int64 [2, layers, blocks]
    checksums: np.ndarray  # uint32 [2, layers, blocks]
    seeds: np.ndarray  # uint32 [2, layers, blocks], see `block_seeds`
    rows: np.ndarray  # int64 [blocks]
    #: bytes of one row in a K/V block (``2 * kv_heads * head_dim * itemsize``) and in a probe piece
    row_bytes: tuple[int, int]

    @classmethod
    def build(
        cls, offsets: np.ndarray, checksums: np.ndarray, seed: int, n_tokens: int, chunk_tokens: int,
        row_bytes: tuple[int, int],
    ) -> BlockTable:
        kinds, layers, blocks = np.indices(offsets.shape)
        nb = offsets.shape[2]
        rows = np.minimum(chunk_tokens, n_tokens - np.arange(nb) * chunk_tokens)
        return cls(offsets, checksums, block_seeds(seed, kinds, layers, blocks), rows, row_bytes)

    def nbytes(self, kind: int, blocks: np.ndarray | int) -> np.ndarray | int:
        """Payload bytes of blocks of one kind."""
        return self.rows[blocks] * self.row_bytes[kind]


@dataclass(frozen=True)
class BlockData:
    """One block ready to be written: its raw bytes and how to describe them."""

    kind: int
    layer: int
    block: int
    rows: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    payload: bytes | memoryview

    @property
    def nbytes(self) -> int:
        return len(self.payload)

    @property
    def name(self) -> str:
        if self.kind == PROBE and self.block < 0:
            return f"P{self.layer}"  # a whole layer's probe copy in one tensor
        return f"{'L' if self.kind == KV else 'P'}{self.layer}.B{self.block}"


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The raw bytes of a contiguous CPU tensor (no copy)."""
    return t.contiguous().view(torch.uint8).reshape(-1).numpy().data


#: rows of a layer encoded at once by a ``kv_codec`` (bounds the writer's float32 copy)
CODEC_SLICE_ROWS = 1024


def iter_blocks(
    keys: list[torch.Tensor], values: list[torch.Tensor], chunk_tokens: int, codec: str | None = None
) -> Iterator[BlockData]:
    """Cut per-layer ``[H, N, D]`` keys and values into K/V blocks, layer by layer; with
    ``codec`` each block is encoded (`kv_codec.encode`: ``uint8 [2, H, rows, D + 4]``), a
    slice of whole blocks at a time (scales are per row: the slicing changes no byte)."""
    step = chunk_tokens * max(1, CODEC_SLICE_ROWS // chunk_tokens)
    for layer, (k, v) in enumerate(zip(keys, values)):
        n = k.shape[-2]
        block = 0
        for s0 in range(0, n, step):
            s1 = min(s0 + step, n)
            coded = None if codec is None else kv_codec.encode(torch.stack((k[:, s0:s1], v[:, s0:s1])), codec)
            for start in range(s0, s1, chunk_tokens):
                end = min(start + chunk_tokens, s1)
                if coded is None:
                    kv = torch.stack((k[:, start:end], v[:, start:end])).contiguous()
                else:
                    kv = coded[:, :, start - s0 : end - s0].contiguous()
                yield BlockData(KV, layer, block, end - start, kv.dtype, tuple(kv.shape), tensor_bytes(kv))
                block += 1


def checksum(data: bytes | memoryview, seed: int = 0, release: bool = True) -> int:
    """Checksum of one block's bytes: CRC-32C (hardware) started from ``seed``.

    Releases the GIL, so reader threads verify blocks in parallel; ``release=False``
    keeps it (a loop over small blocks: a few microseconds each, where handing the GIL
    over per block costs more than the checksum).
    """
    return crc32c.crc32c(data, seed, 1 if release else 0)


def context_digest(tokens: np.ndarray) -> bytes:
    """SHA-256 of the token ids before a file's first row (int32, little endian)."""
    return hashlib.sha256(np.ascontiguousarray(tokens, dtype="<i4").tobytes()).digest()


def file_seed(
    file_uuid: bytes, context: bytes, first_pos: int, tokens: np.ndarray, perm: np.ndarray | None = None
) -> int:
    """The identity of a chunk file that every block checksum starts from: its UUID, the
    digest of the tokens before its first row, that row's position, its rows' tokens and,
    for a reordered file, its row permutation (so a block cannot be read with another
    file's permutation)."""
    head = file_uuid + context + struct.pack("<q", first_pos)
    seed = crc32c.crc32c(np.ascontiguousarray(tokens, dtype="<i4").tobytes(), crc32c.crc32c(head))
    if perm is not None:
        seed = crc32c.crc32c(np.ascontiguousarray(perm, dtype="<i4").tobytes(), seed)
    return seed


def block_seeds(seed: int, kinds: np.ndarray, layers: np.ndarray, blocks: np.ndarray) -> np.ndarray:
    """Per-block checksum seeds: the file seed mixed with (kind, layer, block), vectorised.

    A 32-bit integer hash (murmur3's finaliser); distinct seeds give distinct checksums
    for the same bytes, so a block cannot pass for another one.
    """
    m = np.uint64(0xFFFFFFFF)
    x = (
        np.uint64(seed)
        ^ (np.asarray(kinds, dtype=np.uint64) * np.uint64(0x9E3779B1))
        ^ (np.asarray(layers, dtype=np.uint64) * np.uint64(0x85EBCA77))
        ^ (np.asarray(blocks, dtype=np.uint64) * np.uint64(0xC2B2AE3D))
    ) & m
    x ^= x >> np.uint64(16)
    x = (x * np.uint64(0x85EBCA6B)) & m
    x ^= x >> np.uint64(13)
    x = (x * np.uint64(0xC2B2AE35)) & m
    x ^= x >> np.uint64(16)
    return x.astype(np.uint32)


class ChunkFormat(ABC):
    """A container format for chunk files."""

    #: file-name suffix, also the format's name in the index
    suffix: str = ""

    def __init__(self, fsync: bool = True) -> None:
        self.fsync = fsync

    @abstractmethod
    def write(
        self, path: Path, blocks: list[BlockData], metadata: dict[str, str], between: Callable[[], None] | None = None
    ) -> list[int]:
        """Write ``blocks`` to ``path`` (a new file) and return each block's file offset.

        Every block must start 4 KiB aligned. ``metadata`` (string keys and values) goes
        into the file's header, so that the file describes itself. The caller writes to
        a temporary name and renames it; the format only has to produce a complete file
        and flush it to the device when ``fsync`` is set. ``between``, when given, is
        called before each block is written (a background rewrite waits there while
        requests run).
        """

    @abstractmethod
    def read_metadata(self, path: Path) -> dict[str, str]:
        """The ``metadata`` a file was written with (for repair and inspection)."""

    @abstractmethod
    def block_offsets(self, path: Path) -> dict[str, int]:
        """File offset of every block, by `BlockData.name` (for repair)."""


def disk_bytes(st: os.stat_result) -> int:
    """Bytes a file takes on disk (as ``du``, never less than its size: a file with
    holes counts its whole size, since its holes may be filled)."""
    return max(st.st_size, st.st_blocks * 512)


def kind_of(path: Path) -> str | None:
    """``"dir"``, ``"file"``, ``"link"``, ``"other"`` or ``None`` (absent), without following links."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return None
    if stat.S_ISLNK(mode):
        return "link"
    if stat.S_ISDIR(mode):
        return "dir"
    return "file" if stat.S_ISREG(mode) else "other"


def fsync_path(path: Path) -> None:
    """Flush a file's (or a directory's) data and metadata to the device."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def create_file(dir_fd: int | None, name: str | Path, mode: int) -> int:
    """Create the new file ``name`` (relative to the directory ``dir_fd``, or a path with
    ``None``), never an existing one, never through a link, with ``mode`` whatever the
    umask; returns a writable descriptor. Every file the store and its index create
    starts here."""
    fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=dir_fd)
    try:
        os.fchmod(fd, mode)  # the mode of os.open is masked by the umask
    except BaseException:
        os.close(fd)
        raise
    return fd
