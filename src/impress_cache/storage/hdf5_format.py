"""Chunk files in HDF5: one contiguous dataset per block, 4 KiB aligned.

Datasets are named like the safetensors tensors (``L{layer}/B{block}`` for K/V blocks,
``P{layer}`` for a layer's probe-key copy)
and use the contiguous layout (no HDF5 chunking or filters), so their bytes sit at a fixed
file offset (``dataset.id.get_offset()``) and the store reads them with ``preadv`` like any
other format. The file stays readable with h5py or any HDF5 tool.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import h5py
import numpy as np
import torch

from .base import ALIGN, BlockData, ChunkFormat, fsync_path

_NP = {torch.float32: np.float32, torch.float16: np.float16, torch.uint8: np.uint8}


class HDF5Format(ChunkFormat):
    suffix = "h5"

    def write(
        self, path: Path, blocks: list[BlockData], metadata: dict[str, str], between: Callable[[], None] | None = None
    ) -> list[int]:
        offsets: list[int] = []
        with h5py.File(path, "w", libver="latest", alignment_threshold=1, alignment_interval=ALIGN) as f:
            for key, value in metadata.items():
                f.attrs[key] = value
            datasets = []
            for blk in blocks:
                if blk.dtype not in _NP:
                    raise TypeError(f"HDF5 chunk files support {list(_NP)}, not {blk.dtype}")
                if between is not None:
                    between()
                arr = np.frombuffer(blk.payload, dtype=_NP[blk.dtype]).reshape(blk.shape)
                datasets.append((blk, f.create_dataset(blk.name.replace(".", "/"), data=arr)))
            f.flush()
            for blk, ds in datasets:
                offset = ds.id.get_offset()
                if offset is None or offset % ALIGN:
                    raise OSError(f"HDF5 placed block {blk.name} at unaligned offset {offset}")
                offsets.append(offset)
        if self.fsync:
            fsync_path(path)
        return offsets

    def read_metadata(self, path: Path) -> dict[str, str]:
        with h5py.File(path, "r") as f:
            return {k: str(v) for k, v in f.attrs.items()}

    def block_offsets(self, path: Path) -> dict[str, int]:
        out: dict[str, int] = {}
        with h5py.File(path, "r") as f:
            f.visititems(lambda name, obj: out.__setitem__(name.replace("/", "."), obj.id.get_offset())
                         if isinstance(obj, h5py.Dataset) else None)
        return out
