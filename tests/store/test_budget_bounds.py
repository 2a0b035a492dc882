"""How far over its disk budget a store goes (issue 25, item 6).

A budget smaller than one prompt kept two prompts: a prompt that extends a prefix stored
in an older file (here: a shared system prompt) needs that file too, and the older
prompt's tail in it could not be freed. And evicted files stayed on disk long after
their eviction: the thread that deletes them was woken only by 32 of them, a drain or
a close, so a store between two flushes held up to 32 evicted prompts beside its budget.

Now a budget below one prompt keeps at most the prompt just written, and only when it
lives in one file (otherwise none); a write returns once the files it evicted are gone,
so after every write the store's directory (index, WAL and shared-memory file
included) holds at most budget + the largest prompt, with one process or several.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from impress_cache import ImpressStore
from test_budget import SYSTEMS, du, prompts
from test_invariants import PATHS, _nodes_inside_files
from test_reorder import _model, assert_reads_exact, cfg, put


def _stored_prompts(store: ImpressStore) -> int:
    return sum(n.terminal for n in store.tree.nodes())


def _chunk_files(path: Path) -> int:
    return sum(1 for _ in (path / "chunks").iterdir())


@pytest.mark.parametrize("shared", [False, True], ids=["apart", "shared-system-prompt"])
def test_a_budget_below_one_prompt_keeps_at_most_the_prompt_just_written(tmp_path, shared):
    pool = prompts(1, 9)
    if shared:  # every prompt extends one system prompt: the second one splits the first one's file
        pool = [SYSTEMS[0] + p[16:] for p in pool]
    largest = 0
    with ImpressStore(tmp_path, _model(), cfg(disk_bytes=20_000)) as store:
        for toks in pool:
            before = store.stats()["bytes_written"]
            put(store, toks)
            largest = max(largest, store.stats()["bytes_written"] - before)
            assert _stored_prompts(store) <= 1
            assert _chunk_files(tmp_path) <= 1  # (the files it evicted are gone when put returns)
            assert store._catalog.chunk_bytes <= largest
            if _stored_prompts(store):  # the one kept is the one just written
                assert assert_reads_exact(store, toks) == len(toks)
        kept = _stored_prompts(store)
    if not shared:
        assert kept == 1  # a prompt in one file of its own stays, over the budget
    _nodes_inside_files(tmp_path)


def test_evicted_files_are_gone_when_the_write_returns(tmp_path):
    """Between two flushes: the directory after every write stays within budget + the
    largest prompt (before, evicted files waited for 32 more, a flush or the close)."""
    pool = prompts(2, 30)
    with ImpressStore(tmp_path, _model(), cfg()) as store:
        put(store, pool[0])
        base, one = store.disk_bytes(), store._catalog.chunk_bytes
    budget = base + 3 * one
    largest = worst = 0
    with ImpressStore(tmp_path, _model(), cfg(disk_bytes=budget)) as store:
        for i in range(40):
            before = store.stats()["bytes_written"]
            put(store, pool[(i * 7) % len(pool)])
            largest = max(largest, store.stats()["bytes_written"] - before)
            worst = max(worst, du(tmp_path))
        assert store.stats()["prefixes_evicted"] > 10
    assert worst <= budget + largest, (worst, budget, largest)


_WORKER = """
import json, sys
sys.path[:0] = {paths!r}
from pathlib import Path
from impress_cache import ImpressStore
from test_reorder import _model, cfg, put
from test_budget import SYSTEMS, du, prompts
pool = prompts({seed}, 30)
if {shared}:
    pool = [SYSTEMS[0] + p[16:] for p in pool]
from impress_cache.store.gc import wal_bound
largest = worst = worst_wal_over = 0
with ImpressStore({store!r}, _model(), cfg(disk_bytes={budget})) as store:
    for i in range({n}):
        before = store.stats()["bytes_written"]
        put(store, pool[(i * 7) % len(pool)])
        largest = max(largest, store.stats()["bytes_written"] - before)
        size = du(Path({store!r}))
        # the WAL past its share of the budget, which the other process's commits grow
        # between this process's checkpoints (a known excess: docs/tiers.md), counted apart
        wal_over = max(0, store.index.footprint(main=False) - wal_bound({budget}))
        worst, worst_wal_over = max(worst, size - wal_over), max(worst_wal_over, wal_over)
    failures = store.stats()["write_failures"]
print(json.dumps({{"largest": largest, "worst": worst, "wal_over": worst_wal_over, "write_failures": failures}}))
"""


def _run_workers(path: Path, budget: int, n: int, shared: bool, procs: int = 2) -> list[dict]:
    running = [
        subprocess.Popen(
            [sys.executable, "-c", _WORKER.format(paths=PATHS, store=str(path), budget=budget, n=n, seed=s, shared=shared)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for s in range(procs)
    ]
    out = []
    for proc in running:
        stdout, stderr = proc.communicate(timeout=600)
        assert proc.returncode == 0, stderr[-3000:]
        out.append(json.loads(stdout.strip().splitlines()[-1]))
    assert all(r["write_failures"] == 0 for r in out), out
    return out


def test_two_processes_stay_within_budget_plus_the_largest_prompt(tmp_path):
    """Two processes write prompts of one pool into a store with a budget of a few
    prompts. After each of its writes, each process finds the directory within budget +
    the largest prompt (the other process's file in flight is the one prompt over), not
    counting the WAL past its share of the budget, which the other process's commits grow
    between checkpoints (a known excess, bounded here by two prompts' worth); after both
    closed the directory is within it too, WAL included; a fresh process serves exactly."""
    with ImpressStore(tmp_path, _model(), cfg()) as store:
        put(store, prompts(0, 1)[0])
        base, one = store.disk_bytes(), store._catalog.chunk_bytes
    budget = base + 3 * one
    results = _run_workers(tmp_path, budget, 40, shared=False)
    largest = max(r["largest"] for r in results)
    assert max(r["worst"] for r in results) <= budget + largest, (results, budget)
    assert max(r["wal_over"] for r in results) <= 2 * largest, (results, budget)
    assert du(tmp_path) <= budget + largest
    _nodes_inside_files(tmp_path)
    with ImpressStore(tmp_path, _model(), cfg()) as store:
        toks = prompts(0, 30)[7]
        put(store, toks)
        assert assert_reads_exact(store, toks) == len(toks)


def test_two_processes_below_one_prompt_leave_at_most_one_prompt(tmp_path):
    results = _run_workers(tmp_path, 20_000, 25, shared=True)
    assert all(r["largest"] > 20_000 for r in results)  # (every prompt is over the budget on its own)
    with ImpressStore(tmp_path, _model(), cfg()) as store:
        assert _stored_prompts(store) <= 1
        assert store._catalog.chunk_bytes <= max(r["largest"] for r in results)
    assert _chunk_files(tmp_path) <= 1
    _nodes_inside_files(tmp_path)


def test_the_unlink_thread_wakes_for_one_file():
    """One name handed over is deleted after the gathering delay, without a drain (before,
    the thread slept until 32 names, a drain or the close woke it)."""
    import threading
    import time

    from impress_cache.store.leases import UNLINK_EVERY_S, Unlinker

    done = threading.Event()
    unlinker = Unlinker(lambda name: done.set())
    try:
        for _ in range(2):  # (the second time, the thread waits for work again)
            done.clear()
            t0 = time.monotonic()
            unlinker("one")
            assert done.wait(5.0), "the unlink thread was not woken"
            assert time.monotonic() - t0 >= UNLINK_EVERY_S * 0.5  # (it still lets names gather)
    finally:
        unlinker.close()
