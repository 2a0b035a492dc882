"""Tenants: a request's ``cache_salt`` chooses the store directory it reads and writes.

Every salt gets a directory of its own, ``ROOT/tenants/<sha256(salt)[:16]>`` (requests
without a salt use ``ROOT/default``), so a request can only match prefixes stored under
its own salt, and nothing of one tenant (matches, timing of matches, statistics) depends
on another tenant's prompts. The salt itself is never written to disk. At most
``max_open`` stores are open at once; the least recently used one is flushed and closed
when another is needed (it reopens from disk with everything it stored).
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from impress_cache import ImpressConfig, ImpressStore

log = logging.getLogger(__name__)

DEFAULT = "default"


def tenant_dir(root: Path, salt: str | None) -> Path:
    """The store directory of ``salt`` under ``root``."""
    if salt is None:
        return root / DEFAULT
    return root / "tenants" / hashlib.sha256(salt.encode("utf-8")).hexdigest()[:16]


class Tenants:
    """An LRU of open stores, one per tenant (thread-safe)."""

    def __init__(self, root: str | Path, model: Any, config: ImpressConfig, max_open: int = 8) -> None:
        if max_open < 1:
            raise ValueError(f"max_open must be at least 1, got {max_open}")
        self.root = Path(root)
        self.model = model
        self.config = config
        self.max_open = max_open
        self._open: OrderedDict[Path, ImpressStore] = OrderedDict()
        self._lock = threading.Lock()
        #: store counters of stores closed so far (their totals stay in the metrics)
        self.closed_totals: dict[str, float] = {}
        self._closed = False

    def store(self, salt: str | None) -> ImpressStore:
        """The open store of ``salt``, opened (or created) when needed."""
        path = tenant_dir(self.root, salt)
        with self._lock:
            if self._closed:
                raise RuntimeError("the tenants' stores are closed")
            store = self._open.get(path)
            if store is not None:
                self._open.move_to_end(path)
                return store
            store = ImpressStore(path, self.model, self.config)
            self._open[path] = store
            evicted = self._open.popitem(last=False)[1] if len(self._open) > self.max_open else None
        if evicted is not None:
            self._close(evicted)
        return store

    def _close(self, store: ImpressStore) -> None:
        try:
            stats = store.stats()
            store.close()
        except Exception:  # noqa: BLE001 - one tenant's failing close must not stop the server
            log.exception("closing the store at %s failed", store.path)
            return
        with self._lock:
            for key in ("prefixes_evicted", "quarantined_files", "bytes_read_disk"):
                self.closed_totals[key] = self.closed_totals.get(key, 0) + stats.get(key, 0)

    def each(self, fn: Callable[[ImpressStore], Any]) -> list[Any]:
        """``fn(store)`` for every open store (under the lock: none closes meanwhile)."""
        with self._lock:
            return [fn(s) for s in self._open.values()]

    def close(self) -> None:
        """Flush and close every open store."""
        with self._lock:
            self._closed = True
            stores = list(self._open.values())
            self._open.clear()
        for store in stores:
            self._close(store)
