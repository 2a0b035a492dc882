"""Block statistics that survive restarts (the memory tiers' cold start).

Every block a request accesses is marked; the marked blocks' policy statistics are
written to the index on `flush`, on `close` and, while requests run, at most every
``stats_interval_s`` seconds on the writer thread. Opening the store installs them again,
with their ages extended by the time the store was closed.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from ..index.sqlite import Index
from ..storage.base import BlockKey
from ..tiers import TierManager

log = logging.getLogger(__name__)


class BlockStatsKeeper:
    """Tracks which blocks' statistics changed and saves them."""

    def __init__(
        self,
        index: Index,
        tiers: TierManager,
        interval_s: float | None,
        background: Callable[[Callable[[], Any]], None],
    ) -> None:
        self._index = index
        self._tiers = tiers
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
        if self._interval is None or self.closed or self._tiers.now() - self._saved_at < self._interval:
            return
        self._saved_at = self._tiers.now()
        self._background(self._save_quietly)

    def forget(self, file_ids: set[int]) -> None:
        with self._lock:
            self._dirty = {k for k in self._dirty if k[0] not in file_ids}

    def save(self) -> int:
        """Write the statistics of the blocks accessed since the last save to the index.

        Each record holds the access count, the (decayed) frequency, the importance
        share, the age of the last access and the access sequence number. Returns the
        number of block records written.
        """
        with self._lock:
            self._saved_at = self._tiers.now()
            if not self._dirty or self.closed:
                return 0
            dirty, self._dirty = self._dirty, set()
        records = self._tiers.export_stats(dirty)
        return self._index.save_block_stats(records, time.time())

    def _save_quietly(self) -> None:
        try:
            self.save()
        except Exception:
            log.warning("saving block statistics failed; they will be saved on the next flush", exc_info=True)

    def load(self) -> int:
        """Install the saved block statistics in the policy (ages include the downtime)."""
        rows = self._index.load_block_stats()
        if not rows:
            return 0
        now = self._tiers.now()
        wall = time.time()
        records: dict[BlockKey, dict[str, Any]] = {}
        for key, rec in rows:
            down = max(0.0, wall - float(rec["saved_at"]))
            records[key] = {
                "count": rec["count"],
                "freq": rec["freq"],
                "share": min(1.0, max(0.0, float(rec["share"]))),
                "seq": rec["seq"],
                "freq_time": now - down,
                "last_access": now - down - float(rec["age_s"]),
            }
        return self._tiers.import_stats(records, now=None)
