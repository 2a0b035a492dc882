"""Where the rows of a matched prefix live: logical positions -> (file, block, row).

A matched prefix is a list of radix-tree segments, each a run of rows of one chunk file.
Files are cut into blocks of their own ``chunk_tokens`` rows, so the prefix splits into
*units*: the part of one (file, block) that the prefix covers. Selection and I/O both work
on units: a unit is the smallest thing that can be read.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from .radix import Segment


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
        unit_of = torch.empty(pos, dtype=torch.long)
        for i, u in enumerate(units):
            unit_of[u.start : u.start + u.count] = i
        #: unit index of every logical position
        self.unit_of = unit_of
        #: per unit: first logical position, and the unit's first row inside its block
        self.unit_start = torch.tensor([u.start for u in units], dtype=torch.long)
        self.unit_first_row = torch.tensor([u.first_row for u in units], dtype=torch.long)
        #: per unit: how many positions it holds
        self.unit_count = torch.tensor([u.count for u in units], dtype=torch.long)

    def units_for(self, positions: torch.Tensor) -> list[int]:
        """Sorted indices of the units holding ``positions``."""
        return torch.unique(self.unit_of[positions]).tolist()

    def gather(
        self, units: Sequence[int], blocks: Sequence[torch.Tensor], positions: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of ``positions`` from the blocks of ``units``.

        ``blocks[i]`` is the whole ``[2, heads, block_rows, head_dim]`` block of unit
        ``units[i]``; every position must lie in one of ``units``. ``positions`` is
        ``[k]`` (the same rows for every head), ``[heads, k]`` (one set per head) or
        ``None`` (every position, in order). Returns two ``[heads, k, head_dim]``
        tensors on the CPU (new memory, not views of the blocks), wherever the blocks
        come from (a device-tier block may live in accelerator memory).
        """
        blocks = on_cpu(blocks)
        stacked = torch.cat(blocks, dim=2) if len(blocks) > 1 else blocks[0].clone()
        idx = self.row_index(units, [b.shape[2] for b in blocks], positions)
        if idx.dim() == 1:
            if idx.numel() == stacked.shape[2] and torch.equal(idx, torch.arange(idx.numel())):
                return stacked[0], stacked[1]  # every row of every block, in order: no second copy
            return stacked[0].index_select(1, idx), stacked[1].index_select(1, idx)
        h, k = idx.shape
        full = idx.view(1, h, k, 1).expand(2, h, k, stacked.shape[-1])
        out = stacked.gather(2, full)
        return out[0], out[1]

    def row_index(
        self, units: Sequence[int], block_rows: Sequence[int], positions: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Where ``positions`` are in the blocks of ``units`` laid end to end.

        ``block_rows[i]`` is the number of rows of the block of ``units[i]``. Returns
        indices of the same shape as ``positions`` (default: every position) into the
        concatenation of those blocks along their row axis.
        """
        if positions is None:
            positions = torch.arange(self.length)
        sizes = torch.as_tensor(list(block_rows), dtype=torch.long)
        base = torch.full((len(self.units),), -1, dtype=torch.long)
        base[torch.as_tensor(list(units), dtype=torch.long)] = torch.cumsum(sizes, 0) - sizes
        u = self.unit_of[positions]
        if bool((base[u] < 0).any()):
            raise ValueError("a position lies in a unit whose block was not given")
        return base[u] + positions - self.unit_start[u] + self.unit_first_row[u]


def on_cpu(blocks: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """``blocks`` as CPU tensors (blocks from the device tier may be in accelerator memory)."""
    return [b if b.device.type == "cpu" else b.cpu() for b in blocks]
