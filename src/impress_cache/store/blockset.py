"""What the read path hands back: the blocks of one read in a pool tensor, one slot each."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..storage.base import KV


@dataclass
class ReadStats:
    """What one read cost, for the request's own counters (the store keeps totals).

    ``disk_bytes`` counts the bytes asked from the device (alignment gaps of merged
    reads included); ``kv_disk_bytes`` and ``kv_unattended_bytes`` are the K/V block
    bytes read from disk for a prefill and the part of them no head attends to (from
    the importance shares), which define `invalid_io_ratio`.
    """

    disk_bytes: int = 0
    disk_blocks: int = 0
    memory_blocks: int = 0
    kv_disk_bytes: int = 0
    kv_unattended_bytes: float = 0.0
    seconds: float = 0.0

    def add(self, other: ReadStats) -> None:
        for name in self.__dataclass_fields__:
            setattr(self, name, getattr(self, name) + getattr(other, name))


def invalid_io_ratio(unattended_bytes: float, kv_disk_bytes: int) -> float:
    """Share of the K/V bytes read from disk for prefills that no head attended to.

    The one definition used per request (`RequestStats`) and per store
    (``store.stats()``).
    """
    return float(unattended_bytes) / kv_disk_bytes if kv_disk_bytes else 0.0


@dataclass
class BlockSet:
    """Blocks of one kind, read for one request step.

    ``pool`` holds one block per slot: K/V blocks as ``[slots, 2, kv_heads, S, head_dim]``
    (the first ``rows[slot]`` rows valid), probe pieces as ``uint8 [slots, S, record]``.
    ``slot_of[i]`` is the slot of the ``i``-th key asked for (duplicates share a slot).
    ``held`` maps slots whose block was not copied into the pool (a memory-tier hit read
    with ``place_hits=False``) to the block itself; `slot` and `gather_into` use it,
    `placed` copies it into the pool for the index-based gathers.
    """

    kind: int
    pool: torch.Tensor
    rows: list[int]
    slot_of: list[int]
    stats: ReadStats = field(default_factory=ReadStats)
    held: dict[int, torch.Tensor] = field(default_factory=dict)

    def slot(self, slot: int) -> torch.Tensor:
        """The block in a slot, as a tensor with the slot's row capacity or fewer rows."""
        block = self.held.get(slot)
        return self.pool[slot] if block is None else block

    def placed(self) -> BlockSet:
        """This set with every held block copied into the pool (for index-based gathers)."""
        for slot, block in self.held.items():
            if self.kind == KV:
                self.pool[slot, :, :, : block.shape[2]].copy_(block)
            else:
                self.pool[slot, : block.shape[0]].copy_(block)
        self.held = {}
        return self

    @property
    def slot_rows(self) -> int:
        """``S``, the rows a slot can hold (the largest block read)."""
        return self.pool.shape[3] if self.kind == KV else self.pool.shape[1]

    def block(self, i: int) -> torch.Tensor:
        """The ``i``-th key's block: ``[2, kv_heads, rows, head_dim]`` or ``[rows, record]``."""
        slot = self.slot_of[i]
        block = self.slot(slot)
        if self.kind == KV:
            return block[:, :, : self.rows[slot]]
        return block[: self.rows[slot]]
