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

    def units_for(self, positions: torch.Tensor) -> list[int]:
        """Sorted indices of the units holding ``positions``."""
        return torch.unique(self.unit_of[positions]).tolist()
