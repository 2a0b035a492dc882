"""Chunk files in HDF5: one contiguous dataset per (layer, block), 4 KiB aligned.

The datasets use the contiguous layout (no HDF5 chunking or filters), so their bytes sit
at a fixed file offset (``dataset.id.get_offset()``) and the store reads them with
``preadv`` like any other format. The file stays readable with h5py or any HDF5 tool.
"""

from __future__ import annotations

import os
from pathlib import Path

import h5py
import numpy as np
import torch

from .base import ALIGN, BlockData, BlockInfo, ChunkFormat, crc32

_NP = {torch.float32: np.float32, torch.float16: np.float16}


class HDF5Format(ChunkFormat):
    suffix = "h5"

    def __init__(self, fsync: bool = True) -> None:
        self.fsync = fsync

    def write(
        self, path: Path, blocks: list[BlockData], dtype: torch.dtype, metadata: dict[str, str]
    ) -> list[BlockInfo]:
        if dtype not in _NP:
            raise TypeError(f"HDF5 chunk files support {list(_NP)}, not {dtype}")
        np_dtype = _NP[dtype]
        infos: list[BlockInfo] = []
        with h5py.File(path, "w", libver="latest", alignment_threshold=1, alignment_interval=ALIGN) as f:
            for key, value in metadata.items():
                f.attrs[key] = value
            datasets = []
            for blk in blocks:
                arr = np.frombuffer(blk.payload, dtype=np_dtype).reshape(blk.shape)
                ds = f.create_dataset(f"L{blk.layer}/B{blk.block}", data=arr)
                datasets.append((blk, ds))
            f.flush()
            for blk, ds in datasets:
                offset = ds.id.get_offset()
                if offset is None or offset % ALIGN:
                    raise OSError(f"HDF5 placed block {blk.layer}/{blk.block} at unaligned offset {offset}")
                infos.append(BlockInfo(blk.layer, blk.block, blk.rows, offset, blk.nbytes, crc32(blk.payload)))
        if self.fsync:
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        return infos
