"""Removing what the store no longer wants on disk: damaged files, crash leftovers and the
least valuable prefixes when the chunk files exceed ``disk_bytes``."""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from ..errors import CorruptBlockError
from ..index.radix import RadixNode, Segment
from ..index.sqlite import FileRecord
from ..storage.base import KV, BlockKey
from ..tiers import TierManager
from .catalog import Catalog
from .layout import PrefixLayout
from .leases import LeaseTable

log = logging.getLogger(__name__)

QUARANTINE_DIR = "quarantine"


@dataclass
class GCCounters:
    """Totals since the store was opened (or since `reset_stats`)."""

    quarantined_files: int = 0
    prefixes_evicted: int = 0
    files_evicted: int = 0
    disk_bytes_evicted: int = 0


class StoreGC:
    """Quarantine, orphan removal and the disk budget of one store."""

    def __init__(
        self,
        catalog: Catalog,
        leases: LeaseTable,
        tiers: TierManager,
        num_layers: int,
        clock: Callable[[], float],
    ) -> None:
        self._catalog = catalog
        self._leases = leases
        self._tiers = tiers
        self._layers = num_layers
        self._clock = clock
        self.counters = GCCounters()

    # -- damaged files ---------------------------------------------------------------
    def quarantine(self, file_id: int, reason: str) -> None:
        """Move a damaged chunk file aside and forget every prefix that needs it.

        Nodes stored in the file, and everything below them in the tree, are removed
        from the index; later requests recompute those tokens.
        """
        catalog = self._catalog
        removed = 0
        with catalog.lock, catalog.index.transaction() as conn:
            catalog.refresh()
            for top in [n for n in catalog.tree.nodes() if n.file_id == file_id]:
                if top.parent is None:
                    continue  # already removed as part of another subtree
                for node in catalog.tree.subtree(top):
                    node.lock_ref = 0
                    catalog.remove(conn, node)
                    removed += 1
            record = catalog.index.file(file_id)
            dropped = catalog.drop_unreferenced_files(conn)
            self._unlink(rec for rec in dropped if rec.id != file_id)
            catalog.forget({rec.id for rec in dropped} | {file_id})
            if record is not None:
                qdir = catalog.root / QUARANTINE_DIR
                qdir.mkdir(exist_ok=True)
                src = catalog.chunks / record.name
                if src.exists():
                    os.replace(src, qdir / record.name)
            self.counters.quarantined_files += 1
        log.warning(
            "quarantined chunk file %s (%s); removed %d node(s) that depended on it",
            record.name if record else file_id, reason, removed,
        )

    def remove_orphans(self) -> None:
        """Delete temp files and chunk files the index does not know (crash leftovers)."""
        known = {f.name for f in self._catalog.index.files()}
        for p in self._catalog.chunks.iterdir():
            if p.name not in known:
                log.info("removing unindexed file %s (left by an interrupted write)", p.name)
                p.unlink(missing_ok=True)

    def _unlink(self, records: Iterable[FileRecord]) -> None:
        for rec in records:
            (self._catalog.chunks / rec.name).unlink(missing_ok=True)

    # -- disk budget -----------------------------------------------------------------
    def enforce(self, budget: int | None, protect: Iterable[int] = ()) -> dict[str, int]:
        """Remove the least valuable stored prefixes until the chunk files fit ``budget``.

        Candidates are the radix-tree leaves (whole stored prefixes, or their unshared
        tails) that are not in use: no lease reference, not matched within the grace
        period, and not in ``protect``. The value of a leaf is the mean policy priority
        of its K/V blocks (`TierManager.priority`: IMPRESS score, recency or access
        count); the lowest goes first. All removals happen in one index transaction;
        then chunk files no node references any more are deleted. A file shared with
        nodes that stay is kept (its bytes are freed once its last node goes).
        """
        result = {"removed_prefixes": 0, "removed_files": 0, "freed_bytes": 0}
        catalog = self._catalog
        index = catalog.index
        if budget is None:
            return {**result, "disk_bytes": index.total_bytes(), "budget": -1}
        protected = set(protect)
        removed_files: list[FileRecord] = []
        with catalog.lock:
            catalog.refresh()
            if index.total_bytes() <= budget:
                return {**result, "disk_bytes": index.total_bytes(), "budget": budget}
            now = self._clock()
            values: dict[int, float] = {}
            try:
                with index.transaction() as conn:
                    while index.total_bytes() > budget:
                        candidates = [n for n in catalog.tree.nodes() if self._evictable(n, protected, now)]
                        if not candidates:
                            log.warning(
                                "the store holds %d bytes, over disk_bytes=%d, but every remaining "
                                "prefix is in use or was just written",
                                index.total_bytes(), budget,
                            )
                            break
                        for n in candidates:
                            if n.id not in values:
                                values[n.id] = self._node_value(n)
                        victim = min(candidates, key=lambda n: (values[n.id], n.id))
                        catalog.remove(conn, victim)
                        result["removed_prefixes"] += 1
                        removed_files += catalog.drop_unreferenced_files(conn)
            except BaseException:
                catalog.reload_tree()
                raise
            catalog.forget({rec.id for rec in removed_files})
            self._unlink(removed_files)
            result["removed_files"] = len(removed_files)
            result["freed_bytes"] = sum(rec.nbytes for rec in removed_files)
            c = self.counters
            c.prefixes_evicted += result["removed_prefixes"]
            c.files_evicted += result["removed_files"]
            c.disk_bytes_evicted += result["freed_bytes"]
            after = index.total_bytes()
        if result["removed_prefixes"]:
            log.info(
                "disk budget: removed %d prefix node(s) and %d file(s), freed %d bytes; %d of %d bytes used",
                result["removed_prefixes"], result["removed_files"], result["freed_bytes"], after, budget,
            )
        return {**result, "disk_bytes": after, "budget": budget}

    def _node_kv_keys(self, node: RadixNode) -> list[BlockKey]:
        """K/V blocks (all layers) holding the rows of one node."""
        units = PrefixLayout([Segment(node, len(node.tokens))], self._catalog.chunk_tokens_of).units
        return [(u.file_id, KV, layer, u.block) for layer in range(self._layers) for u in units]

    def _node_value(self, node: RadixNode) -> float:
        try:
            keys = self._node_kv_keys(node)
        except CorruptBlockError:
            return -math.inf  # its file is gone: nothing worth keeping
        return sum(self._tiers.priority(k) for k in keys) / max(1, len(keys))

    def _evictable(self, node: RadixNode, protected: set[int], now: float) -> bool:
        return not (
            node.children or node.lock_ref > 0 or node.id in protected or self._leases.in_grace(node.id, now)
        )
