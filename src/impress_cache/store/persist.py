"""Statistics that survive restarts: the memory tiers' block statistics (their cold start),
the nodes' access statistics (the disk budget's values) and the nodes' row importance
(the reorganiser's input).

Every block a request accesses through the memory tiers is marked, and so is every node
it reuses; the marked statistics are written to the index on `flush`, on `close` and,
while requests run, at most every ``stats_interval_s`` seconds on the writer thread.
Opening the store installs them again, with their ages extended by the time the store
was closed; a saved row with impossible values is skipped, the others installed
(`saved.possible_rows`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from ..index.files import release_free_heap
from ..index.locks import LEAF, OrderedLock
from ..index.guard import float_rows
from ..index.sqlite import Index
from ..storage.base import BlockKey
from ..tiers import TierManager
from .reorder.importance import ImportanceStats
from .saved import SAVED, possible_importance, possible_rows, skip
from .values import NodeValues

log = logging.getLogger(__name__)


#: the fields of a policy record on the store's clock (`rebase_columns` of `SAVED` ones)
POLICY = ("count", "freq", "share", "seq", "freq_time", "last_access")


def rebase_columns(cols: np.ndarray, now: float) -> np.ndarray:
    """Saved records as policy records on a clock reading ``now``: the time the store
    was closed counts as idle time. ``cols``: ``float64 [n, 6]`` of the `SAVED` fields,
    every row possible (`possible_rows`), turned into the `POLICY` fields in place (a
    block of rows at a time: small temporaries) and returned."""
    wall = time.time()
    for k in range(0, len(cols), 4096):
        c = cols[k : k + 4096]
        saved = now - np.maximum(0.0, wall - c[:, 5])  # the save, on this clock
        c[:, 5] = saved - c[:, 3]  # last access: age_s before it
        c[:, 3] = c[:, 4]  # seq
        c[:, 4] = saved  # freq_time
    return cols


def rebase(rows: Iterable[tuple[Any, dict[str, Any]]], now: float) -> dict[Any, dict[str, Any]]:
    """`rebase_columns` of saved records given as ``(key, record)`` pairs; impossible
    ones skipped (`skip`)."""
    rows = list(rows)
    if not rows:
        return {}
    cols = float_rows([[rec[k] for k in SAVED] for _, rec in rows])
    ok = possible_rows(cols)
    keys = [key for key, _ in rows]
    if skip("block statistics", ok, keys):
        keys, cols = [key for key, good in zip(keys, ok.tolist()) if good], cols[ok]
    cols = rebase_columns(cols, now)
    return {key: dict(zip(POLICY, vals)) for key, vals in zip(keys, cols.tolist())}


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
        self._lock = OrderedLock(LEAF, "dirty blocks", reentrant=False)
        self._dirty: set[BlockKey] = set()
        self._saved_at = tiers.now()
        self.closed = False
        #: saved rows skipped at the last load because their values are impossible
        self.skipped = {"block statistics": 0, "node statistics": 0, "importance statistics": 0}

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
            return self._index.save_statistics(saved_at, nodes, importance, blocks)[2]
        except BaseException:
            # nothing is lost: what was to be saved stays marked for the next save (a
            # part that was written meanwhile is written again, harmlessly)
            with self._lock:
                self._dirty.update(dirty)
            self._nodes.unsaved(nodes)
            if self._importance is not None:
                self._importance.unsaved(importance)
            raise

    def _skipped(self, what: str, ok: Any, keys: Any) -> int:
        self.skipped[what] = skip(what, ok, keys)
        return self.skipped[what]

    def _save_quietly(self) -> None:
        try:
            self.save()
        except Exception:
            log.warning("saving statistics failed; they will be saved on the next flush", exc_info=True)

    def load(self) -> int:
        """Install the saved statistics; returns the number of block records. The node
        statistics and the importance are read on the writer thread after the store
        opened, or by the first call that needs them (`saved.DeferredLoad`). Saved rows
        with impossible values are skipped, counted in ``skipped`` and logged."""
        def read_node_stats() -> tuple[Any, Any]:
            ids, cols = self._index.load_node_stats()
            ok = possible_rows(cols)
            if self._skipped("node statistics", ok, ids):
                ids, cols = ids[ok], cols[ok]
            return ids, rebase_columns(cols, self._tiers.now())  # (with the wall clock, read together)

        def read_importance() -> dict[int, Any]:
            records, layers = self._index.load_importance(), self._importance.layers
            ok = [possible_importance(rec, layers) for rec in records.values()]
            if self._skipped("importance statistics", ok, list(records)):
                records = {k: rec for (k, rec), good in zip(records.items(), ok) if good}
            return records

        busy = self._index.in_transaction
        self._nodes.saved.defer(read_node_stats, self._guard, busy)
        self._background(_then_release(self._nodes.saved.load))
        if self._importance is not None:  # (likewise deferred: a row of float16 scores per node)
            self._importance.saved.defer(read_importance, self._guard, busy)
            self._background(_then_release(self._importance.saved.load))
        # memory tiers without a budget look nothing up and record nothing: their
        # statistics stay in the index (a later save writes only what the tiers know)
        rows = self._index.load_block_stats() if self._tiers.enabled else []
        records = rebase(rows, self._tiers.now()) if rows else {}
        self.skipped["block statistics"] = len(rows) - len(records)
        loaded = self._tiers.import_stats(records, now=None) if records else 0
        del rows, records
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
