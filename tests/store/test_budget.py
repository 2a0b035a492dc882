"""The disk budget counts what the store puts on disk (chunk files as the blocks they
take, the index, its WAL and shared-memory file, its directories) and holds within
budget + one prefix while threads and another process write and read at once."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

from impress_cache import ImpressStore
from impress_cache.store.leases import GRACE
from test_reorder import _model, cfg, kv_of, put

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT / "benchmarks") not in sys.path:
    sys.path.append(str(ROOT / "benchmarks"))
from disk_usage import du  # noqa: E402

SYSTEMS = [[3 + i] * 8 + list(range(10 + i, 18 + i)) for i in range(4)]


def prompts(seed: int, n: int) -> list[list[int]]:
    """``n`` prompts of 40-56 tokens: one of four system prompts and a distinct tail."""
    out = []
    for i in range(n):
        tail = [(seed * 7919 + i * 104729 + j * 31) % 200 + 30 for j in range(24 + (i % 3) * 8)]
        out.append(SYSTEMS[(seed + i) % 4] + tail)
    return out


_CHILD = """
import sys
sys.path[:0] = {paths!r}
from impress_cache import ImpressStore
from test_reorder import _model, cfg, put
from test_budget import prompts
with ImpressStore({store!r}, _model(), cfg(disk_bytes={budget})) as store:
    for toks in prompts(99, {n}):
        put(store, toks)
"""


def test_budget_counts_what_is_on_disk(tmp_path):
    with ImpressStore(tmp_path, _model(), cfg()) as store:
        for toks in prompts(1, 6):
            put(store, toks)
        store.flush()
        assert store.disk_bytes() == du(tmp_path)
        store.index.checkpoint()
        assert store.disk_bytes() == du(tmp_path)


def test_budget_holds_under_concurrent_writers_and_readers(tmp_path):
    with ImpressStore(tmp_path, _model(), cfg()) as probe:
        put(probe, prompts(0, 1)[0])
        prefix = probe._catalog.chunk_bytes  # one stored prompt (the largest kind)
        base = probe.disk_bytes()
    budget = base + 12 * prefix
    n = 24
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD.format(
            paths=[str(ROOT / "src"), str(ROOT / "tests"), str(ROOT / "tests" / "store")],
            store=str(tmp_path), budget=budget, n=n,
        )],
    )
    frozen = 1000.0  # the store's clock stands still: a prefix once matched stays in its grace period
    with ImpressStore(tmp_path, _model(), cfg(disk_bytes=budget), clock=lambda: frozen) as store:
        stop = threading.Event()
        last_pass: set[int] = set()

        def reader() -> None:
            """Match this process's prompts again and again, one whole pass after ``stop``
            too; ``last_pass``: the files the last pass matched."""
            pool = prompts(1, n) + prompts(2, n)
            while True:
                done, seen = stop.is_set(), set()
                for toks in pool:
                    m = store.match(toks)
                    if m.length:
                        store.lease([m]).release()
                        seen.update(seg.file_id for seg in m.segments)
                if done:
                    last_pass.update(seen)
                    return

        def writer(seed: int) -> None:
            for toks in prompts(seed, n):
                ks, vs = kv_of(toks)
                store.put_async(toks, ks, vs)

        threads = [threading.Thread(target=reader)] + [threading.Thread(target=writer, args=(s,)) for s in (1, 2)]
        for t in threads:
            t.start()
        for t in threads[1:]:
            t.join()
        store.flush()
        assert child.wait(timeout=300) == 0
        store.enforce_disk_budget()  # the other process may have written after our last write
        stop.set()
        threads[0].join()
        stats = store.stats()
        assert stats["prefixes_evicted"] > 0
        assert store.disk_bytes() <= budget + prefix
        # in its grace period: exactly each file on the path of a prompt of this process
        # (matched, the clock standing still); the other process's own rows are free
        indexed = {r.id for r in store._catalog.records.values()}
        grace = {f for f in indexed if store._leases.protection(f, store.clock()) == GRACE}
        assert grace and grace == last_pass & indexed and last_pass <= indexed
        # with every free file gone, eviction takes prefixes in their grace period
        store.config.disk_bytes = base + 2 * prefix
        removed = store.enforce_disk_budget()
        left = {r.id for r in store._catalog.records.values()}
        assert removed["removed_files"] > 0 and (grace - left) and not (indexed - grace) & left
        assert store.disk_bytes() <= base + 3 * prefix
    assert du(tmp_path) <= base + 3 * prefix


def test_drain_does_not_wait_for_files_to_gather(monkeypatch):
    """A file handed to the unlink thread while it sleeps (fewer than `BATCH_WAKE` wait)
    is deleted as soon as `drain` wakes the thread: the thread does not then wait for more
    to gather. With both waits an hour long, the old behaviour (a gathering wait after
    the drain's wake-up, so every flush at the budget took one drain poll) never ends."""
    from impress_cache.store import leases

    monkeypatch.setattr(leases, "UNLINK_EVERY_S", 3600.0)
    monkeypatch.setattr(leases, "DRAIN_POLL_S", 3600.0)
    gone: list[str] = []
    unlinker = leases.Unlinker(gone.append)
    try:
        for name in ("a", "b"):  # the second arrives while the thread sleeps, idle
            if name == "b":  # (the thread back in its idle wait, nothing pending)
                deadline = time.monotonic() + 60
                while not unlinker._cv._waiters or unlinker._busy or unlinker._names:
                    assert time.monotonic() < deadline, "the unlink thread never went idle"
                    time.sleep(0.001)
            unlinker(name)
            done = threading.Thread(target=unlinker.drain, daemon=True)
            done.start()
            done.join(60)
            assert not done.is_alive(), f"drain waited for more files to gather before deleting {name!r}"
        assert gone == ["a", "b"]
    finally:
        unlinker.close()
