"""Statistics saved in the index and read back: when the deferred ones are read, what a
failed read does, and which saved rows are skipped as impossible.

Saved statistics only order things (evictions, tier placement, rewrites); no K/V depends
on them. So reading them never fails a request and never delays opening a store:

- `DeferredLoad`: the node values (`NodeValues`) and the row importance
  (`ImportanceStats`) are read after the store opened, on the writer thread or by the
  first call that needs them, whichever comes first.
- `possible_rows` and `possible_importance`: a saved row with an impossible value (a
  negative count, a share outside ``[0, 1]``, a value that is not a finite number,
  scores of the wrong shape...) is skipped, and counted and logged once per load
  (`skip`); every other row is installed as saved.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ..errors import ImpressError, StoreIOError

log = logging.getLogger(__name__)

#: a saved count or sequence number must stay below this: it is saved again as a SQLite
#: integer (8 bytes), and later accesses count on from it
_INT_LIMIT = 2.0**62

#: the fields of a saved record of a block or a node (`Index.load_block_stats`; the
#: columns of `Index.load_node_stats`)
SAVED = ("count", "freq", "share", "age_s", "seq", "saved_at")


class DeferredLoad:
    """The saved statistics of one owner, read and installed once, at the first `load`.

    The owner calls `load` at the start of every method that reads or changes its
    statistics (never while it holds its own lock), and the writer thread calls it as one
    of its first jobs; the store calls `defer` while it opens, which reads nothing.

    Lock order (enforced: `index.locks`): ``guard`` (the catalog's lock, which an index
    transaction that changes the tree holds while it plans and while the tree follows
    its ``COMMIT``, not during it) is held around the read (through the index's read
    connection, or the caller's own transaction) and the install; the owner's ``lock``
    (ranked above both: a transaction's removals update the owner's values) around the
    install only. A thread inside such a transaction that calls in holds the guard
    already, and a thread that waits for the guard holds neither lock, so the two never
    wait for each other. A read that runs while a write's ``COMMIT`` is under way sees
    the index before it (a node that write splits still has its saved rows; read after
    the ``COMMIT``, they are gone with the node and its halves start without them). A
    caller that finds the statistics pending waits for the thread reading them; `pending`
    turns False only once ``install`` has returned, so a caller never sees half of them.

    What a failed read does (the one place that decides it): a `StoreIOError` (the index
    could not be read now: busy, interrupted, out of space...) keeps the read for the
    next call, up to `ATTEMPTS` failed reads (then the owner starts without them); any
    other `ImpressError` (what was saved cannot be decoded) gives up at once. Both are
    logged, not raised, except a failed read by a thread inside an index transaction
    (SQLite may have rolled that transaction back: its owner must know). Anything else
    is a bug: logged with its traceback, and the owner goes on with what was installed
    (statistics only order things), instead of failing every later call.
    """

    #: failed reads (`StoreIOError`) after which the owner starts without the statistics
    ATTEMPTS = 5

    def __init__(self, what: str, lock: Any, install: Callable[[Any], Any]) -> None:
        #: what the statistics are, for the log ("statistics of the stored prefixes")
        self.what = what
        self._lock = lock
        #: installs what the read returned (called under the owner's lock)
        self._install = install
        self._read: Callable[[], Any] | None = None
        self._guard: Any = None
        self._in_transaction: Callable[[], bool] = lambda: False
        #: reads that failed so far
        self.failures = 0

    def defer(self, read: Callable[[], Any], guard: Any, in_transaction: Callable[[], bool] | None = None) -> None:
        """Read with ``read()`` at the first `load`, holding ``guard`` (see the class);
        ``in_transaction()`` says whether the calling thread is inside an index
        transaction (then a failed read is raised: SQLite may have rolled it back)."""
        with self._lock:
            self._read, self._guard = read, guard
            if in_transaction is not None:
                self._in_transaction = in_transaction

    @property
    def pending(self) -> bool:
        """Whether the saved statistics are still to be read (or to be read again)."""
        return self._read is not None

    def load(self) -> None:
        """Read and install the saved statistics now if they are pending (not under the
        owner's lock)."""
        if self._read is None:
            return
        with self._guard:
            read = self._read
            if read is None:  # another thread installed them meanwhile
                return
            try:
                saved = read()
                with self._lock:
                    self._install(saved)
            except StoreIOError as exc:
                self.failures += 1
                if self._in_transaction():  # (the caller's transaction may be rolled back: it must know)
                    raise
                if self.failures < self.ATTEMPTS:
                    log.warning("reading the saved %s failed (%s); trying again at the next call that needs them", self.what, exc)
                    return
                log.warning("reading the saved %s failed %d times (%s); starting without them", self.what, self.failures, exc)
            except ImpressError as exc:
                log.warning("the saved %s are not usable (%s); starting without them", self.what, exc)
            except Exception:  # a bug: reported, and never again on every later call
                log.exception("installing the saved %s failed; starting without them", self.what)
            self._read = None


def possible_rows(cols: np.ndarray) -> np.ndarray:
    """Which saved records are possible: ``cols`` is ``float64 [n, 6]`` of the `SAVED`
    fields (a value that is not a number read as NaN); every value finite, count,
    frequency, age and sequence number not negative, count and sequence number below
    2**62 (they are saved again as integers), share within ``[0, 1]``. Checked a
    block of rows at a time (small temporaries)."""
    ok = np.empty(len(cols), bool)
    for k in range(0, len(cols), 4096):
        c = cols[k : k + 4096]
        good = np.isfinite(c).all(axis=1)
        good &= (c[:, [0, 1, 3, 4]] >= 0).all(axis=1) & (c[:, 2] <= 1.0) & (c[:, 2] >= 0.0)
        good &= (c[:, [0, 4]] < _INT_LIMIT).all(axis=1)  # (saved again as SQLite integers)
        ok[k : k + 4096] = good
    return ok


def possible_importance(record: tuple[Any, Any, Any, Any], layers: int) -> bool:
    """Whether a saved importance record (``scores, requests, pending, saved_at`` from
    `Index.load_importance`; ``scores`` None when its bytes did not decode) is possible
    for a store of ``layers`` layers."""
    scores, requests, pending, saved_at = record
    if scores is None or scores.ndim != 2 or scores.shape[0] != layers:
        return False
    numbers = (requests, pending, saved_at)
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in numbers):
        return False
    if requests < 0 or not 0 <= pending < _INT_LIMIT or pending != int(pending):
        return False
    with np.errstate(invalid="ignore"):
        return bool(np.isfinite(scores).all() and (scores >= 0).all())


def skip(what: str, ok: np.ndarray | Sequence[bool], keys: Sequence[Any]) -> int:
    """Log once the saved rows that ``ok`` marks impossible (``keys``: what each row
    belongs to); returns how many."""
    bad = np.flatnonzero(~np.asarray(ok, bool))
    if len(bad):
        log.warning(
            "%d of %d saved %s hold impossible values and were skipped (the first: %s); the others are installed",
            len(bad), len(keys), what, keys[int(bad[0])],
        )
    return len(bad)
