"""Leases: matched prefixes that disk eviction must leave alone while requests use them.

A match protects its nodes for a grace period (`MATCH_GRACE_S`, on the store's clock)
that covers the moment between `ImpressStore.match` and `ImpressStore.lease`; a lease
holds one reference (``lock_ref``) on every matched node until it is released.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Sequence

from ..index.radix import Match
from .catalog import Catalog

#: seconds after a match during which disk eviction leaves the matched nodes alone
MATCH_GRACE_S = 5.0


class PrefixLease:
    """Protects the radix nodes of matched prefixes from disk eviction until released.

    Returned by `ImpressStore.lease`. `release` (or garbage collection of the lease)
    drops the references; calling it twice is harmless.
    """

    def __init__(self, table: LeaseTable, node_ids: Sequence[int]) -> None:
        #: ids of the nodes whose ``lock_ref`` this lease holds (one reference each)
        self.node_ids = tuple(node_ids)
        self._finalizer = weakref.finalize(self, _release, weakref.ref(table), self.node_ids)

    @property
    def active(self) -> bool:
        """Whether the lease still holds its references."""
        return self._finalizer.alive

    def release(self) -> None:
        """Drop the references (idempotent)."""
        self._finalizer()

    def __enter__(self) -> PrefixLease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _release(table_ref: Callable[[], LeaseTable | None], node_ids: tuple[int, ...]) -> None:
    table = table_ref()
    if table is not None:
        table.unlock(node_ids)


class LeaseTable:
    """Match grace periods and lease references of one store."""

    def __init__(self, catalog: Catalog, clock: Callable[[], float], grace_s: float | None = None) -> None:
        self._catalog = catalog
        self._clock = clock
        #: grace period of a match, in seconds of ``clock`` (default `MATCH_GRACE_S`)
        self.grace_s = MATCH_GRACE_S if grace_s is None else grace_s
        self._matched_at: dict[int, float] = {}

    def note(self, match: Match) -> None:
        """Start the grace period of a match's nodes (call under the catalog lock)."""
        now = self._clock()
        if len(self._matched_at) > 4 * len(self._catalog.tree) + 1024:
            self._matched_at = {k: t for k, t in self._matched_at.items() if now - t < self.grace_s}
        for seg in match.segments:
            self._matched_at[seg.node.id] = now

    def in_grace(self, node_id: int, now: float) -> bool:
        return now - self._matched_at.get(node_id, -float("inf")) < self.grace_s

    def lease(self, matches: Iterable[Match]) -> PrefixLease:
        """One reference on every node of every match (nodes removed meanwhile are skipped)."""
        ids: list[int] = []
        with self._catalog.lock:
            for m in matches:
                for seg in m.segments:
                    node = self._catalog.node(seg.node.id)
                    if node is not None:
                        node.lock_ref += 1
                        ids.append(node.id)
        return PrefixLease(self, ids)

    def unlock(self, node_ids: Iterable[int]) -> None:
        with self._catalog.lock:
            for node_id in node_ids:
                node = self._catalog.node(node_id)
                if node is not None:
                    node.lock_ref = max(0, node.lock_ref - 1)
