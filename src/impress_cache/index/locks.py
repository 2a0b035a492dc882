"""The store's lock order, enforced (docs: Concurrency).

Every lock of the store that is ever held while another is taken has a rank; a thread
takes locks in increasing rank only (equal ranks: in any order). `OrderedLock(rank,
name)` is that lock. With ``IMPRESS_CACHE_CHECK_LOCKS=1`` in the environment when the lock
is made (the test suite sets it), it checks the order on every acquire: taking a lock
while this thread holds one of a higher rank raises `LockOrderError` (and taking a
non-reentrant lock twice raises too, where it would deadlock). Without it, `OrderedLock`
returns a plain `threading.RLock` (or `threading.Lock`): no cost at all.

The ranks: `INDEX` (the SQLite write connection: held for a statement or a
transaction, and by a catalog transaction until the tree follows its ``COMMIT``) <
`CATALOG` (the tree, the file table, the open files: a write transaction takes it after
``BEGIN`` to plan, lets it go for the ``COMMIT`` and takes it again to apply) < `INDEX_READ` (the index's read connection, for the reads
requests make: held for one read) < `STATISTICS` (the node values and importance statistics:
a transaction's removals update them; their deferred load reads the index before it
takes them, `saved.DeferredLoad`) < `LEAF` (locks under which nothing else is taken:
the lease table, the dirty-block set, the open files' descriptors).
"""

from __future__ import annotations

import os
import threading
from typing import Any

INDEX = 10
CATALOG = 15
INDEX_READ = 22
STATISTICS = 25
LEAF = 40

#: the environment variable that turns the checks on
CHECK_ENV = "IMPRESS_CACHE_CHECK_LOCKS"


class LockOrderError(RuntimeError):
    """A lock was taken against the store's lock order (only with `CHECK_ENV` set)."""


def checking() -> bool:
    return os.environ.get(CHECK_ENV, "") not in ("", "0")


_held = threading.local()


def _stack() -> list[OrderedLock]:
    stack = getattr(_held, "stack", None)
    if stack is None:
        stack = _held.stack = []
    return stack


class OrderedLock:
    """A lock with a rank (see the module). Without checks, the constructor returns a
    plain `threading.RLock` (``reentrant``) or `threading.Lock`."""

    def __new__(cls, rank: int, name: str, reentrant: bool = True) -> Any:
        if not checking():
            return threading.RLock() if reentrant else threading.Lock()
        return super().__new__(cls)

    def __init__(self, rank: int, name: str, reentrant: bool = True) -> None:
        self.rank = rank
        self.name = name
        self.reentrant = reentrant
        self._inner = threading.RLock() if reentrant else threading.Lock()
        self._owner = 0
        self._count = 0

    def __repr__(self) -> str:
        return f"<OrderedLock {self.name} rank {self.rank}>"

    def _check(self) -> None:
        stack = _stack()
        if self._owner == threading.get_ident():
            if not self.reentrant:
                raise LockOrderError(f"{self.name} taken twice by one thread (it is not reentrant: a deadlock)")
            return
        above = [lock for lock in stack if lock.rank > self.rank]
        if above:
            raise LockOrderError(
                f"{self.name} (rank {self.rank}) taken while holding {above[-1].name} (rank {above[-1].rank}): "
                "the store's locks are taken in increasing rank (impress_cache.index.locks)"
            )

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        self._check()
        if not self._inner.acquire(blocking, timeout):
            return False
        self._owner = threading.get_ident()
        self._count += 1
        _stack().append(self)
        return True

    def release(self) -> None:
        stack = _stack()
        for i in range(len(stack) - 1, -1, -1):
            if stack[i] is self:
                del stack[i]
                break
        self._count -= 1
        if self._count == 0:
            self._owner = 0
        self._inner.release()

    __enter__ = acquire

    def __exit__(self, *exc: object) -> None:
        self.release()

    def locked(self) -> bool:
        return self._count > 0

    # -- what `threading.Condition` uses of a lock -------------------------------------
    def _is_owned(self) -> bool:
        return self._owner == threading.get_ident()

    def _release_save(self) -> tuple[Any, int]:
        count = self._count
        stack = _stack()
        stack[:] = [lock for lock in stack if lock is not self]
        self._count, self._owner = 0, 0
        inner = self._inner._release_save() if self.reentrant else self._inner.release()  # type: ignore[attr-defined]
        return inner, count

    def _acquire_restore(self, state: tuple[Any, int]) -> None:
        inner, count = state
        self._check()
        if self.reentrant:
            self._inner._acquire_restore(inner)  # type: ignore[attr-defined]
        else:
            self._inner.acquire()
        self._owner, self._count = threading.get_ident(), count
        _stack().extend([self] * count)
