"""The interface every chunk-file format implements, and the block layout they share.

A chunk file holds the K/V rows of ``n_tokens`` consecutive tokens for every layer, cut
into blocks of ``chunk_tokens`` tokens. One block of one layer is one contiguous,
4 KiB-aligned byte range holding a ``[2, kv_heads, rows, head_dim]`` array (K then V),
so any set of blocks can be read with plain ``preadv`` calls, without the format's own
reader. Formats differ only in how they wrap those ranges; each one is one module in
this package plus one line in `FORMATS`.
"""

from __future__ import annotations

import os
import zlib
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

ALIGN = 4096


def align_up(n: int, align: int = ALIGN) -> int:
    return (n + align - 1) // align * align


@dataclass(frozen=True)
class BlockInfo:
    """Where one block lives inside a chunk file.

    ``kind`` is ``KV`` for a ``[2, kv_heads, rows, head_dim]`` K/V block and ``PROBE`` for
    a piece of the compact probe-key copy (``chunk_tokens`` rows of one layer's copy).
    """

    kind: int
    layer: int
    block: int
    rows: int
    offset: int
    nbytes: int
    checksum: int


#: kind of a K/V block: ``[2, kv_heads, rows, head_dim]`` in the stored dtype
KV = 0
#: kind of a probe-key piece: ``uint8 [rows, record_bytes]`` (see `impress_cache.probe`)
PROBE = 1

#: ``(file_id, kind, layer, block)``: the unit of disk I/O and of the memory tiers
BlockKey = tuple[int, int, int, int]


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


def iter_blocks(
    keys: list[torch.Tensor], values: list[torch.Tensor], chunk_tokens: int
) -> Iterator[BlockData]:
    """Cut per-layer ``[H, N, D]`` keys and values into K/V blocks, layer by layer."""
    for layer, (k, v) in enumerate(zip(keys, values)):
        n = k.shape[-2]
        for block, start in enumerate(range(0, n, chunk_tokens)):
            end = min(start + chunk_tokens, n)
            kv = torch.stack((k[:, start:end], v[:, start:end])).contiguous()
            yield BlockData(KV, layer, block, end - start, kv.dtype, tuple(kv.shape), tensor_bytes(kv))


def checksum(data: bytes | memoryview, seed: int = 0) -> int:
    """Checksum of one block's bytes (CRC-32 started from ``seed``)."""
    return zlib.crc32(data, seed) & 0xFFFFFFFF


class ChunkFormat(ABC):
    """A container format for chunk files."""

    #: file-name suffix, also the format's name in the index
    suffix: str = ""

    def __init__(self, fsync: bool = True) -> None:
        self.fsync = fsync

    @abstractmethod
    def write(self, path: Path, blocks: list[BlockData], metadata: dict[str, str]) -> list[BlockInfo]:
        """Write ``blocks`` to ``path`` (a new file) and return where each one landed.

        Every block must start 4 KiB aligned. The caller writes to a temporary name and
        renames it; the format only has to produce a complete file and flush it to the
        device when ``fsync`` is set.
        """


def fsync_path(path: Path) -> None:
    """Flush a file's (or a directory's) data and metadata to the device."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
