"""Removing what the store no longer wants on disk: damaged files (crash leftovers:
`leftovers`) and the least valuable prefixes when the chunk files exceed ``disk_bytes``.

The store only ever deletes files it wrote itself: names it gives its chunk files (or
their temporary names), relative to its own ``chunks/`` directory; a file still leased by
a request of this process is unlinked when the lease is released.
"""

from __future__ import annotations

import heapq
import logging
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from ..index.radix import RadixNode
from ..index.sqlite import WAL_LIMIT, FileRecord
from ..storage.base import KV, PROBE, BlockKey
from ..tiers import TierManager
from .catalog import Catalog
from .changes import TreeChanges
from .chunkfiles import FILE_NAME
from .leftovers import move_aside
from .leases import GRACE, LEASED, LeaseTable
from .values import NodeValues

log = logging.getLogger(__name__)

#: removals per index transaction of the disk budget (the catalog lock is free between)
BATCH = 16


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
        #: the store was found over its budget with nothing left to remove (warned once)
        self._warned_over = False
        catalog.evictor = self.evict_within
        catalog.held = lambda: leases.held().keys()  # (a leased file dropped: forgotten later)

    # -- damaged files ---------------------------------------------------------------
    def quarantine(self, file_id: int, reason: str) -> bool:
        """Move a damaged chunk file aside and forget every prefix that needs it.

        Nodes stored in the file, and everything below them in the tree, are removed
        from the index; later requests recompute those tokens. A file that is no longer
        in the index and that no node needs (rewritten or evicted, by this or another
        process, since a request matched it) is not damaged: nothing is counted and the
        result is False. The tree and the file table change only once the removal has
        committed (`TreeChanges`); an exception means nothing changed.
        """
        catalog = self._catalog
        if catalog.index.read_only:
            self._forget_in_memory(file_id, reason)
            return True
        changes = TreeChanges()
        moving: list[str] = []
        try:
            return self._quarantine(file_id, reason, changes, moving)
        finally:
            catalog.moving_aside.difference_update(moving)

    def _quarantine(self, file_id: int, reason: str, changes: TreeChanges, moving: list[str]) -> bool:
        catalog = self._catalog
        with catalog.transaction() as tx:
            for node in self._dependents(file_id):
                changes.remove_leaf(catalog, tx.conn, node)
            record = catalog.records.get(file_id) or catalog.index.file(file_id)
            if record is not None:
                # named before the removal commits, so the leftover scan, which reads this
                # set with the records in one view, never takes the file for a leftover
                # between the commit and the move aside (one set operation: atomic)
                catalog.moving_aside.add(record.name)
                moving.append(record.name)
            dropped = changes.drop_unreferenced_files(catalog, tx.conn)
        # committed, and the tree follows it
        removed = [node.id for node in changes.removed]
        self._values.forget(removed)
        for rec in dropped:
            if rec.id != file_id:
                self._leases.defer_unlink(rec.id, rec.name)
        # (the other dropped files were forgotten as the tree followed, unless a lease holds them)
        catalog.forget({file_id}, [rec for rec in dropped if rec.id == file_id])
        if record is None and not removed:
            log.info("file %s left the index meanwhile (%s); nothing to quarantine", file_id, reason)
            return False
        if record is not None and FILE_NAME.match(record.name):
            move_aside(catalog, record.name, self._file_mode)
        self.counters.quarantined_files += 1
        log.warning(
            "quarantined chunk file %s (%s); removed %d node(s) that depended on it",
            record.name if record else file_id, reason, len(removed),
        )
        return True

    def _forget_in_memory(self, file_id: int, reason: str) -> None:
        """Quarantine in a read-only store: this process stops using the file's nodes."""
        catalog = self._catalog
        with catalog.lock:
            removed = []
            for node in self._dependents(file_id):
                catalog.tree.remove(node)
                removed.append(node.id)
            catalog.forget({file_id})
            self._values.forget(removed)
            self.counters.quarantined_files += 1
        log.warning("read-only store: not using chunk file %s any more (%s)", file_id, reason)

    def _dependents(self, file_id: int) -> list[RadixNode]:
        """The nodes stored in ``file_id`` and every node below them, children before
        their parents, each once. Under the catalog lock."""
        tree = self._catalog.tree
        out: list[RadixNode] = []
        seen: set[int] = set()
        for top in [n for n in tree.nodes() if n.file_id == file_id]:
            if top.id in seen:
                continue  # part of another one's subtree (nodes() lists parents first)
            sub = tree.subtree(top)
            seen.update(n.id for n in sub)
            out.extend(sub)
        return out

    # -- disk budget -----------------------------------------------------------------
    def enforce(
        self, budget: int | None, protect: Iterable[int] = (), written: int | None = None
    ) -> dict[str, int]:
        """Remove the least valuable stored prefixes until the store fits ``budget``.

        The store's size is what it puts on disk (`Catalog.disk_bytes`): every indexed
        chunk file as the blocks it takes, plus the index, its WAL and shared-memory
        file. The WAL gets `wal_bound` bytes of the budget: a WAL past it is
        checkpointed and truncated before and after the removals, and a smaller one
        counts as that size, so the WAL's growth between two calls stays in budget.

        Candidates are the radix-tree leaves (whole stored prefixes, or their unshared
        tails) that are not in ``protect`` nor ``written`` (the leaf of the prompt just
        written: kept over the budget only if it lives in one file, see `_spread`). They come from the
        eviction heap of `NodeValues` in order of value (the node's policy priority:
        IMPRESS score, recency or access count of the requests that reused it), lowest
        first, ties by node id. A leaf whose file a request has leased is never removed;
        a leaf matched within the grace period is removed only when no other candidate
        is left and the store is still over budget. Each removal is two indexed
        statements (a leaf, its file if no other node needs it); up to `BATCH` of them
        share one index transaction, and the catalog lock is released between
        transactions. A write at the budget usually made its room already, in its own
        transaction (`evict_within`): then this call is a ``stat`` of the WAL (called for a
        write, ``written``, it does not look at other processes' commits first: the write's
        transaction just did, and every batch of removals looks again). Chunk files no node references any more
        are deleted after the commit (a file shared with nodes that stay is kept: its
        bytes are freed once its last node goes). The cost of a call is proportional to
        what it removes and to the candidates it skips, not to the size of the store.
        """
        result = {"removed_prefixes": 0, "removed_files": 0, "freed_bytes": 0}
        catalog = self._catalog
        if budget is None:
            return {**result, "disk_bytes": catalog.disk_bytes(), "budget": -1}
        protected = set(protect) | ({written} if written is not None else set())
        self._start_order()
        bound = wal_bound(budget)
        if written is None:  # (right after a write, its transaction has just followed the index)
            catalog.refresh()
        wal = catalog.index.wal_bytes()
        size = catalog.disk_bytes(wal)
        if wal <= bound and size + bound - wal <= budget:  # (usually: the write's own removals did it)
            return {**result, "disk_bytes": size, "budget": budget}
        self._trim_wal(bound)
        stuck = self._evict_until(budget, bound, protected, result)
        if stuck and written is not None and self._used(bound) > budget and self._spread(written):
            # a budget below what the prompt just written needs: it stays only if it lives
            # in one file (at most one prompt over the budget), else it goes too
            stuck = self._evict_until(budget, bound, protected - {written}, result)
        self._trim_wal(bound)
        after = catalog.disk_bytes(catalog.index.wal_bytes())
        if stuck and after > budget:
            (log.warning if not self._warned_over else log.debug)(
                "the store takes %d bytes, over disk_bytes=%d, but every remaining prefix is in use "
                "or was just written (said once per store; later at debug level)", after, budget,
            )
            self._warned_over = True
        if result["removed_prefixes"]:
            log.info(
                "disk budget: removed %d prefix node(s) and %d file(s), freed %d bytes; %d of %d bytes used",
                result["removed_prefixes"], result["removed_files"], result["freed_bytes"], after, budget,
            )
        return {**result, "disk_bytes": after, "budget": budget}

    def _evict_until(self, budget: int, bound: int, protected: set[int], result: dict[str, int]) -> bool:
        """`enforce`'s removals, a batch per transaction, until the store fits ``budget``;
        adds them to ``result``; returns whether it ran out of candidates."""
        catalog = self._catalog
        while True:
            catalog.refresh()
            used = self._used(bound)  # a stat, outside the lock requests take
            if used <= budget:
                return False
            removal, stuck = self._evict_batch(budget, bound, protected)
            removal.release()  # (unlinks and counts)
            result["removed_prefixes"] += len(removal.victims)
            result["removed_files"] += len(removal.dropped)
            result["freed_bytes"] += removal.freed
            if stuck or len(removal.victims) < BATCH:
                return stuck

    def _spread(self, leaf_id: int) -> bool:
        """Whether the prompt ending at ``leaf_id`` needs more than one chunk file: it
        extends a prefix stored in an older file, which may also hold rows no node uses
        any more (the tail of a prompt evicted since). Kept under a budget below one
        prompt, such a prompt would hold the store over budget by more than one prompt."""
        with self._catalog.lock:
            node = self._catalog.tree.get(leaf_id)
            return node is not None and len({n.file_id for n in node.path()}) > 1

    def _used(self, wal_room: int) -> int:
        """What the budget compares: the store's bytes on disk, with ``wal_room`` bytes
        kept for the WAL however small it is now."""
        wal = self._catalog.index.wal_bytes()
        return self._catalog.disk_bytes(wal) + max(0, wal_room - wal)

    def _trim_wal(self, bound: int) -> None:
        if self._catalog.index.wal_bytes() > bound:
            self._catalog.index.checkpoint()
            self._catalog.remeasure()  # the checkpoint grew the index file

    def _start_order(self) -> None:
        if not self._values.ordering:  # the first call: candidates from the whole tree, once
            with self._catalog.lock:
                self._values.reset_order(self._catalog.tree.leaf_ids(), start=True)

    def evict_within(self, conn: object, budget: int, adding: int, keep: set[int]) -> Removal | None:
        """The disk budget inside a write's own index transaction (`Catalog.commit_prompt`,
        under the catalog lock): remove the least valuable leaves (not those in ``keep``)
        until the store, with the ``adding`` bytes of the file being committed, fits
        ``budget`` (at most `BATCH`; `enforce` after the write does the rest). Their
        removal commits with the write: no transaction, lock or statement of its own but
        two per leaf. Returns what to do once committed (`Removal.settle`) or rolled back
        (`Removal.abandon`); ``None``: nothing removed."""
        self._start_order()
        used = self._used(wal_bound(budget)) + adding
        if used <= budget:
            return None
        removal, _ = self._remove_leaves(conn, budget, used, keep)
        if not removal.victims:
            self._values.push(removal.back)
            return None
        return removal

    def _evict_batch(self, budget: int, wal_room: int, protected: set[int]) -> tuple[Removal, bool]:
        """Up to `BATCH` removals in one index transaction, for what the store takes as
        measured inside that transaction. Returns them, settled (`Removal.release` is
        the caller's, outside the lock), and whether it ran out of candidates. The tree
        changes only once the transaction has committed."""
        # durable before its files are unlinked (a removal a power cut undid would
        # leave rows whose file is gone); refreshed under the write lock: what other
        # processes removed or added since the caller's look counts, and a leaf
        # another process extended meanwhile is seen to have children
        with self._catalog.transaction() as tx:
            used = self._used(wal_room)
            removal, exhausted = self._remove_leaves(tx.conn, budget, used, protected)
            tx.after(removal.settle)
            tx.undo(removal.abandon)
        return removal, exhausted

    def _remove_leaves(self, conn: object, budget: int, used: int, protected: set[int]) -> tuple[Removal, bool]:
        """Remove free leaves from the index, lowest value first, while ``used`` bytes
        exceed ``budget`` (at most `BATCH`), inside ``conn``'s transaction; the tree is
        read through the removals (a parent whose children all went is a candidate) and
        not changed. Returns the removal (for after the commit or the rollback) and
        whether no candidate was left."""
        catalog = self._catalog
        changes = TreeChanges()
        now = self._clock()
        seen: set[int] = set()
        aside: list[int] = []  # popped, not taken: back onto the heap afterwards
        grace: list[tuple[tuple[float, int], int, RadixNode]] = []  # heap: free but for the grace period
        victims: list[int] = []
        exhausted = False
        try:
            while used > budget and len(victims) < BATCH:
                node = self._next_candidate(changes, protected, now, seen, aside, grace)
                if node is None:
                    exhausted = True
                    break
                parent = changes.remove_leaf(catalog, conn, node)
                victims.append(node.id)
                if parent is not None:
                    self._values.push((parent.id,))  # a candidate of this batch already
                rec = changes.drop_file_if_unreferenced(catalog, conn, node.file_id)
                if rec is not None:
                    used -= rec.file_bytes
        except BaseException:  # (the transaction rolls back)
            Removal(self, changes, aside + [item[1] for item in grace]).abandon()
            raise
        return Removal(self, changes, aside + [item[1] for item in grace]), exhausted

    def _next_candidate(
        self, changes: TreeChanges, protected: set[int], now: float, seen: set[int], aside: list[int],
        grace: list[tuple[tuple[float, int], int, RadixNode]],
    ) -> RadixNode | None:
        """The free leaf (once ``changes`` commit) with the lowest value; when the heap has
        none left, the lowest one held only by its grace period; ``None`` when nothing
        can go."""
        tree = self._catalog.tree
        while True:
            node_id = self._values.pop()
            if node_id is None:
                return heapq.heappop(grace)[2] if grace else None
            node = tree.get(node_id)
            if node_id in seen or node is None or node.parent is None or not changes.is_leaf(node):
                continue  # a duplicate, or no longer a leaf of the tree
            seen.add(node_id)
            if node_id in protected:
                aside.append(node_id)
                continue
            state = self._leases.protection(node.file_id, now)
            if state == LEASED:
                aside.append(node_id)
            elif state == GRACE:
                heapq.heappush(grace, (self._values.sort_key(node_id), node_id, node))
            else:
                return node


class Removal:
    """Leaves (and the files only they used) removed in an index transaction: applied to
    the tree after its commit (`settle`), or handed back to the eviction order after its
    rollback (`abandon`)."""

    def __init__(self, gc: StoreGC, changes: TreeChanges, back: list[int]) -> None:
        self.gc, self.changes, self.back = gc, changes, back
        self.victims = [node.id for node in changes.removed]
        self.dropped = changes.dropped

    def settle(self) -> None:
        """Under the catalog lock, once the transaction has committed and the tree
        follows it (`Catalog.transaction`: the leaves and files are out of the tree and
        the file table, the files no lease holds forgotten): forget the leaves' values,
        put the candidates passed over back on the heap."""
        gc = self.gc
        gc._values.forget(self.victims)
        # a node passed over may have been split by the write meanwhile: its id is gone
        gc._values.push([n for n in self.back if gc._catalog.tree.get(n) is not None])

    def abandon(self) -> None:
        """Under the catalog lock, after the transaction rolled back: nothing changed in the
        tree; the leaves taken and the candidates passed over go back on the heap."""
        tree = self.gc._catalog.tree
        self.gc._values.push([n for n in self.victims + self.back if tree.get(n) is not None])

    @property
    def freed(self) -> int:
        """Bytes the dropped files take on disk."""
        return sum(rec.file_bytes for rec in self.dropped)

    def release(self) -> None:
        """Outside the lock: unlink the files (once no request leases them), count."""
        for rec in self.dropped:
            self.gc._leases.defer_unlink(rec.id, rec.name)
        c = self.gc.counters
        c.prefixes_evicted += len(self.victims)
        c.files_evicted += len(self.dropped)
        c.disk_bytes_evicted += self.freed


def block_keys(records: Iterable[FileRecord]) -> Iterator[BlockKey]:
    """Every block key (K/V and probe, every layer) of the files ``records``."""
    for rec in records:
        for kind in (KV, PROBE):
            for layer in range(rec.layers):
                for block in range(rec.blocks):
                    yield (rec.id, kind, layer, block)


def drop_blocks(tiers: TierManager, file_ids: set[int], records: dict[int, FileRecord]) -> None:
    """Forget the blocks of deleted files in the memory tiers: by key for files whose
    shape ``records`` gives (cost per block of those files), by a search of every block
    the tiers know for the others (files another process deleted)."""
    tiers.drop_many(block_keys(records.values()))
    unknown = file_ids - set(records)
    if unknown:
        tiers.drop_where(lambda key: key[0] in unknown)


#: most of the budget the WAL gets: above what SQLite's own checkpoints (every 1,000
#: pages, ~4 MiB, in a write's commit) let it reach, so a large store at its budget
#: checkpoints as often as below it (with 1 MiB, four times as often, each an fsync of
#: the index inside a write's eviction)
WAL_ROOM = 8 * WAL_LIMIT


def wal_bound(budget: int) -> int:
    """Size past which the disk budget checkpoints and truncates the index's WAL: 1/16
    of the budget, between 64 KiB and `WAL_ROOM` (8 MiB)."""
    return max(64 << 10, min(WAL_ROOM, budget // 16))
