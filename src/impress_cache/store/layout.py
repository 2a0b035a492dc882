"""Where the rows of a matched prefix live: logical positions -> (file, block, row).

A matched prefix is a list of radix-tree segments, each a run of rows of one chunk file.
Files are cut into blocks of their own ``chunk_tokens`` rows, so the prefix splits into
*units*: the part of one (file, block) that the prefix covers. Selection and I/O both work
on units: a unit is the smallest thing that can be read.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ..index.radix import Segment
from ..storage.base import KV, BlockKey, block_code
from .blockset import BlockSet


@dataclass(frozen=True)
class Unit:
    """Rows ``first_row .. first_row + count`` of block ``block`` of ``file_id``,
    holding logical positions ``start .. start + count``."""

    file_id: int
    block: int
    first_row: int
    count: int
    start: int


class PrefixLayout:
    """Units of one matched prefix, and the unit of every logical position."""

    def __init__(self, segments: Sequence[Segment], chunk_tokens_of: Callable[[int], int]) -> None:
        units: list[Unit] = []
        #: the radix-tree segments this layout was built from
        self.segments = list(segments)
        pos = 0
        for seg in segments:
            ct = chunk_tokens_of(seg.file_id)
            r0, r1 = seg.file_row, seg.file_row + seg.length
            for b in range(r0 // ct, (r1 - 1) // ct + 1) if seg.length else ():
                lo, hi = max(r0, b * ct), min(r1, (b + 1) * ct)
                units.append(Unit(seg.file_id, b, lo - b * ct, hi - lo, pos + lo - r0))
            pos += seg.length
        self.units = units
        self.length = pos
        counts = torch.tensor([u.count for u in units], dtype=torch.long)
        #: unit index of every logical position
        self.unit_of = torch.repeat_interleave(torch.arange(len(units)), counts)
        #: per unit: first logical position, and the unit's first row inside its block
        self.unit_start = torch.tensor([u.start for u in units], dtype=torch.long)
        self.unit_first_row = torch.tensor([u.first_row for u in units], dtype=torch.long)
        #: per unit: how many positions it holds
        self.unit_count = counts
        #: per unit: its file and its block in that file (numpy, for the read path)
        self.unit_files = np.array([u.file_id for u in units], dtype=np.int64)
        self.unit_blocks = np.array([u.block for u in units], dtype=np.int64)

    def units_for(self, positions: torch.Tensor) -> list[int]:
        """Sorted indices of the units holding ``positions``."""
        return torch.unique(self.unit_of[positions]).tolist()

    def keys(self, units: Sequence[int], kind: int, layer: int) -> list[BlockKey]:
        """Block keys of ``units`` for one layer."""
        return [(self.units[u].file_id, kind, layer, self.units[u].block) for u in units]

    def codes(self, units: Sequence[int], layer: int) -> list[int]:
        """`store.blocks.block_code` of the blocks of ``units`` for one layer."""
        u = np.asarray(units, dtype=np.int64)
        return block_code(self.unit_files[u], layer, self.unit_blocks[u]).tolist()

    def row_index(
        self, units: Sequence[int], slots: Sequence[int], slot_rows: int, positions: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Where ``positions`` are among slots of ``slot_rows`` rows holding ``units``.

        ``slots[i]`` is the slot of unit ``units[i]``. Returns ``slot * slot_rows + row``
        for every position, with the shape of ``positions`` (default: every position).
        """
        if positions is None:
            positions = torch.arange(self.length)
        base = torch.full((len(self.units),), -1, dtype=torch.long)
        base[torch.as_tensor(list(units), dtype=torch.long)] = torch.as_tensor(list(slots), dtype=torch.long) * slot_rows
        u = self.unit_of[positions]
        if bool((base[u] < 0).any()):
            raise ValueError("a position lies in a unit whose block was not given")
        return base[u] + positions - self.unit_start[u] + self.unit_first_row[u]

    def gather(
        self, units: Sequence[int], blocks: BlockSet, positions: torch.Tensor | None = None, offset: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of ``positions`` from K/V blocks read for ``units``.

        The blocks of ``units`` are the keys ``offset .. offset + len(units)`` of
        ``blocks`` (in unit order).
        ``positions`` is ``[k]`` (the same rows for every head), ``[heads, k]`` (one set
        per head) or ``None`` (every position, in order). Returns two ``[heads, k,
        head_dim]`` tensors (new memory, on the pool's device).
        """
        if blocks.kind != KV:
            raise ValueError("gather reads K/V blocks; use gather_rows for probe pieces")
        pool = blocks.placed().pool
        _, _, heads, s, dim = pool.shape
        idx = self.row_index(units, blocks.slot_of[offset : offset + len(units)], s, positions)
        k = idx.shape[-1]
        slot, row = (idx // s).view(1, -1, k), (idx % s).view(1, -1, k)  # [1, 1 or H, k]
        kv = torch.arange(2).view(2, 1, 1)
        head = torch.arange(heads).view(1, heads, 1)
        flat = ((slot * 2 + kv) * heads + head) * s + row  # [2, H, k]
        out = pool.reshape(-1, dim).index_select(0, flat.reshape(-1).to(pool.device)).view(2, heads, k, dim)
        return out[0], out[1]

    def blocks_from(self, keys: torch.Tensor, values: torch.Tensor, units: Sequence[int]) -> BlockSet:
        """The blocks of ``units`` cut from in-memory ``[heads, positions, head_dim]`` keys
        and values, as the read path returns them (one slot per unit, in order): what a
        request uses when it had to recompute its prefix."""
        s = max((self.units[u].first_row + self.units[u].count for u in units), default=1)
        h, _, d = keys.shape
        pool = torch.zeros(len(units), 2, h, s, d, dtype=keys.dtype, device=keys.device)
        rows = []
        for slot, u in enumerate(units):
            unit = self.units[u]
            r, sl = unit.first_row, slice(unit.start, unit.start + unit.count)
            pool[slot, 0, :, r : r + unit.count] = keys[:, sl]
            pool[slot, 1, :, r : r + unit.count] = values[:, sl]
            rows.append(r + unit.count)
        return BlockSet(KV, pool, rows, list(range(len(units))))

    def gather_into(self, units: Sequence[int], blocks: BlockSet, out: torch.Tensor, offset: int = 0) -> None:
        """Every position of ``units`` (in order) into ``out``, a ``[2, heads, positions,
        head_dim]`` tensor or view (keys, then values).

        Runs of whole blocks are stacked straight into ``out`` (one copy per run, no
        index), whether they sit in the pool or were held apart (memory-tier hits); only
        units that cover part of a block are copied one by one.
        """
        s = blocks.slot_rows
        slots = blocks.slot_of[offset : offset + len(units)]
        infos = [self.units[u] for u in units]
        pos, i, n = 0, 0, len(infos)
        while i < n:
            j = i
            while j < n and infos[j].first_row == 0 and infos[j].count == s:
                j += 1
            if j > i:  # whole blocks i .. j - 1
                nb = j - i
                torch.stack(
                    [blocks.slot(slot)[:, :, :s] for slot in slots[i:j]], dim=2,
                    out=out[:, :, pos : pos + nb * s].unflatten(2, (nb, s)),
                )
                pos += nb * s
                i = j
                continue
            u = infos[i]
            out[:, :, pos : pos + u.count].copy_(blocks.slot(slots[i])[:, :, u.first_row : u.first_row + u.count])
            pos += u.count
            i += 1

    def gather_rows(
        self, units: Sequence[int], blocks: BlockSet, positions: torch.Tensor | None = None, offset: int = 0
    ) -> torch.Tensor:
        """``[k, record]`` rows of probe pieces read for ``units`` (keys ``offset ..`` of
        ``blocks``, in unit order)."""
        pool = blocks.placed().pool
        idx = self.row_index(units, blocks.slot_of[offset : offset + len(units)], blocks.slot_rows, positions)
        return pool.reshape(-1, pool.shape[-1]).index_select(0, idx.to(pool.device))
