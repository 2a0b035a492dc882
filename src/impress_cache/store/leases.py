"""Leases: chunk files that the disk budget must not delete while requests read them.

A request leases the files its matched prefixes live in (`PrefixLease`) until it holds
every row it needs; a match also protects its files for a grace period (`MATCH_GRACE_S`
of the store's clock) that covers the moment between `ImpressStore.match` and
`ImpressStore.lease`. A lease is absolute; the grace period is a preference: the disk
budget takes a prefix still in its grace period only when every other candidate is gone
and the store is still over budget (under load every prefix may have been matched in the
last seconds, and the budget must hold). A request whose prefix went in that gap fails
to read it and recomputes (`CorruptBlockError`, then a new match). Leases are per file,
not per radix node: a node may be replaced by a split or removed from the tree while a
request reads it (the request keeps its segments, which stay valid), but its file is
unlinked only once no lease holds it (`defer_unlink`). Another process deleting a file
this one reads is harmless once the file is open: the open descriptor keeps its data
readable.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections import Counter, deque
from collections.abc import Callable, Iterable, Sequence

from ..index.locks import LEAF, OrderedLock
from ..index.radix import Match
from .activity import Activity

log = logging.getLogger(__name__)

#: seconds after a match during which the disk budget prefers to leave the matched files
#: alone (it takes them only when nothing else brings the store within its budget)
MATCH_GRACE_S = 5.0

#: seconds the unlink thread lets evicted files gather before it deletes them, and how
#: many wake it at once
UNLINK_EVERY_S = 0.05
BATCH_WAKE = 32
#: how often `Unlinker.drain` wakes the thread again while it waits
DRAIN_POLL_S = 0.05

#: what protects a file from the disk budget (`LeaseTable.protection`)
FREE, GRACE, LEASED = 0, 1, 2


class PrefixLease:
    """Protects the chunk files of matched prefixes from disk eviction until released.

    Returned by `ImpressStore.lease`. `release` (or garbage collection of the lease)
    drops the references; calling it twice is harmless.
    """

    def __init__(self, table: LeaseTable, file_ids: Sequence[int], request: bool = True) -> None:
        #: the files this lease holds (one reference each)
        self.file_ids = tuple(file_ids)
        #: a leased file had left the index before the lease was taken: match again
        self.stale = False
        self._table = weakref.ref(table)
        self._request = request
        # a lease dropped without `release` is handed back by garbage collection, which may
        # run inside any code of this thread, the lease table's locked sections included:
        # the finalizer takes no lock, it only queues the release (`LeaseTable.settle`)
        self._finalizer = weakref.finalize(self, _release_later, self._table, self.file_ids, request)

    @property
    def active(self) -> bool:
        """Whether the lease still holds its references."""
        return self._finalizer.alive

    def release(self) -> None:
        """Drop the references (idempotent)."""
        if self._finalizer.detach() is not None:
            table = self._table()
            if table is not None:
                table.release(self.file_ids, self._request)

    def __enter__(self) -> PrefixLease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _release_later(table_ref: Callable[[], LeaseTable | None], file_ids: tuple[int, ...], request: bool) -> None:
    """A garbage-collected lease's release, queued (no lock: see `PrefixLease`)."""
    table = table_ref()
    if table is not None:
        table.dropped.append((file_ids, request))  # (deque.append is atomic)


class Unlinker:
    """Deletes evicted chunk files on a thread of its own, so neither the writer nor a
    request waits for the file system (an unlink took ~7 ms on the project's machine).

    Names are handed over in a list; the thread takes what has gathered every
    `UNLINK_EVERY_S` seconds (or at once when `BATCH_WAKE` names wait), so a write at
    the disk budget does not wake it (and wait for the interpreter lock it takes) for
    every file. `drain` waits until every file handed over is gone (`ImpressStore.flush`)
    and raises the first failure since the last drain; while a caller drains, the thread
    deletes what it has at once instead of waiting for more to gather."""

    def __init__(self, unlink: Callable[[str], None]) -> None:
        self._unlink = unlink
        self._cv = threading.Condition()
        self._names: list[str] = []
        self._busy = False
        self._closed = False
        #: callers of `drain` waiting: the thread does not wait for more names to gather
        self._draining = 0
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None

    def __call__(self, name: str) -> None:
        with self._cv:
            if self._closed:
                self._unlink(name)  # shut down: delete it here
                return
            self._names.append(name)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="impress-unlink", daemon=True)
                self._thread.start()
            # the first name wakes the thread from its wait for work (it then lets more gather
            # for `UNLINK_EVERY_S`); `BATCH_WAKE` names cut that short. Woken by neither, the
            # thread slept until a drain or close, and evicted files stayed on disk meanwhile
            if len(self._names) == 1 or len(self._names) >= BATCH_WAKE:
                self._cv.notify_all()

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._names and not self._closed:
                    self._cv.wait()
                if not self._names and self._closed:
                    return
                if not (self._closed or self._draining) and len(self._names) < BATCH_WAKE:
                    self._cv.wait(UNLINK_EVERY_S)  # let a few gather (drain and close wake it)
                names, self._names = self._names, []
                self._busy = True
            for name in names:
                try:
                    self._unlink(name)
                except BaseException as exc:  # reported by drain
                    with self._cv:
                        self._error = self._error or exc
            with self._cv:
                self._busy = False
                self._cv.notify_all()

    def drain(self, report: bool = True) -> None:
        """Wait until every file handed over is gone; raise the first failure since the
        last drain (``report=False``: leave it for the next drain that reports)."""
        with self._cv:
            self._draining += 1
            try:
                while self._names or self._busy:
                    if self._names and not self._busy:  # (the thread sleeps: wake it; busy, it wakes us)
                        self._cv.notify_all()
                    self._cv.wait(DRAIN_POLL_S)
            finally:
                self._draining -= 1
            if not report:
                return
            error, self._error = self._error, None
        if error is not None:
            raise error

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join()
        with self._cv:  # anything handed over while closing
            names, self._names = self._names, []
            error, self._error = self._error, None
        if error is not None:  # (failed since the last drain: nobody would hear of it)
            log.warning("deleting an evicted chunk file failed (it stays until the store is next opened): %r", error)
        for name in names:
            self._unlink(name)


class LeaseTable:
    """Lease references and match grace periods of one store, by file."""

    def __init__(
        self,
        clock: Callable[[], float],
        unlink: Callable[[str], None],
        grace_s: float | None = None,
        activity: Activity | None = None,
        indexed: Callable[[Sequence[int]], bool] = lambda file_ids: True,
    ) -> None:
        self._clock = clock
        #: deletes files on a thread of its own (`drain` waits for it)
        self.unlinker = Unlinker(unlink)
        self._unlink = self.unlinker
        self._activity = activity
        #: whether all these files are in the index now (a lease of one that left it is
        #: `PrefixLease.stale`); one call per lease
        self._indexed = indexed
        #: grace period of a match, in seconds of ``clock`` (default `MATCH_GRACE_S`)
        self.grace_s = MATCH_GRACE_S if grace_s is None else grace_s
        self._lock = OrderedLock(LEAF, "lease table", reentrant=False)
        #: releases of leases that garbage collection dropped, applied by `settle`
        self.dropped: deque[tuple[tuple[int, ...], bool]] = deque()
        self._held: Counter[int] = Counter()
        self._matched_at: dict[int, float] = {}
        self._doomed: dict[int, tuple[str, Callable[[], None] | None]] = {}

    def settle(self) -> None:
        """Apply the releases of leases that garbage collection dropped (queued by their
        finalizers, which take no lock); every other method calls it first."""
        while self.dropped:
            try:
                file_ids, request = self.dropped.popleft()
            except IndexError:  # (another thread took the last one)
                return
            self.release(file_ids, request)

    def note(self, match: Match) -> None:
        """Start the grace period of a match's files."""
        self.settle()
        now = self._clock()
        with self._lock:
            if len(self._matched_at) > 4096:
                self._matched_at = {k: t for k, t in self._matched_at.items() if now - t < self.grace_s}
            for seg in match.segments:
                self._matched_at[seg.file_id] = now

    def protection(self, file_id: int, now: float) -> int:
        """``LEASED`` (a request holds it), ``GRACE`` (matched within the grace period,
        not leased) or ``FREE``."""
        self.settle()
        with self._lock:
            if self._held[file_id] > 0:
                return LEASED
            if now - self._matched_at.get(file_id, -float("inf")) < self.grace_s:
                return GRACE
            return FREE

    def held(self) -> dict[int, int]:
        self.settle()
        with self._lock:
            return {k: v for k, v in self._held.items() if v > 0}

    def lease(self, matches: Iterable[Match], request: bool = True) -> PrefixLease:
        """One reference on every file of every match. A ``request`` lease also counts as
        activity (background maintenance waits until no request holds one)."""
        lease = self.hold([seg.file_id for m in matches for seg in m.segments], request)
        # taken, the lease keeps every file that is still indexed; one that left the index
        # since the match (its node rewritten or evicted) cannot be opened any more
        lease.stale = not self._indexed(lease.file_ids)
        return lease

    def hold(self, file_ids: Sequence[int], request: bool = True) -> PrefixLease:
        """One reference on every file of ``file_ids``."""
        self.settle()
        with self._lock:
            self._held.update(file_ids)
        if request and self._activity is not None:
            self._activity.enter()
        return PrefixLease(self, file_ids, request)

    def release(self, file_ids: Iterable[int], request: bool = True) -> None:
        if request and self._activity is not None:
            self._activity.leave()
        due = []
        with self._lock:
            for fid in file_ids:
                self._held[fid] -= 1
                if self._held[fid] <= 0:
                    del self._held[fid]
                    if fid in self._doomed:
                        due.append(self._doomed.pop(fid))
        for name, before in due:
            self._drop(name, before)

    def deferred_names(self) -> set[str]:
        """Names of the files whose unlink waits for their last lease (`defer_unlink`)."""
        self.settle()
        with self._lock:
            return {name for name, _ in self._doomed.values()}

    def defer_unlink(self, file_id: int, name: str, before: Callable[[], None] | None = None) -> bool:
        """Unlink a file now, or when its last lease goes; True if it was deferred.
        ``before`` runs just before the unlink (e.g. closing this process's descriptor
        of the file, which a reader holding the lease may still be using)."""
        self.settle()
        with self._lock:
            if self._held[file_id] > 0:
                self._doomed[file_id] = (name, before)
                return True
            self._held.pop(file_id, None)
        self._drop(name, before)
        return False

    def _drop(self, name: str, before: Callable[[], None] | None) -> None:
        if before is not None:
            before()
        self._unlink(name)
