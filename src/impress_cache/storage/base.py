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
    """Where one (layer, block) lives inside a chunk file."""

    layer: int
    block: int
    rows: int
    offset: int
    nbytes: int
    crc32: int


@dataclass(frozen=True)
class BlockData:
    """One block ready to be written: its bytes in ``[2, H, rows, D]`` order."""

    layer: int
    block: int
    rows: int
    shape: tuple[int, ...]
    payload: bytes | memoryview

    @property
    def nbytes(self) -> int:
        return len(self.payload)


def iter_blocks(
    keys: list[torch.Tensor], values: list[torch.Tensor], chunk_tokens: int
) -> Iterator[BlockData]:
    """Cut per-layer ``[H, N, D]`` keys and values into blocks, layer by layer."""
    for layer, (k, v) in enumerate(zip(keys, values)):
        n = k.shape[-2]
        for block, start in enumerate(range(0, n, chunk_tokens)):
            end = min(start + chunk_tokens, n)
            kv = torch.stack((k[:, start:end], v[:, start:end])).contiguous()
            payload = kv.view(torch.uint8).reshape(-1).numpy().data
            yield BlockData(layer, block, end - start, tuple(kv.shape), payload)


def crc32(data: bytes | memoryview) -> int:
    return zlib.crc32(data) & 0xFFFFFFFF


class ChunkFormat(ABC):
    """A container format for chunk files."""

    #: file-name suffix, also the format's name in the index
    suffix: str = ""

    @abstractmethod
    def write(
        self,
        path: Path,
        blocks: list[BlockData],
        dtype: torch.dtype,
        metadata: dict[str, str],
    ) -> list[BlockInfo]:
        """Write ``blocks`` to ``path`` (a new file) and return where each one landed.

        The caller writes to a temporary name and renames it; the format only has to
        produce a complete file and flush it when ``fsync`` is wanted.
        """


def fsync_file(fd: int) -> None:
    os.fsync(fd)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
