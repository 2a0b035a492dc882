"""Exact reuse from disk straight into a layer's buffer (no pool, no gather).

`BlockIO.start_rows` reads every row of one layer of an in-order prefix into a
caller's ``[2, kv_heads, positions, head_dim]`` tensor (a batch row of a dense layer's
buffer). The blocks of each file go to the reader as one group with a `RowPlacement`:
runs of neighbouring blocks are read into a cache-sized staging buffer, every block is
verified against its checksum there, and its rows are copied to their positions
(`storage.placed`). Compared with the pool path (`BlockIO.start_layout` then
`LayerView.gather_into`), no pool is allocated and filled and the rows are not copied a
second time on the loader thread.

Only where it gives the same result and the same side effects as the pool path: the
memory tiers off (nothing to look up or admit), no ``kv_codec`` (blocks are stored as
they are used), the layer in prompt order, a CPU destination in the stored dtype, and
each (file, block) in one run of positions. Otherwise `plan_rows` returns ``None`` and
the caller reads through the pool.
"""

from __future__ import annotations

import functools
import time
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ..model_info import ModelSpec
from ..storage.base import KV
from ..storage.placed import RowPlacement
from ..storage.reader import DirectCounts, FileBlocks, ReadBatch, release_all
from .blockset import ReadStats
from .layout import PrefixLayout

if TYPE_CHECKING:
    from .blocks import BlockIO


def plan_rows(
    io: BlockIO, spec: ModelSpec, layout: PrefixLayout, layer: int, out: torch.Tensor, counts: DirectCounts | None = None,
) -> tuple[list[FileBlocks], np.ndarray] | None:
    """The groups that read ``layer`` of ``layout`` into ``out`` and every block's rows,
    or ``None`` where the pool path must be used (see the module's docstring). The
    groups hold descriptors lent to them (`Catalog.lend`): hand them to
    `BlockReader.submit`, or release them (`reader.release_all`)."""
    view = layout.at(layer)
    runs = view.runs()
    heads, dim = spec.num_kv_heads, spec.head_dim
    if runs is None or spec.kv_codec is not None or out.device.type != "cpu" or out.dtype != spec.torch_kv_dtype:
        return None
    if tuple(out.shape) != (2, heads, layout.length, dim) or out.stride(3) != 1 or layout.length == 0:
        return None
    unit, at, r0, count = runs
    if len(np.unique(unit)) != len(unit):  # a block in two runs: the pool reads it once
        return None
    files, blocks = layout.unit_files[unit], layout.unit_blocks[unit]
    dest = out.view(torch.uint8).numpy()
    order = np.lexsort((blocks, files))
    files, blocks, at, r0, count = files[order], blocks[order], at[order], r0[order], count[order]
    bounds = [*np.flatnonzero(np.r_[True, files[1:] != files[:-1]]).tolist(), len(files)]
    groups: list[FileBlocks] = []
    all_rows = np.empty(len(files), dtype=np.int64)
    catalog, fill = io.catalog, io.fill
    try:
        for a, b in zip(bounds[:-1], bounds[1:]):
            f = catalog.open_file(int(files[a]))
            t, bl = f.table, blocks[a:b]
            rows = t.rows[bl]
            if np.any(r0[a:b] + count[a:b] > rows):  # rows a block does not hold: the pool path's errors
                release_all(groups)
                return None
            all_rows[a:b] = rows
            offsets, nbytes = t.offsets[KV, layer, bl], rows * spec.kv_row_bytes
            linked = fill is not None and fill.linked(f.record.name, f.record.id)
            place = RowPlacement(dest, at[a:b], r0[a:b], count[a:b], rows)
            # O_DIRECT: not for a linked file (its blocks were just written by its fill);
            # the descriptors stay open until the reader releases them (`BlockReader.submit`)
            loan = catalog.lend(f, direct=bool(io.direct_io) and not linked)
            groups.append(FileBlocks(
                f.record.id, f.path, None if loan is None else loan.fd, offsets, nbytes, t.checksums[KV, layer, bl],
                t.seeds[KV, layer, bl], np.zeros(b - a, dtype=np.int64),
                functools.partial(fill.fill, f.record.id, f.record.name, offsets, nbytes) if linked else None,
                place, None if loan is None else loan.dfd, counts, io.direct_io == "auto",
                None if loan is None else loan.release,
            ))
    except BaseException:
        release_all(groups)
        raise
    return groups, all_rows


class RowsRead:
    """A layer's rows in flight into a caller's buffer; `result` waits and accounts."""

    def __init__(
        self, io: BlockIO, batch: ReadBatch, rows: np.ndarray, row_bytes: int, t0: float, counts: DirectCounts,
    ) -> None:
        self._io = io
        self._batch = batch
        self._counts = counts
        self._rows = rows
        self._row_bytes = row_bytes
        self._t0 = t0
        self._stats: ReadStats | None = None

    def result(self) -> ReadStats:
        """Wait until every block is read, verified and placed (raises the first
        `CorruptBlockError`); what the read cost (counted in the store's totals once)."""
        if self._stats is None:
            disk = self._batch.wait()
            payload = int(self._rows.sum()) * self._row_bytes
            stats = ReadStats(disk_bytes=disk, disk_blocks=len(self._rows), kv_disk_bytes=payload)
            self._io.count_disk_kv(disk, len(self._rows), int(self._rows.sum()), payload, self._counts)
            stats.seconds = time.perf_counter() - self._t0
            self._stats = stats
        return self._stats


def start_rows(io: BlockIO, spec: ModelSpec, reader: Any, layout: PrefixLayout, layer: int, out: torch.Tensor) -> RowsRead | None:
    """Start reading every row of ``layer`` of ``layout`` into ``out``; ``None``: not
    possible here (the caller reads through the pool)."""
    t0 = time.perf_counter()
    counts = DirectCounts()
    planned = plan_rows(io, spec, layout, layer, out, counts)
    if planned is None:
        return None
    groups, rows = planned
    return RowsRead(io, reader.submit(groups, memoryview(b"")), rows, spec.kv_row_bytes, t0, counts)
