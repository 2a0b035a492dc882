"""Accesses recorded now, applied to the policy later, in order.

A request's batch lookup (`TierManager.lookup`) has to say, per block, where it is; the
bookkeeping of the access (the policy's statistics, the block's class and heap
position) can wait. `TouchLog` is the manager's lock: entering it applies every access
recorded so far, in the order they happened and with the clock value they happened at,
so that anything that reads or changes the tiers' state sees exactly what it would have
seen had each access been applied at once. Lookups record into it without draining; a
dense reuse that finds all of its blocks in memory thus pays a dictionary lookup per
block on the request path, and the policy work runs later (`TierManager.settle`, which
the request schedules off its path, or the next operation that needs the state).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable, Sequence
from typing import Any

#: one access: key, important share, clock value
Touch = tuple[Hashable, "float | None", float]


class Bulk(tuple):  # type: ignore[type-arg]
    """Accesses of several keys with one share at one clock value: ``(keys, share, now)``
    (a group hit's, recorded with one entry)."""

    __slots__ = ()

#: recorded accesses beyond which a lookup applies them itself (bounded memory when
#: nothing else enters the lock for a long time)
MAX_PENDING = 1 << 16


class TouchLog:
    """A re-entrant lock that applies the recorded accesses when it is entered."""

    def __init__(self, apply: Callable[[Hashable, float | None, float], None]) -> None:
        self.raw = threading.RLock()
        self._apply = apply
        self._pending: list[Touch | Bulk] = []
        self._count = 0

    def __enter__(self) -> TouchLog:
        self.raw.acquire()
        try:
            self.drain()
        except BaseException:
            self.raw.release()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self.raw.release()

    def record(self, items: Sequence[Touch]) -> None:
        """Add accesses (the caller holds ``raw``)."""
        self._pending.extend(items)
        self._count += len(items)

    def record_bulk(self, keys: Sequence[Hashable], share: float | None, now: float) -> None:
        """Add one access of each of ``keys`` (the caller holds ``raw``)."""
        self._pending.append(Bulk((keys, share, now)))
        self._count += len(keys)

    def drain(self) -> None:
        """Apply every recorded access in order (the caller holds ``raw``). If applying
        one raises, it and the ones after it stay recorded (the error propagates)."""
        while self._pending:
            batch, self._pending = self._pending, []
            for i, item in enumerate(batch):
                if type(item) is Bulk:
                    keys, share, now = item
                    for j, key in enumerate(keys):
                        try:
                            self._apply(key, share, now)
                        except BaseException:
                            self._pending = [Bulk((keys[j:], share, now)), *batch[i + 1 :], *self._pending]
                            self._recount()
                            raise
                    continue
                key, share, now = item
                try:
                    self._apply(key, share, now)
                except BaseException:
                    self._pending = batch[i:] + self._pending
                    self._recount()
                    raise
        self._count = 0

    def _recount(self) -> None:
        self._count = sum(len(it[0]) if type(it) is Bulk else 1 for it in self._pending)

    @property
    def pending(self) -> int:
        """Accesses recorded but not applied yet."""
        return self._count
