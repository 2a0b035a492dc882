"""The value of a stored prefix to the disk budget: access statistics per radix node, and
the order in which the disk budget considers them.

Every request that reuses a prefix records one access on each radix node it matched,
with the share of the node's rows it loaded for the prefill; a node written by a prompt
starts with statistics but no access. The configured eviction policy (IMPRESS score,
LRU or LFU) turns them into a priority, so the disk budget removes the stored prefix
with the lowest score, the least recently or the least often used one. A split node's
two halves inherit its statistics.

Eviction order is a min-heap of ``(sort_key, node_id)`` with lazy re-keying, like the
memory tiers' heaps (`tiers/heaps.py`): a node gets a fresh item whenever its
statistics change or it may have become a leaf (`push`); `pop` drops items whose key is
no longer the node's current key (and pushes the current one). Every policy's sort key
is time-invariant (it changes only when the node's statistics do), so the item at the
top is always the node with the lowest current key. Whether a popped node is still a
leaf of the tree, and free to go, is the caller's check. Stale items are dropped in bulk
when the heap holds more than four times as many items as nodes it knows.

Statistics saved in the index are read after the store opened (``saved``, a
`DeferredLoad`: on the writer thread, or by the first call that needs them; its rows with
impossible values skipped), kept as columns (`_load_saved`)
and become policy records only when their node is used (accessed, split, or taken off
the eviction heap): the heap's first items are keyed from the columns at once (the
policy's `sort_keys`), so starting the disk budget on a large store costs a sort, not a
record per node.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from ..index.columns import PackedColumns
from ..index.locks import STATISTICS, OrderedLock
from ..index.files import find_sorted
from ..tiers.policies.base import EvictionPolicy
from .saved import DeferredLoad

_COMPACT_MIN = 256


class NodeValues:
    """Per-node statistics under the store's clock and the eviction heap (thread-safe)."""

    def __init__(self, policy: EvictionPolicy, clock: Callable[[], float]) -> None:
        self._policy = policy
        self._clock = clock
        self._lock = OrderedLock(STATISTICS, "node values", reentrant=False)
        self.dirty: set[int] = set()
        self._heap: list[tuple[tuple[float, int], int]] = []
        #: nodes with at least one heap item (a forgotten node loses its place)
        self._queued: set[int] = set()
        #: whether the heap is kept (from the first `reset_order(..., start=True)` on: a
        #: store without a disk budget pays nothing for it)
        self.ordering = False
        #: saved statistics not yet made policy records (`_load_saved`): node ids
        #: (increasing), their columns and which are still waiting
        self._saved_ids = np.zeros(0, np.int64)
        self._saved = np.zeros((0, 6), np.float64)
        self._waiting = np.zeros(0, bool)
        #: the saved statistics (``read() -> (ids, columns)``, as `_load_saved` takes
        #: them), read after open by the first call of any method below that needs them
        self.saved = DeferredLoad("statistics of the stored prefixes", self._lock, lambda saved: self._load_saved(*saved))

    # -- saved statistics, installed when first needed -------------------------------------
    def _ensure(self) -> None:
        """(Not under the lock.) Nothing is recorded before the saved statistics are in:
        what was saved comes first, as if read at open (`DeferredLoad.load`)."""
        self.saved.load()

    def _load_saved(self, ids: np.ndarray, cols: np.ndarray) -> int:
        """(Under the lock.) Saved statistics as columns: node ids (increasing) and the
        policy fields (`persist.rebase_columns`), every row possible (`saved.possible_rows`)."""
        # (ids in four bytes while they fit: searched, never changed)
        self._saved_ids = ids.astype(np.uint32) if len(ids) and ids[0] >= 0 and ids[-1] < 1 << 32 else ids
        self._saved = PackedColumns(cols)  # (the same values in fewer bytes: most columns are small ints or few values)
        self._waiting = np.ones(len(ids), bool)
        if len(ids):  # the newest one now: later accesses count as more recent than all
            self._take(int(ids[int(np.argmax(cols[:, 3]))]))
        return len(ids)

    def _install_row(self, node_id: int, row: np.ndarray) -> None:
        self._policy.load_stats(node_id, {
            "count": int(row[0]), "freq": float(row[1]), "share": float(row[2]), "seq": int(row[3]),
            "freq_time": float(row[4]), "last_access": float(row[5]),
        })

    def _take(self, node_id: int) -> None:
        """Install the saved statistics of ``node_id`` if they are still waiting (under the lock)."""
        i = find_sorted(self._saved_ids, node_id)
        if i >= 0 and self._waiting[i]:
            self._waiting[i] = False
            if node_id not in self._policy:
                self._install_row(node_id, self._saved[i])

    def _drop_saved(self, node_id: int) -> None:
        i = find_sorted(self._saved_ids, node_id)
        if i >= 0:
            self._waiting[i] = False

    # -- statistics --------------------------------------------------------------------
    def access(self, node_ids: Iterable[int], share: float = 1.0) -> None:
        now = self._clock()
        self._ensure()
        with self._lock:
            for node_id in node_ids:
                self._take(node_id)
                self._policy.on_access(node_id, now, share)
                self.dirty.add(node_id)
                self._push(node_id, now)

    def seed(self, node_id: int) -> None:
        self._ensure()
        with self._lock:
            now = self._clock()
            self._take(node_id)
            self._policy.seed(node_id, now, 1.0)
            self.dirty.add(node_id)
            self._push(node_id, now)

    def inherit(self, old_id: int, new_ids: Iterable[int]) -> None:
        self._ensure()
        with self._lock:
            now = self._clock()
            new_ids = list(new_ids)
            self._take(old_id)
            if old_id in self._policy:
                record = self._policy.stats_of(old_id)
                for node_id in new_ids:
                    self._policy.load_stats(node_id, record)
                    self.dirty.add(node_id)
            self._policy.forget(old_id)
            self._queued.discard(old_id)
            for node_id in new_ids:
                self._push(node_id, now)

    def forget(self, node_ids: Iterable[int]) -> None:
        self._ensure()
        with self._lock:
            for node_id in node_ids:
                self._drop_saved(node_id)
                self._policy.forget(node_id)
                self.dirty.discard(node_id)
                self._queued.discard(node_id)

    def sort_key(self, node_id: int) -> tuple[float, int]:
        """Eviction order: lower goes first (see `EvictionPolicy.sort_key`)."""
        self._ensure()
        with self._lock:
            self._take(node_id)
            return self._policy.sort_key(node_id, self._clock())

    def priority(self, node_id: int) -> float:
        self._ensure()
        with self._lock:
            self._take(node_id)
            return float(self._policy.priority(node_id, self._clock()))

    def unsaved(self, node_ids: Iterable[int]) -> None:
        """Mark exported statistics as changed again (their save failed)."""
        with self._lock:
            self.dirty.update(node_ids)

    def export(self) -> dict[int, dict[str, Any]]:
        """Statistics of the nodes changed since the last export, rebased to now."""
        with self._lock:
            now = self._clock()
            dirty, self.dirty = self.dirty, set()
            return {k: self._policy.stats_of(k, now) for k in dirty if k in self._policy}

    def load(self, records: Iterable[tuple[int, dict[str, Any]]]) -> int:
        n = 0
        self._ensure()
        with self._lock:
            now = self._clock()
            for node_id, rec in records:
                self._drop_saved(node_id)
                self._policy.load_stats(node_id, rec)
                self._push(node_id, now)
                n += 1
        return n

    # -- eviction order ------------------------------------------------------------------
    def push(self, node_ids: Iterable[int]) -> None:
        """Give nodes a heap item with their current key (nodes that may have become
        leaves, or that a caller popped and puts back)."""
        if not self.ordering:
            return
        self._ensure()
        with self._lock:
            now = self._clock()
            for node_id in node_ids:
                self._push(node_id, now)

    def leaves_changed(self, node_ids: Iterable[int], reset: bool, removed: Iterable[int] = ()) -> None:
        """`Catalog`'s ``on_leaves``: nodes that may have become leaves (``reset``: the
        tree was loaded and these are all its leaves), and nodes another process removed
        (their statistics and heap place go, as for this process's own removals)."""
        removed = list(removed)
        if removed:
            self.forget(removed)
        if reset:
            self.reset_order(node_ids)
        else:
            self.push(node_ids)

    def reset_order(self, node_ids: Iterable[int], start: bool = False) -> None:
        """Start the heap again with exactly ``node_ids`` (the tree's leaves, after it
        was loaded); ``start`` keeps the heap from now on."""
        if not (self.ordering or start):
            return
        self._ensure()
        with self._lock:
            self.ordering = True
            now = self._clock()
            self._queued = set(node_ids)
            ids = np.fromiter(self._queued, np.int64, len(self._queued))
            heap: list[tuple[tuple[float, int], int]] = []
            saved, rows = self._waiting_rows(ids)
            cols = self._saved[rows] if len(rows) else None
            keys = self._policy.sort_keys(cols) if cols is not None else None
            if keys is None:  # a policy without a column form: its rows loaded one by one
                saved[:] = False
            else:  # saved rows keyed as columns; their records are made when popped (`_take`)
                seqs = cols[:, 3].astype(np.int64).tolist()
                heap = list(zip(zip(keys, seqs), ids[saved].tolist()))
            heap += [(self._sort_key(n, now), n) for n in ids[~saved].tolist()]
            heapq.heapify(heap)
            self._heap = heap

    def _waiting_rows(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Which of ``ids`` have saved statistics still waiting, and their rows."""
        saved_ids = self._saved_ids
        if not len(saved_ids) or not len(ids):
            return np.zeros(len(ids), bool), np.zeros(0, np.int64)
        rows = np.minimum(np.searchsorted(saved_ids, ids), len(saved_ids) - 1)
        hit = (saved_ids[rows] == ids) & self._waiting[rows]
        return hit, rows[hit]

    def _sort_key(self, node_id: int, now: float) -> tuple[float, int]:
        """The node's current key, its saved statistics installed first (under the lock)."""
        self._take(node_id)
        return self._policy.sort_key(node_id, now)

    def pop(self) -> int | None:
        """The queued node with the lowest current key, taken off the heap (``None``
        when the heap is empty). The caller pushes it back if it does not remove it."""
        self._ensure()
        with self._lock:
            now = self._clock()
            heap = self._heap
            while heap:
                key, node_id = heapq.heappop(heap)
                if node_id not in self._queued:
                    continue
                current = self._sort_key(node_id, now)
                if current != key:  # statistics changed since this item was pushed
                    heapq.heappush(heap, (current, node_id))
                    continue
                return node_id
            return None

    def queued(self) -> int:
        """Heap items, stale ones included (for tests and the benchmark)."""
        return len(self._heap)

    def _push(self, node_id: int, now: float) -> None:
        if not self.ordering:
            return
        heapq.heappush(self._heap, (self._sort_key(node_id, now), node_id))
        self._queued.add(node_id)
        if len(self._heap) > _COMPACT_MIN and len(self._heap) > 4 * len(self._queued):
            self._compact(now)

    def _compact(self, now: float) -> None:
        """Keep one item per queued node, with its current key."""
        seen: set[int] = set()
        kept = []
        for _, node_id in self._heap:
            if node_id in self._queued and node_id not in seen:
                seen.add(node_id)
                kept.append((self._sort_key(node_id, now), node_id))
        heapq.heapify(kept)
        self._heap = kept
