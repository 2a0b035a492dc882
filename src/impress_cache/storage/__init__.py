"""Chunk-file formats and the block reader they share."""

from __future__ import annotations

from .base import ALIGN, KV, PROBE, BlockData, BlockKey, BlockTable, ChunkFormat, block_seeds, checksum, file_seed, iter_blocks
from .hdf5_format import HDF5Format
from .reader import BlockReader, Extent, FileBlocks, ReadBatch
from .safetensors_format import SafetensorsFormat

#: format name -> class; a new format is one module plus one line here
FORMATS: dict[str, type[ChunkFormat]] = {
    "safetensors": SafetensorsFormat,
    "hdf5": HDF5Format,
}

__all__ = [
    "ALIGN",
    "KV",
    "PROBE",
    "BlockData",
    "BlockTable",
    "BlockKey",
    "BlockReader",
    "ChunkFormat",
    "FORMATS",
    "HDF5Format",
    "Extent",
    "FileBlocks",
    "ReadBatch",
    "SafetensorsFormat",
    "block_seeds",
    "checksum",
    "file_seed",
    "iter_blocks",
]
