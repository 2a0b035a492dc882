"""Statistics that survive restarts: the memory tiers' block statistics (their cold start),
the nodes' access statistics (the disk budget's values) and the nodes' row importance
(the reorganiser's input).

Every block a request accesses through the memory tiers is marked, and so is every node
it reuses; the marked statistics are written to the index on `flush`, on `close` and,
while requests run, at most every ``stats_interval_s`` seconds on the writer thread.
Opening the store installs them again, with their ages extended by the time the store
was closed.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from ..index.files import release_free_heap
from ..index.sqlite import Index
from ..storage.base import BlockKey
from ..tiers import TierManager
from .reorder.importance import ImportanceStats
from .values import NodeValues

log = logging.getLogger(__name__)


#: the fields of a saved record (`Index.load_block_stats`; the columns of
#: `Index.load_node_stats`), and of a policy record on the store's clock
SAVED = ("count", "freq", "share", "age_s", "seq", "saved_at")
POLICY = ("count", "freq", "share", "seq", "freq_time", "last_access")


def rebase_columns(cols: np.ndarray, now: float) -> np.ndarray:
    """Saved records as policy records on a clock reading ``now``: the time the store
    was closed counts as idle time. ``cols``: ``float64 [n, 6]`` of the `SAVED` fields,
    turned into the `POLICY` fields in place (a block of rows at a time: small
    temporaries) and returned."""
    wall = time.time()
    for k in range(0, len(cols), 4096):
        c = cols[k : k + 4096]
        saved = now - np.maximum(0.0, wall - c[:, 5])  # the save, on this clock
        c[:, 5] = saved - c[:, 3]  # last access: age_s before it
        c[:, 3] = c[:, 4]  # seq
        c[:, 4] = saved  # freq_time
        np.clip(c[:, 2], 0.0, 1.0, out=c[:, 2])
    return cols


def rebase(rows: Iterable[tuple[Any, dict[str, Any]]], now: float) -> dict[Any, dict[str, Any]]:
    """`rebase_columns` of saved records given as ``(key, record)`` pairs."""
    rows = list(rows)
    if not rows:
        return {}
    cols = rebase_columns(np.array([[float(rec[k]) for k in SAVED] for _, rec in rows], np.float64), now)
    return {key: dict(zip(POLICY, vals)) for (key, _), vals in zip(rows, cols.tolist())}


class StatsKeeper:
    """Tracks which statistics changed and saves them."""

    def __init__(
        self,
        index: Index,
        tiers: TierManager,
        nodes: NodeValues,
        interval_s: float | None,
        background: Callable[[Callable[[], Any]], None],
        importance: ImportanceStats | None = None,
        guard: Any = None,
    ) -> None:
        self._index = index
        self._tiers = tiers
        self._nodes = nodes
        self._importance = importance
        #: held around reading the deferred node statistics (the catalog's lock)
        self._guard = guard if guard is not None else threading.RLock()
        self._interval = interval_s
        self._background = background
        self._lock = threading.Lock()
        self._dirty: set[BlockKey] = set()
        self._saved_at = tiers.now()
        self.closed = False

    def mark(self, keys: Iterable[BlockKey]) -> None:
        """Note accessed blocks; schedule a save when the interval has passed."""
        with self._lock:
            self._dirty.update(keys)
        self.maybe_save()

    def maybe_save(self) -> None:
        if self._interval is None or self.closed or self._tiers.now() - self._saved_at < self._interval:
            return
        self._saved_at = self._tiers.now()
        self._background(self._save_quietly)

    def save(self) -> int:
        """Write the statistics changed since the last save to the index; returns the
        number of block records written (node records are written too)."""
        with self._lock:
            self._saved_at = self._tiers.now()
            if self.closed:
                return 0
            dirty, self._dirty = self._dirty, set()
        # export everything first (each export decays its values to now), then take the
        # wall clock once: the writes below may take a while, and a later ``saved_at``
        # than the exports' time would count that while twice on reload
        nodes = self._nodes.export()
        importance = self._importance.export() if self._importance is not None else {}
        try:
            blocks = self._tiers.export_stats(dirty) if dirty else {}
            saved_at = time.time()
            self._index.save_node_stats(nodes, saved_at)
            self._index.save_importance(importance, saved_at)
            return self._index.save_block_stats(blocks, saved_at)
        except BaseException:
            # nothing is lost: what was to be saved stays marked for the next save (a
            # part that was written meanwhile is written again, harmlessly)
            with self._lock:
                self._dirty.update(dirty)
            self._nodes.unsaved(nodes)
            if self._importance is not None:
                self._importance.unsaved(importance)
            raise

    def _save_quietly(self) -> None:
        try:
            self.save()
        except Exception:
            log.warning("saving statistics failed; they will be saved on the next flush", exc_info=True)

    def load(self) -> int:
        """Install the saved statistics; returns the number of block records. The node
        statistics are read on the writer thread after the store opened, or by the first
        call that needs them (`NodeValues.defer_saved`)."""
        def read_node_stats() -> tuple[Any, Any]:
            ids, cols = self._index.load_node_stats()
            return ids, rebase_columns(cols, self._tiers.now())  # (with the wall clock, read together)

        self._nodes.defer_saved(read_node_stats, self._guard)
        self._background(_then_release(self._nodes.load_pending))
        if self._importance is not None:  # (likewise deferred: a row of float16 scores per node)
            self._importance.defer(self._index.load_importance, self._guard)
            self._background(_then_release(self._importance.load_pending))
        # memory tiers without a budget look nothing up and record nothing: their
        # statistics stay in the index (a later save writes only what the tiers know)
        rows = self._index.load_block_stats() if self._tiers.enabled else []
        loaded = self._tiers.import_stats(rebase(rows, self._tiers.now()), now=None) if rows else 0
        del rows
        release_free_heap()  # the temporaries of the loads
        return loaded


def _then_release(job: Callable[[], Any]) -> Callable[[], None]:
    """``job``, then the C heap's free memory given back: a deferred load's temporaries
    (the rows as read, the full-width columns) are freed on the writer thread, whose
    heap keeps their pages resident otherwise."""
    def run() -> None:
        job()
        release_free_heap()
    return run
