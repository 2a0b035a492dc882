"""Chunk files in the safetensors format, laid out for partial reads.

Each K/V block is one tensor ``L{layer}.B{block}`` (``[2, kv_heads, rows, head_dim]``) and
each layer's probe-key copy one tensor ``P{layer}`` (``uint8 [rows, record_bytes]``; the
index addresses it in ``chunk_tokens``-row pieces). The
JSON header is padded with spaces so that the data starts on a 4 KiB boundary, and small
``__pad{i}`` byte tensors fill the gaps so that every block starts 4 KiB aligned: the file
stays a valid safetensors file (``safetensors.torch.load_file`` reads it) while the store
reads single blocks with ``preadv`` at the offsets recorded in its index.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable
from pathlib import Path

import torch

from .base import BlockData, ChunkFormat, align_up

_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.uint8: "U8"}


class SafetensorsFormat(ChunkFormat):
    suffix = "safetensors"

    def write(
        self, path: Path, blocks: list[BlockData], metadata: dict[str, str], between: Callable[[], None] | None = None
    ) -> list[int]:
        header: dict[str, object] = {"__metadata__": dict(metadata)}
        rel = 0
        placed: list[tuple[BlockData, int]] = []
        for i, blk in enumerate(blocks):
            if blk.dtype not in _DTYPES:
                raise TypeError(f"safetensors chunk files support {list(_DTYPES)}, not {blk.dtype}")
            header[blk.name] = {
                "dtype": _DTYPES[blk.dtype],
                "shape": list(blk.shape),
                "data_offsets": [rel, rel + blk.nbytes],
            }
            placed.append((blk, rel))
            end = rel + blk.nbytes
            rel = align_up(end)
            if rel > end and i + 1 < len(blocks):
                header[f"__pad{i}"] = {"dtype": "U8", "shape": [rel - end], "data_offsets": [end, rel]}
        raw = json.dumps(header, separators=(",", ":")).encode()
        data_start = align_up(8 + len(raw))
        raw = raw + b" " * (data_start - 8 - len(raw))
        offsets: list[int] = []
        with open(path, "wb") as f:
            f.write(struct.pack("<Q", len(raw)))
            f.write(raw)
            for blk, off in placed:
                pos = data_start + off
                if f.tell() < pos:
                    f.write(b"\0" * (pos - f.tell()))
                if between is not None:
                    between()
                f.write(blk.payload)
                offsets.append(pos)
            f.flush()
            if self.fsync:
                os.fsync(f.fileno())
        return offsets

    def read_metadata(self, path: Path) -> dict[str, str]:
        return dict(self._header(path)[0].get("__metadata__") or {})

    def block_offsets(self, path: Path) -> dict[str, int]:
        header, start = self._header(path)
        return {k: start + int(v["data_offsets"][0]) for k, v in header.items() if k != "__metadata__"}

    @staticmethod
    def _header(path: Path) -> tuple[dict, int]:
        with open(path, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            if size > 1 << 30:
                raise ValueError(f"{path}: safetensors header of {size} bytes")
            return json.loads(f.read(size)), 8 + size
