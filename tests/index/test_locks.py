"""The store's lock order is enforced (issue 25): `OrderedLock` under
``IMPRESS_CACHE_CHECK_LOCKS=1`` (set by tests/conftest.py) raises on a lock taken while a
higher-ranked one is held, and is a plain lock without it."""

from __future__ import annotations

import threading

import pytest

from impress_cache.index import locks
from impress_cache.index.locks import CATALOG, INDEX, LEAF, STATISTICS, LockOrderError, OrderedLock


def test_checks_are_on_in_the_test_suite():
    assert locks.checking()
    assert isinstance(OrderedLock(CATALOG, "catalog"), OrderedLock)


def test_a_lock_taken_in_increasing_rank_works_and_the_reverse_raises():
    index, stats, catalog = OrderedLock(INDEX, "index"), OrderedLock(STATISTICS, "stats"), OrderedLock(CATALOG, "catalog")
    with index, catalog, stats:
        assert catalog.locked()
    with catalog:
        with pytest.raises(LockOrderError, match="index .* while holding catalog"):
            index.acquire()
    with stats:
        with pytest.raises(LockOrderError):
            catalog.acquire()
    assert not index.locked() and not catalog.locked()
    with index:  # (the refused acquires left nothing held)
        with catalog:
            pass


def test_equal_ranks_and_locks_of_other_threads_do_not_count():
    a, b = OrderedLock(STATISTICS, "a", reentrant=False), OrderedLock(STATISTICS, "b", reentrant=False)
    with a, b:
        pass
    with b, a:
        pass
    index, catalog = OrderedLock(INDEX, "index"), OrderedLock(CATALOG, "catalog")
    taken = threading.Event()
    done = threading.Event()

    def hold():
        with index:
            taken.set()
            done.wait(10)

    t = threading.Thread(target=hold)
    t.start()
    assert taken.wait(10)
    with catalog:  # another thread's index lock is not this thread's
        pass
    done.set()
    t.join(10)


def test_a_reentrant_lock_is_taken_again_even_above_its_rank():
    index, catalog = OrderedLock(INDEX, "index"), OrderedLock(CATALOG, "catalog")
    with index:
        with catalog:
            with index:  # already held by this thread: no new order
                assert index._count == 2
    assert not index.locked()


def test_a_plain_lock_taken_twice_raises_instead_of_deadlocking():
    leaf = OrderedLock(LEAF, "lease table", reentrant=False)
    with leaf:
        with pytest.raises(LockOrderError, match="twice"):
            leaf.acquire()


def test_a_condition_over_an_ordered_lock_waits_and_keeps_the_order():
    index, catalog = OrderedLock(INDEX, "index"), OrderedLock(CATALOG, "catalog")
    cond = threading.Condition(index)
    flag = []

    def later():
        with cond:
            flag.append(1)
            cond.notify_all()

    with index:
        with index:  # (held twice: the wait lets both go)
            threading.Thread(target=later).start()
            assert cond.wait_for(lambda: flag, timeout=10)
            assert index._count == 2
            with catalog:
                pass
    assert not index.locked()


def test_without_the_variable_it_is_a_plain_lock(monkeypatch):
    monkeypatch.delenv(locks.CHECK_ENV)
    lock = OrderedLock(CATALOG, "catalog")
    assert type(lock) is type(threading.RLock())
    assert type(OrderedLock(LEAF, "leaf", reentrant=False)) is type(threading.Lock())
