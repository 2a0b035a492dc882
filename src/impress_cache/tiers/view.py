"""Read-only views of the memory tiers: where a block is and how full each tier is.

`TierManager` inherits these; they only read its residency table and byte accounting
under its lock (which, like every entry into it, first applies the accesses
`TierManager.lookup` recorded).
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

from ..errors import TierError
from .budget import TierSpace
from .heaps import TIERS, Resident

__all__ = ["TierError", "TierView"]  # (TierError lives in errors.py; its old path still imports)


class TierView:
    """Introspection of a `TierManager` (``_lock``, ``_where`` and ``_space`` are its own)."""

    _lock: Any
    _where: dict[Hashable, Resident]
    _space: TierSpace
    _c: Any
    _heaps: Any
    _policy: Any

    def __repr__(self) -> str:
        with self._lock:
            parts = ", ".join(f"{t}={self._space.used[t]}/{self._space.budget[t]}B" for t in TIERS)
            return f"TierManager({parts}, policy={self._policy.name})"

    def stats(self) -> dict[str, Any]:
        """Counters since construction or the last `reset_stats` (see `TierCounters.report`)."""
        with self._lock:
            return self._c.report(self._space)

    def _check_invariants(self) -> None:
        """Assert internal consistency (for tests); raises AssertionError."""
        with self._lock:
            self._space.check(self._heaps, self._where.values())

    @staticmethod
    def _check_tier(tier: str) -> str:
        if tier not in TIERS:
            raise TierError(f"unknown tier {tier!r}; expected one of {', '.join(TIERS)}")
        return tier

    def _resident(self, key: Hashable, field: str) -> Any:
        """``field`` of a resident block's entry (read under the lock), ``None`` when
        the block is not in memory."""
        with self._lock:
            entry = self._where.get(key)
            return None if entry is None else getattr(entry, field)

    def tier_of(self, key: Hashable) -> str | None:
        """``"device"``, ``"host"`` or ``None`` (only on disk)."""
        return self._resident(key, "tier")

    def used_bytes(self, tier: str) -> int:
        """Bytes of the blocks resident in ``tier``."""
        with self._lock:
            return self._space.used[self._check_tier(tier)]

    def budget(self, tier: str) -> int:
        """Byte budget of ``tier``."""
        return self._space.budget[self._check_tier(tier)]

    def class_bytes(self, tier: str) -> dict[str, int]:
        """Bytes of the blocks resident in ``tier`` per importance class."""
        with self._lock:
            return dict(self._space.class_used[self._check_tier(tier)])

    def blocks(self, tier: str | None = None) -> list[Hashable]:
        """Keys of the blocks resident in ``tier`` (both tiers when ``None``)."""
        with self._lock:
            if tier is not None:
                self._check_tier(tier)
            return [k for k, e in self._where.items() if tier is None or e.tier == tier]

    def nbytes_of(self, key: Hashable) -> int | None:
        """Size of a resident block, or ``None`` when it is not in memory."""
        return self._resident(key, "nbytes")

    def __contains__(self, key: object) -> bool:
        with self._lock:
            return key in self._where

    def __len__(self) -> int:
        with self._lock:
            return len(self._where)
