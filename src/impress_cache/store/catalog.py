"""The store's metadata room: the radix tree, the SQLite index and the open-file table.

The tree, the file table and the open files change under one lock (`Catalog.lock`),
which the rest of the store takes only for a few operations at a time. The tree in
memory mirrors the index and changes only after the index transaction that records the
change has committed: every write is one `Catalog.transaction` (the index's write lock,
then this lock to plan; the lock let go for the ``COMMIT``; taken again to apply). When
another process commits to the index, `refresh` applies what the index's change log
says changed (`index.changelog`; the whole tree is reloaded only when the log cannot
tell) and forgets what this process knew about files that are gone (``on_forget`` lets
the memory tiers drop their blocks).

Chunk files are opened relative to the ``chunks/`` directory's descriptor, never through
a symbolic link, and only if they are regular files; a file's name must be one the store
writes (32 hex digits and a format suffix).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Container, Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol, TypeVar

import numpy as np

from ..index.changelog import ChangeSet, apply_changes
from ..index.radix import Match, RadixNode, RadixTree, as_tokens
from ..index.locks import CATALOG, OrderedLock
from ..index.files import FileRecord, FileTable, NewFile
from ..index.sqlite import Index
from .changes import TreeChanges
from .chunkfiles import FILE_NAME, Loan, OpenFile, OpenFiles
from .directory import CreationGate

_T = TypeVar("_T")
log = logging.getLogger(__name__)

CHUNK_DIR = "chunks"
#: `Catalog.disk_bytes` calls between two measurements of the index file and directories
_REMEASURE = 32


class Companions(Protocol):
    """Files kept beside chunk files (see `Catalog.companions`)."""

    def drop(self, name: str) -> None: ...

    def disk_bytes(self) -> int: ...


def _later(ids: Callable[[], list[int]]) -> Iterator[int]:
    yield from ids()


class Tx:
    """One write transaction of the catalog (`Catalog.transaction`): its connection, and
    what to run under the catalog's lock once it has committed and the tree follows it
    (`after`), or once it has rolled back (`undo`)."""

    __slots__ = ("conn", "_after", "_undo")

    def __init__(self, conn: Any) -> None:
        self.conn = conn
        self._after: list[Callable[[], None]] = []
        self._undo: list[Callable[[], None]] = []

    def after(self, fn: Callable[[], None]) -> None:
        self._after.append(fn)

    def undo(self, fn: Callable[[], None]) -> None:
        self._undo.append(fn)


def _dir_blocks(path: Path) -> int:
    try:
        return os.stat(path).st_blocks * 512
    except OSError:
        return 0


class Catalog:
    """Radix tree + index + file table of one store directory."""

    def __init__(
        self,
        root: Path,
        index: Index,
        row_bytes: tuple[int, int],
        on_forget: Callable[[set[int], dict[int, FileRecord]], None],
        on_split: Callable[[int, tuple[int, ...], int], None] = lambda old, new, k: None,
        on_leaves: Callable[[Iterable[int], bool, Iterable[int]], None] = lambda ids, reset, removed: None,
    ) -> None:
        self.root = root
        self.chunks = root / CHUNK_DIR
        self.index = index
        self.lock = OrderedLock(CATALOG, "catalog")
        self._row_bytes = row_bytes
        self._on_forget = on_forget
        self._on_split = on_split
        #: told the ids of nodes that may have become leaves (``reset``: the tree was
        #: reloaded and these are all its leaves) and of nodes another process removed
        self._on_leaves = on_leaves
        #: `refresh` calls (each a look at the index's data version), for tests and tuning
        self.refreshes = 0
        #: steps after a committed transaction that failed (`after_commit_failed`)
        self.after_commit_failures = 0
        #: other processes' commits followed through the change log (`catch_up`), and
        #: whole-tree reloads instead (the log trimmed past this tree's position, or absent)
        self.log_applied = 0
        self.log_reloads = 0
        #: the change log's entry the tree follows (`Index.changes_since`)
        self._log_seq: int | None = None
        #: the tree may not follow the index (a reload after a failure failed too)
        self._stale = False
        #: bytes of the index file, its shared-memory file and the directories, as last
        #: measured (`disk_bytes`), and how often they were used since
        self._fixed: int | None = None
        self._fixed_uses = 0
        self.chunks_fd = os.open(self.chunks, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        #: the chunk files this process has looked up
        self.files = OpenFiles(self.lock, index, self.chunks, self.chunks_fd, row_bytes, lambda: self.records)
        #: held (shared) from before a chunk file is created until it is committed or removed
        self.gate = CreationGate(root, 0 if index.read_only else os.stat(index.path).st_mode & 0o777, index.read_only)
        self.tree: RadixTree
        #: the indexed files' records by id (compact columns, records made when asked for)
        self.records = FileTable()
        #: files kept beside some chunk files (the remote tier's sidecars): removed with
        #: their chunk file (`unlink`) and counted in `disk_bytes`
        self.companions: Companions | None = None
        #: ``(conn, budget, adding, keep) -> removal or None``: the disk budget inside a
        #: write's transaction (`StoreGC.evict_within`); the removal's ``settle`` applies
        #: it after the commit, its ``abandon`` after a rollback
        self.evictor: Callable[[object, int, int, set[int]], Any] | None = None
        #: the ids of the files a lease of this process holds: see `_forget_dropped`
        self.held: Callable[[], Container[int]] = frozenset
        self._forget_later: dict[int, FileRecord] = {}
        #: names of chunk files being moved to quarantine (`StoreGC.quarantine`): out of the
        #: index once its removal commits, but not leftovers to delete (`leftovers._scan`)
        self.moving_aside: set[str] = set()
        self._load()

    @property
    def chunk_bytes(self) -> int:
        """Bytes the indexed chunk files take on disk (sum of their records' ``file_bytes``)."""
        return self.records.file_bytes

    def _load(self) -> None:
        self.tree, self.records = self.index.load_tree()
        self._log_seq = self.tree.log_seq
        # a generator: only a store that keeps an eviction order lists the leaves
        self._on_leaves(_later(self.tree.leaf_ids), True, ())

    def _add_record(self, record: FileRecord) -> None:
        self.records[record.id] = record

    def _drop_record(self, file_id: int) -> FileRecord | None:
        return self.records.pop(file_id, None)

    def close(self) -> None:
        with self.lock:
            self.files.drop(self.files.ids())
            os.close(self.chunks_fd)
            self.gate.close()

    # -- tree ------------------------------------------------------------------------
    def match(self, tokens: Sequence[int] | np.ndarray, limit: int | None = None) -> Match:
        """The tree's longest match, after a look at other processes' commits that does
        not wait for this process's writer or checkpoint (a change committed meanwhile
        is seen by the next match, as one committed just after this one would be)."""
        with self.lock:
            self.refresh()
            return self.tree.match(tokens, limit)

    def refresh(self) -> None:
        """Follow the index if it changed (`Index.changed_elsewhere`, through the read
        connection: never a wait for this process's writes): `catch_up`, or a reload of
        a tree left stale."""
        with self.lock:
            self.refreshes += 1
            if self._forget_later:
                _forget_dropped(self, list(self._forget_later.values()))
            if self._stale:
                self.reload_tree()
            elif self.index.changed_elsewhere():
                self.catch_up()

    def catch_up(self, counted: bool = True) -> None:
        """Apply the change log's entries since the tree's position (every process's
        commits, this one's included: applying those again changes nothing); reload the
        whole tree when the log cannot tell (trimmed past the position, or no log) or
        its changes do not fit the tree. The log is read through the index's read
        connection, which never waits for this process's writes. A failure
        leaves the tree stale: the next `refresh` reloads it. ``counted``: a look after
        another process's commit (``log_applied``), not after this process's own."""
        with self.lock:
            try:
                self._catch_up(counted)
            except BaseException:
                self._stale = True
                raise

    def _catch_up(self, counted: bool) -> None:
        with self.lock:
            changes = self.index.changes_since(self._log_seq)
            if changes is None:
                self.log_reloads += 1
                self.reload_tree()
            else:
                self._follow(changes, counted)

    def _follow(self, changes: ChangeSet, counted: bool) -> None:
        """Apply a change set read from the log after the tree's position (`_catch_up`,
        or a write's own, read before its ``COMMIT``: `transaction`). A node the set
        shows split in two or rewritten (`Applied.successors`) hands its statistics
        to its successors (``on_split``) before removed nodes' statistics go, whichever thread applies it."""
        with self.lock:
            if not changes:
                self._log_seq = changes.seq
                return
            try:
                applied = apply_changes(self.tree, self.records, changes)
            except ValueError as exc:
                log.warning("the index's change log does not fit the tree (%s); reloading it", exc)
                self.log_reloads += 1
                self.reload_tree()
                return
            self._log_seq = changes.seq
            self.log_applied += counted
            for old, new_ids, k in applied.successors:
                self._on_split(old, new_ids, k)
            self._on_leaves(applied.leaves, False, applied.removed)
            _forget_dropped(self, applied.dropped)

    @contextmanager
    def transaction(self, durable: bool = True) -> Iterator[Tx]:
        """A write transaction planned from a tree that follows the index, and the tree
        brought in line with it after its ``COMMIT``.

        Taken without the catalog's lock (the lock order: the index's write lock, rank
        `INDEX`, before the catalog's, `CATALOG`; enforced). In order: the index's write
        lock (no other thread of this process writes until this one's changes are in the
        tree), ``BEGIN IMMEDIATE`` (no other process commits), the catalog's lock and a
        `refresh`; the body plans from the tree and writes through ``tx.conn`` (the tree
        itself is not changed); the change log after the tree's position is read inside
        the transaction (this commit's entries; nobody else can commit now); the
        catalog's lock is let go for the ``COMMIT``, which waits for the disk (requests
        match the tree as it was meanwhile); then, with it taken again, the tree follows
        that change set without a look at the index, and ``tx.after`` callbacks run.

        An exception before the ``COMMIT`` has returned rolls back, leaves the tree
        untouched and runs ``tx.undo`` callbacks. A failure after it (the tree update, a
        callback) never undoes the commit: `after_commit_failed` logs and counts it and
        reloads the tree, and the callbacks after it still run."""
        with self.index.writing():
            tx: Tx | None = None
            try:
                with self.index.transaction(durable) as conn:
                    with self.lock:
                        self.refresh()
                        tx = Tx(conn)
                        yield tx
                        start = self._log_seq
                        pending = self.index.changes_since(start, conn=conn)
            except BaseException:
                if tx is not None and tx._undo:
                    with self.lock:
                        for fn in tx._undo:
                            fn()
                raise
            steps = [("the tree update", lambda: self._take_committed(start, pending))]
            steps += [("a step", fn) for fn in tx._after]
            with self.lock:  # (each step even if one before it failed: the commit stands)
                for step, fn in steps:
                    try:
                        fn()
                    except BaseException as exc:
                        self.after_commit_failed(f"{step} after a committed transaction", exc)
                        if not isinstance(exc, Exception):
                            raise

    def _take_committed(self, start: int | None, pending: ChangeSet | None) -> None:
        """After a ``COMMIT``, under the lock: the tree becomes what the index held right
        before it (``pending``, the log after ``start`` as read inside the transaction).
        Nothing to do when another thread followed the log past this commit meanwhile;
        the index is read only when the log could not tell or the tree is stale."""
        if self._stale:
            self.reload_tree()
        elif pending is not None and self._log_seq == start:
            self._follow(pending, counted=False)
        elif pending is None or self._log_seq is None or self._log_seq < pending.seq:
            self.catch_up(counted=False)

    #: whether the tree may not follow the index (the next `refresh` reloads it)
    stale = property(lambda self: self._stale)

    def mark_stale(self) -> None:
        """The tree may not follow the index: the next `refresh` reloads it."""
        with self.lock:
            self._stale = True

    def reload_tree(self) -> None:
        """Rebuild the tree from the index; forget files that are gone."""
        with self.lock:
            self._stale = True  # until the load succeeds (the next refresh tries again)
            self._load()
            self._stale = False
            self.forget({fid for fid in self.files.ids() if fid not in self.records})

    def commit_prompt(
        self, tokens: Sequence[int] | np.ndarray, matched: int, new_file: NewFile, budget: int | None = None
    ) -> tuple[int, RadixNode | None] | None:
        """Index a stored prompt in one transaction, then update the tree.

        ``new_file`` holds the prompt's rows from position ``matched`` on. The prompt is
        matched again inside the transaction (whose tree follows the index under its
        write lock) and only what is still missing is indexed: rows another writer
        stored meanwhile are taken from its file, not this one. Returns ``(file_id,
        leaf)`` when the file was committed, ``None`` when it is not needed (the whole
        prompt is stored meanwhile) or cannot be used (part of the prefix it extends
        was removed meanwhile); the caller then removes it with `discard`. With a disk
        ``budget`` and an `evictor`, the same transaction removes what the new file
        needs room for. The index's own triggers (`schema.INVARIANTS`) refuse a plan
        that would point a node outside an indexed file: `IndexRefusedError`, nothing
        committed.

        The tree and the file table change only once the transaction has committed
        (`transaction`: the change log read right before the ``COMMIT``, this commit and
        the budget's removals with it, is applied after it). An exception means nothing
        was committed and the tree was not touched. Once the transaction has committed, a
        step after it that fails (the tree update, the removals' bookkeeping) is
        logged and counted, and the tree is reloaded from the index (`after_commit_failed`):
        the prompt stays stored.
        """
        arr = as_tokens(tokens)
        with self.transaction() as tx:
            planned = self._index_prompt(tx.conn, arr, matched, new_file, budget)
            if planned is None:
                return None
            file_id, leaf_id, removal = planned
            if removal is not None:  # (the budget's removals: settled after the new leaf, they may be below it)
                tx.after(removal.settle)
                tx.undo(removal.abandon)
        if removal is not None:
            try:
                removal.release()
            except Exception as exc:  # noqa: BLE001 - the removed files stay as orphans
                self.after_commit_failed("unlinking files the disk budget removed", exc, reload=False)
        with self.lock:
            return file_id, self.tree.get(leaf_id)

    def after_commit_failed(self, step: str, exc: BaseException, reload: bool = True) -> None:
        """A step after a committed transaction failed: log and count it and bring the
        tree back in line with the index (reloaded now, or at the next `refresh` if the
        reload fails too). Never removes anything the index holds."""
        self.after_commit_failures += 1
        log.warning("%s failed after its index transaction committed (kept; the tree follows the index): %r", step, exc)
        if not reload:
            return
        self._stale = True
        try:
            self.reload_tree()
        except Exception as again:  # noqa: BLE001 - reloaded at the next refresh
            log.warning("reloading the tree failed as well (retried at the next look at the index): %r", again)

    def _index_prompt(
        self, conn: Any, arr: np.ndarray, matched: int, new_file: NewFile, budget: int | None
    ) -> tuple[int, int, Any] | None:
        """`commit_prompt`'s statements inside ``conn``'s transaction; returns the new
        file's id, the new leaf's id and the budget's removal (or ``None``), or ``None``
        when there is nothing to commit."""
        now_m = self.tree.match(arr).length  # what the index holds now, under its write lock
        if now_m == len(arr):
            return None  # stored meanwhile by another writer: nothing is missing
        if now_m < matched:
            log.warning("prefix changed while writing; dropping a %d-token write", len(arr) - matched)
            return None  # part of the prefix this file extends was removed meanwhile
        file_id = self.index.add_file(conn, new_file)
        plan = self.tree.plan_insert(arr, file_id, now_m - matched, as_tokens(new_file.tokens))
        parent_id = plan.parent.id
        if plan.split is not None:  # (children moved before their old parent goes: schema.INVARIANTS)
            old, k = plan.split
            assert old.parent is not None
            upper = self.index.add_node(conn, old.parent.id, old.file_id, old.file_row, k, 0)
            lower = self.index.add_node(conn, upper, old.file_id, old.file_row + k, len(old.tokens) - k, old.terminal)
            self.index.reparent(conn, old.id, lower)
            self.index.delete_node(conn, old.id)
            parent_id = upper  # (its statistics go to both halves when the tree follows: `_follow`)
        assert plan.leaf is not None  # (the prompt is longer than its match)
        leaf_tokens, _, row = plan.leaf
        leaf_id = self.index.add_node(conn, parent_id, file_id, row, len(leaf_tokens), 1)
        removal = None
        if budget is not None and self.evictor is not None:
            keep = {plan.parent.id} | ({plan.split[0].id} if plan.split is not None else set())
            removal = self.evictor(conn, budget, int(new_file.file_bytes), keep)
        return file_id, leaf_id, removal

    def replace_node(
        self, node: RadixNode, new_file: NewFile
    ) -> tuple[int, RadixNode | None, list[FileRecord]] | None:
        """Point ``node`` at ``new_file`` (its rows rewritten) in one index transaction,
        then in the tree: a new node takes its place, its children and its count of
        stored sequences. Returns ``(file_id, new node, dropped files)`` (the files no
        node references any more: the caller unlinks them when no lease holds them), or
        ``None`` when ``node`` is no longer in the tree as it was (split, removed or
        replaced meanwhile, by this or another process); the caller then deletes the
        new file (`discard`). An exception means nothing was committed; a failure of the
        tree update after the commit is handled as in `commit_prompt` (the new node is
        then the reloaded tree's, or ``None`` if that reload failed too and waits for the
        next refresh; the dropped files are still returned)."""
        with self.transaction() as tx:
            staged = self._index_replacement(tx.conn, node, new_file)
            if staged is None:
                return None
        new_id, file_id, dropped = staged
        with self.lock:
            return file_id, self.tree.get(new_id), dropped

    def _index_replacement(self, conn: Any, node: RadixNode, new_file: NewFile) -> tuple[int, int, list[FileRecord]] | None:
        current = self.tree.get(node.id)
        if (
            current is None or current.parent is None or current.file_id != node.file_id
            or current.file_row != node.file_row or len(current.tokens) != len(node.tokens)
        ):
            return None
        node = current  # the same node, perhaps reloaded from the index
        file_id = self.index.add_file(conn, new_file)
        new_id = self.index.add_node(conn, node.parent.id, file_id, 0, len(node.tokens), node.terminal)
        self.index.reparent(conn, node.id, new_id)
        self.index.delete_node(conn, node.id)
        changes = TreeChanges()  # (only the old file can go; ``node`` itself is replaced, not removed)
        changes.drop_file_if_unreferenced(self, conn, node.file_id)
        return new_id, file_id, changes.dropped

    # -- files -----------------------------------------------------------------------
    def open_file(self, file_id: int) -> OpenFile:
        """The block table of a file (`OpenFiles.get`)."""
        return self.files.get(file_id)

    def lend(self, f: OpenFile, direct: bool = False) -> Loan | None:
        """A chunk file's descriptors for one reader, open until it releases them
        (`OpenFiles.lend`; ``direct``: its ``O_DIRECT`` one as well)."""
        return self.files.lend(f, direct)

    def perm_of(self, file_id: int) -> np.ndarray | None:
        """The row permutation of a reordered file (``None``: rows in prompt order)."""
        record = self.records.get(file_id)
        if record is not None and not record.reordered:
            return None
        return self.open_file(file_id).perm

    def chunk_tokens_of(self, file_id: int) -> int:
        record = self.records.get(file_id)
        return record.chunk_tokens if record is not None else self.open_file(file_id).record.chunk_tokens

    def forget(self, file_ids: Iterable[int], records: Iterable[FileRecord] = ()) -> None:
        """Drop everything this process knows about files (deleted or replaced);
        ``records`` (of some of them) tell ``on_forget`` their shapes, so it can name
        their blocks instead of searching for them."""
        ids = set(file_ids)
        if not ids:
            return
        with self.lock:
            for fid in ids:
                self._forget_later.pop(fid, None)
            self.files.drop(ids)
            self._on_forget(ids, {r.id: r for r in records if r.id in ids})

    def indexed(self, file_ids: Iterable[int]) -> bool:
        """Whether every file of ``file_ids`` is in the index now (one look at other
        processes' commits for all of them that, like `match`'s, does not wait for this
        process's writer: this process's removals are known at once, before they commit)."""
        with self.lock:
            self.refresh()
            return all(fid in self.records for fid in file_ids)

    def disk_bytes(self, wal: int | None = None) -> int:
        """What the store puts on disk: its chunk files, its index (with WAL), the two
        directories' own blocks and the companions, all measured now. With ``wal`` (the
        WAL's size, as the disk budget has just read it), the index file, its
        shared-memory file and the directories are taken as last measured: re-measured
        every `_REMEASURE` calls and after `remeasure` (a checkpoint changes the index
        file), so a write at the budget costs one ``stat``, not five."""
        side = self.companions.disk_bytes() if self.companions is not None else 0
        if wal is None or self._fixed is None or self._fixed_uses >= _REMEASURE:
            dirs = os.fstat(self.chunks_fd).st_blocks * 512 + _dir_blocks(self.root)
            self._fixed = dirs + self.index.footprint(wal=False)
            self._fixed_uses = 0
            if wal is None:
                return self.chunk_bytes + self._fixed + self.index.footprint(main=False) + side
        self._fixed_uses += 1
        return self.chunk_bytes + self._fixed + wal + side

    def remeasure(self) -> None:
        """Measure the index file and the directories again at the next `disk_bytes`."""
        self._fixed = None

    def commit_or_discard(self, name: str, commit: Callable[[], _T | None]) -> _T | None:
        """``commit()`` (`commit_prompt` or `replace_node` of the new file ``name``) and the
        new file removed (`discard`) if it raised (nothing was committed) or returned
        ``None`` (not needed); returns what it returned."""
        try:
            done = commit()
        except BaseException:
            self.discard(name)
            raise
        if done is None:
            self.discard(name)
        return done

    def discard(self, name: str) -> None:
        """Remove a new chunk file the index did not take (its commit failed or was not
        needed). A file the index holds is never removed: its name is looked up in the
        index first, and when the index cannot answer the file stays (an unindexed file
        is removed when the store is next opened)."""
        try:
            held = self.index.has_file(name)
        except Exception as exc:  # noqa: BLE001 - kept: the next open removes it if unindexed
            log.warning("keeping %s: the index cannot say whether it holds it (%r)", name, exc)
            return
        if held:
            log.warning("keeping %s: the index holds it", name)
            return
        self.unlink(name)

    def unlink(self, name: str) -> None:
        """Remove a chunk file the store wrote (by name, relative to ``chunks/``)."""
        if FILE_NAME.match(name) or (name.endswith(".tmp") and FILE_NAME.match(name[:-4])):
            if self.companions is not None:  # first: a file re-created under the name keeps its own
                self.companions.drop(name)
            try:
                os.unlink(name, dir_fd=self.chunks_fd)
            except FileNotFoundError:
                pass


def _forget_dropped(cat: Catalog, dropped: list[FileRecord]) -> None:
    """Forget files the index dropped (descriptors closed, blocks dropped), except those
    a lease of this process holds (``cat.held``): a request that leased one before a
    rewrite or a removal keeps reading it. Those are forgotten by a later `refresh` that
    finds them free, or by whoever defers their unlink to the last lease (a rewrite:
    `Reordering._replaced`)."""
    if not dropped:
        return
    with cat.lock:
        held = cat.held()
        cat._forget_later.update((rec.id, rec) for rec in dropped if rec.id in held)
        now = [rec for rec in dropped if rec.id not in held]
        cat.forget({r.id for r in now}, now)
