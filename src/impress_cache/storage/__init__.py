"""Chunk-file formats and the block reader they share."""

from __future__ import annotations

from .base import ALIGN, KV, PROBE, BlockData, BlockInfo, BlockKey, ChunkFormat, checksum, iter_blocks
from .hdf5_format import HDF5Format
from .reader import BlockReader, Extent, ReadBatch
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
    "BlockInfo",
    "BlockKey",
    "BlockReader",
    "ChunkFormat",
    "FORMATS",
    "HDF5Format",
    "Extent",
    "ReadBatch",
    "SafetensorsFormat",
    "checksum",
    "iter_blocks",
]
