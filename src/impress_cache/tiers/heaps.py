"""Min-heaps of resident blocks, one per (tier, importance class), with lazy deletion.

A block's heap item is ``(sort_key, version, key)``. Every change to a resident block
(new statistics, a move to another tier or class, removal) bumps its version, which
makes older items stale; stale items are skipped when they reach the top and dropped
in bulk when a heap holds more than four times as many items as live blocks.
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable, Iterable
from dataclasses import dataclass
from typing import Any

from ..validate import IMPORTANCE_CLASSES
from .policies.base import EvictionPolicy

#: Name of the fast memory tier (GPU memory in the real store).
DEVICE = "device"
#: Name of the slower memory tier (CPU memory in the real store).
HOST = "host"
#: Memory tiers, fastest first.
TIERS: tuple[str, str] = (DEVICE, HOST)

HeapItem = tuple[tuple[float, int], int, Hashable]

_COMPACT_MIN = 64


@dataclass(eq=False)
class Resident:
    """One block held by a memory tier."""

    key: Hashable
    tier: str
    payload: Any
    nbytes: int
    cls: str
    version: int = 0
    skey: tuple[float, int] | None = None


class TierHeaps:
    """The heaps of every (tier, class) pair over a shared map of resident blocks."""

    def __init__(self, policy: EvictionPolicy, where: dict[Hashable, Resident]) -> None:
        self._policy = policy
        self._where = where
        self._heaps: dict[str, dict[str, list[HeapItem]]] = {
            t: {c: [] for c in IMPORTANCE_CLASSES} for t in TIERS
        }
        self._live = {t: {c: 0 for c in IMPORTANCE_CLASSES} for t in TIERS}
        self._version = 0

    def invalidate(self, entry: Resident) -> None:
        """Make every heap item of ``entry`` stale."""
        self._version += 1
        entry.version = self._version

    def push(self, entry: Resident, now: float) -> None:
        """Give a resident block a fresh heap item (older ones become stale)."""
        self.invalidate(entry)
        entry.skey = self._policy.sort_key(entry.key, now)
        heap = self._heaps[entry.tier][entry.cls]
        heapq.heappush(heap, (entry.skey, entry.version, entry.key))
        if len(heap) > _COMPACT_MIN and len(heap) > 4 * self._live[entry.tier][entry.cls]:
            self._compact(entry.tier, entry.cls)

    def count(self, entry: Resident, delta: int) -> None:
        """Track how many live blocks each heap should hold (for compaction)."""
        self._live[entry.tier][entry.cls] += delta

    def _valid(self, item: HeapItem, tier: str, cls: str) -> Resident | None:
        entry = self._where.get(item[2])
        if entry is None or entry.tier != tier or entry.cls != cls or entry.version != item[1]:
            return None
        return entry

    def _compact(self, tier: str, cls: str) -> None:
        kept = [item for item in self._heaps[tier][cls] if self._valid(item, tier, cls) is not None]
        heapq.heapify(kept)
        self._heaps[tier][cls] = kept

    def rekey(self, tier: str, now: float) -> None:
        """Recompute every key of a tier (for policies whose order depends on time)."""
        for cls in IMPORTANCE_CLASSES:
            self._heaps[tier][cls] = []
        for entry in self._where.values():
            if entry.tier == tier:
                self.push(entry, now)

    def peek(self, tier: str, cls: str, now: float) -> HeapItem | None:
        """Smallest valid item of a heap, dropping stale items and re-keying changed ones."""
        heap = self._heaps[tier][cls]
        while heap:
            skey, _, key = heap[0]
            entry = self._valid(heap[0], tier, cls)
            if entry is None:
                heapq.heappop(heap)
                continue
            if self._policy.sort_key(key, now) != skey:
                # statistics changed behind the manager's back: lazy re-key
                heapq.heappop(heap)
                self.push(entry, now)
                heap = self._heaps[tier][cls]
                continue
            return heap[0]
        return None

    def pop(self, tier: str, cls: str) -> HeapItem:
        """Remove the top item (call right after `peek` returned it)."""
        return heapq.heappop(self._heaps[tier][cls])

    def restore(self, taken: Iterable[tuple[str, str, HeapItem]]) -> None:
        """Put back items removed with `pop` (victim planning is tentative)."""
        for tier, cls, item in taken:
            heapq.heappush(self._heaps[tier][cls], item)

    def live_keys(self, tier: str, cls: str) -> set[Hashable]:
        """Keys with a valid item in a heap (for invariant checks)."""
        return {item[2] for item in self._heaps[tier][cls] if self._valid(item, tier, cls) is not None}
