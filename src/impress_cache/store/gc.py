"""Removing what the store no longer wants on disk: damaged files, crash leftovers and the
least valuable prefixes when the chunk files exceed ``disk_bytes``.

The store only ever deletes files it wrote itself: names it gives its chunk files (or
their temporary names), relative to its own ``chunks/`` directory; a file still leased by
a request of this process is unlinked when the lease is released.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from ..errors import ImpressError, StoreFormatError
from ..index.radix import RadixNode
from ..index.sqlite import FileRecord
from ..storage import FORMATS
from .catalog import FILE_NAME, Catalog
from .directory import dir_mode, ensure_dir
from .leases import LeaseTable
from .values import NodeValues

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
        self, catalog: Catalog, leases: LeaseTable, values: NodeValues, clock: Callable[[], float], file_mode: int = 0o600
    ) -> None:
        self._file_mode = file_mode
        self._catalog = catalog
        self._leases = leases
        self._values = values
        self._clock = clock
        self.counters = GCCounters()

    # -- damaged files ---------------------------------------------------------------
    def quarantine(self, file_id: int, reason: str) -> None:
        """Move a damaged chunk file aside and forget every prefix that needs it.

        Nodes stored in the file, and everything below them in the tree, are removed
        from the index; later requests recompute those tokens.
        """
        catalog = self._catalog
        removed: list[int] = []
        if catalog.index.read_only:
            self._forget_in_memory(file_id, reason)
            return
        with catalog.lock:
            try:
                with catalog.index.transaction() as conn:
                    catalog.refresh()
                    for top in [n for n in catalog.tree.nodes() if n.file_id == file_id]:
                        if catalog.tree.get(top.id) is not top:
                            continue  # already removed as part of another subtree
                        for node in catalog.tree.subtree(top):
                            catalog.remove(conn, node)
                            removed.append(node.id)
                    record = catalog.records.get(file_id) or catalog.index.file(file_id)
                    dropped = catalog.drop_unreferenced_files(conn)
            except BaseException:
                catalog.reload_tree()
                raise
            self._values.forget(removed)
            for rec in dropped:
                if rec.id != file_id:
                    self._leases.defer_unlink(rec.id, rec.name)
            catalog.forget({rec.id for rec in dropped} | {file_id})
            if record is not None and FILE_NAME.match(record.name):
                self._move_aside(record.name)
            self.counters.quarantined_files += 1
        log.warning(
            "quarantined chunk file %s (%s); removed %d node(s) that depended on it",
            record.name if record else file_id, reason, len(removed),
        )

    def _forget_in_memory(self, file_id: int, reason: str) -> None:
        """Quarantine in a read-only store: this process stops using the file's nodes."""
        catalog = self._catalog
        removed: list[int] = []
        with catalog.lock:
            for top in [n for n in catalog.tree.nodes() if n.file_id == file_id]:
                if catalog.tree.get(top.id) is top:
                    for node in catalog.tree.subtree(top):
                        catalog.tree.remove(node)
                        removed.append(node.id)
            catalog.forget({file_id})
            self._values.forget(removed)
            self.counters.quarantined_files += 1
        log.warning("read-only store: not using chunk file %s any more (%s)", file_id, reason)

    def _move_aside(self, name: str) -> None:
        root = self._catalog.root
        qdir = root / QUARANTINE_DIR
        try:
            ensure_dir(qdir, dir_mode(self._file_mode), "the quarantine folder")
        except ImpressError as exc:
            log.warning("%s; leaving %s in place", exc, name)
            return
        if qdir.is_symlink() or not qdir.is_dir():
            log.warning("%s is not a directory of this store; leaving %s in place", qdir, name)
            return
        qfd = os.open(qdir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            os.replace(name, name, src_dir_fd=self._catalog.chunks_fd, dst_dir_fd=qfd)
        except FileNotFoundError:
            pass
        finally:
            os.close(qfd)

    def remove_orphans(self) -> None:
        """Delete temp files and chunk files the index does not know (crash leftovers).

        Raises `StoreFormatError` when ``chunks/`` holds anything the store does not
        write (it never deletes files it did not create).
        """
        catalog = self._catalog
        known = set(catalog.index.file_names().values())
        foreign, orphans = [], []
        for entry in os.scandir(catalog.chunks_fd):
            name = entry.name
            ours = FILE_NAME.match(name) or (name.endswith(".tmp") and FILE_NAME.match(name[:-4]))
            if ours and name in known and not entry.is_file(follow_symlinks=False):
                continue  # an indexed file replaced by something else: quarantined when read
            if not ours or not entry.is_file(follow_symlinks=False):
                foreign.append(name)
            elif name not in known:
                orphans.append(name)
        if foreign:
            shown = ", ".join(sorted(foreign)[:5]) + (" ..." if len(foreign) > 5 else "")
            raise StoreFormatError(
                f"{catalog.chunks} holds {len(foreign)} entr{'y' if len(foreign) == 1 else 'ies'} this store did "
                f"not write ({shown}); impress_cache deletes files in its own folders, so it will not open "
                "a store there. Move them away or choose another store directory."
            )
        for name in orphans:
            if name.endswith(".tmp") or self._has_own_header(name):
                log.info("removing unindexed file %s (left by an interrupted write)", name)
                catalog.unlink(name)
            else:  # named like ours but without our header: never deleted, moved aside
                log.warning("unindexed file %s has no impress_cache header; moving it to %s/", name, QUARANTINE_DIR)
                self._move_aside(name)

    def _has_own_header(self, name: str) -> bool:
        """Whether a chunk file's header says this store wrote it (its UUID is its name)."""
        fmt = next((cls for cls in FORMATS.values() if name.endswith("." + cls.suffix)), None)
        try:
            meta = fmt().read_metadata(self._catalog.chunks / name) if fmt is not None else {}
        except Exception:  # noqa: BLE001 - any unreadable header: not provably ours
            return False
        return "impress_cache" in meta and meta.get("uuid") == name[:32]

    # -- disk budget -----------------------------------------------------------------
    def enforce(self, budget: int | None, protect: Iterable[int] = ()) -> dict[str, int]:
        """Remove the least valuable stored prefixes until the chunk files fit ``budget``.

        Candidates are the radix-tree leaves (whole stored prefixes, or their unshared
        tails) whose file is not in use (no lease, not matched within the grace period)
        and that are not in ``protect``. The value of a leaf is its node's policy
        priority (`NodeValues`: IMPRESS score, recency or access count of the requests
        that reused it); the lowest goes first. All removals happen in one index
        transaction; then chunk files no node references any more are deleted. A file
        shared with nodes that stay is kept (its bytes are freed once its last node
        goes).
        """
        result = {"removed_prefixes": 0, "removed_files": 0, "freed_bytes": 0}
        catalog = self._catalog
        index = catalog.index
        if budget is None:
            return {**result, "disk_bytes": index.total_bytes(), "budget": -1}
        protected = set(protect)
        removed_files: list[FileRecord] = []
        removed_nodes: list[int] = []
        with catalog.lock:
            catalog.refresh()
            if index.total_bytes() <= budget:
                return {**result, "disk_bytes": index.total_bytes(), "budget": budget}
            now = self._clock()
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
                        victim = min(candidates, key=lambda n: (self._values.sort_key(n.id), n.id))
                        catalog.remove(conn, victim)
                        removed_nodes.append(victim.id)
                        result["removed_prefixes"] += 1
                        removed_files += catalog.drop_unreferenced_files(conn)
            except BaseException:
                catalog.reload_tree()
                raise
            self._values.forget(removed_nodes)
            catalog.forget({rec.id for rec in removed_files})
            for rec in removed_files:
                self._leases.defer_unlink(rec.id, rec.name)
            result["removed_files"] = len(removed_files)
            result["freed_bytes"] = sum(rec.file_bytes for rec in removed_files)
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

    def _evictable(self, node: RadixNode, protected: set[int], now: float) -> bool:
        return not (node.children or node.id in protected or self._leases.in_use(node.file_id, now))
