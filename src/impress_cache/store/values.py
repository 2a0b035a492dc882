"""The value of a stored prefix to the disk budget: access statistics per radix node.

Every request that reuses a prefix records one access on each radix node it matched,
with the share of the node's rows it loaded for the prefill; a node written by a prompt
starts with statistics but no access. The configured eviction policy (IMPRESS score,
LRU or LFU) turns them into a priority, so the disk budget removes the stored prefix
with the lowest score, the least recently or the least often used one. A split node's
two halves inherit its statistics.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import Any

from ..tiers.policies.base import EvictionPolicy


class NodeValues:
    """Per-node statistics under the store's clock (thread-safe)."""

    def __init__(self, policy: EvictionPolicy, clock: Callable[[], float]) -> None:
        self._policy = policy
        self._clock = clock
        self._lock = threading.Lock()
        self.dirty: set[int] = set()

    def access(self, node_ids: Iterable[int], share: float = 1.0) -> None:
        now = self._clock()
        with self._lock:
            for node_id in node_ids:
                self._policy.on_access(node_id, now, share)
                self.dirty.add(node_id)

    def seed(self, node_id: int) -> None:
        with self._lock:
            self._policy.seed(node_id, self._clock(), 1.0)
            self.dirty.add(node_id)

    def inherit(self, old_id: int, new_ids: Iterable[int]) -> None:
        with self._lock:
            if old_id in self._policy:
                record = self._policy.stats_of(old_id)
                for node_id in new_ids:
                    self._policy.load_stats(node_id, record)
                    self.dirty.add(node_id)
            self._policy.forget(old_id)

    def forget(self, node_ids: Iterable[int]) -> None:
        with self._lock:
            for node_id in node_ids:
                self._policy.forget(node_id)
                self.dirty.discard(node_id)

    def sort_key(self, node_id: int) -> tuple[float, int]:
        """Eviction order: lower goes first (see `EvictionPolicy.sort_key`)."""
        with self._lock:
            return self._policy.sort_key(node_id, self._clock())

    def priority(self, node_id: int) -> float:
        with self._lock:
            return float(self._policy.priority(node_id, self._clock()))

    def export(self) -> dict[int, dict[str, Any]]:
        """Statistics of the nodes changed since the last export, rebased to now."""
        with self._lock:
            now = self._clock()
            dirty, self.dirty = self.dirty, set()
            return {k: self._policy.stats_of(k, now) for k in dirty if k in self._policy}

    def load(self, records: Iterable[tuple[int, dict[str, Any]]]) -> int:
        n = 0
        with self._lock:
            for node_id, rec in records:
                self._policy.load_stats(node_id, rec)
                n += 1
        return n
