"""Importance reordering: rewritten nodes read back exact, splits, eviction and the memory
tiers keep working on them, rewrites are crash safe and one process rewrites at a time."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
from pathlib import Path

import hypothesis.strategies as st
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings

from conftest import tiny_model
from impress_cache import ImpressConfig, ImpressStore
from impress_cache.cli import main as cli_main
from impress_cache.storage import FORMATS
from impress_cache.store.catalog import CHUNK_DIR

ROOT = Path(__file__).resolve().parents[2]
LAYERS, HEADS, DIM = 2, 2, 16
_MODEL = None


def _model():
    global _MODEL
    if _MODEL is None:
        _MODEL = tiny_model("llama")
    return _MODEL


def kv_of(tokens: list[int]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Deterministic K/V of a token sequence: row ``i`` depends on ``tokens[: i + 1]`` only,
    so prompts that share a prefix share its rows, as a real model's do."""
    rows = []
    for i in range(len(tokens)):
        seed = hash(tuple(tokens[: i + 1])) & 0xFFFFFFFF
        rows.append(np.random.default_rng(seed).standard_normal((2, LAYERS, HEADS, DIM), dtype=np.float32))
    a = torch.from_numpy(np.stack(rows, axis=3)) if rows else torch.zeros(2, LAYERS, HEADS, 0, DIM)
    return list(a[0]), list(a[1])


def cfg(**kw) -> ImpressConfig:
    base = dict(chunk_tokens=4, important_ratio=0.25, fsync=False, reorg_idle_ms=None, device_bytes=0, host_bytes=0)
    return ImpressConfig(**{**base, **kw})


def put(store: ImpressStore, toks: list[int]) -> None:
    ks, vs = kv_of(toks)
    store.put(toks, ks, vs)


def assert_reads_exact(store: ImpressStore, toks: list[int]) -> int:
    """Match ``toks`` and compare every matched row with `kv_of`; returns the match length."""
    m = store.match(toks)
    if m.length:
        loaded = store.load(m.segments)
        ks, vs = kv_of(toks[: m.length])
        assert torch.equal(loaded.keys, torch.stack(ks))
        assert torch.equal(loaded.values, torch.stack(vs))
    return m.length


def scatter(store: ImpressStore, toks: list[int], every: int = 4, offset: int = 0) -> None:
    """Record one request's importance over the stored prefix of ``toks``: positions
    ``offset, offset + every, ...`` in every layer (scattered over all blocks)."""
    m = store.match(toks)
    imp = np.zeros((LAYERS, m.length), np.float32)
    imp[:, offset::every] = 1.0
    store.record_importance(m.segments, imp)


# -- the reordered layout ---------------------------------------------------------------------
@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_reordered_node_keeps_its_rows_and_packs_the_important_ones_first(tmp_path, fmt):
    toks = list(range(3, 67))  # 64 rows, 16 blocks of 4
    with ImpressStore(tmp_path, _model(), cfg(), storage_format=fmt) as store:
        put(store, toks)
        for _ in range(4):
            scatter(store, toks)
        (node,) = [n for n in store.tree.nodes() if n.parent is not None]
        plan = store._reorder.reorganizer.plan(node)
        assert plan.blocks_now == 16 and plan.blocks_after == 4
        result = store.reorganize()
        assert result["rewritten"] == 1 and not result["busy"]
        assert assert_reads_exact(store, toks) == 64
        (node,) = [n for n in store.tree.nodes() if n.parent is not None]
        perm = store._catalog.perm_of(node.file_id)
        assert perm is not None
        # the 16 important rows (every 4th) are the first 16 physical rows: 4 blocks
        assert sorted(perm[:, ::4].reshape(-1) // 4) == sorted([0, 1, 2, 3] * 4 * LAYERS)
        s = store.stats()
        assert s["reorganisations"] == 1 and s["bytes_rewritten"] > 0 and s["files"] == 1
        # block selection of those rows now touches 4 blocks per layer, not 16
        view = store.layout(store.match(toks).segments).at(0)
        assert len(view.units_for(torch.arange(0, 64, 4))) == 4
    # the permutation survives a restart; a second look finds nothing to gain
    with ImpressStore(tmp_path, _model(), cfg()) as store:
        assert assert_reads_exact(store, toks) == 64
        assert store.reorganize()["rewritten"] == 0


def test_a_node_is_rewritten_only_with_enough_requests_and_gain(tmp_path):
    toks = list(range(3, 67))
    with ImpressStore(tmp_path, _model(), cfg(reorg_min_requests=3)) as store:
        put(store, toks)
        for _ in range(2):
            scatter(store, toks)
        assert store.reorganize()["rewritten"] == 0  # two requests: not yet
        scatter(store, toks)
        assert store.reorganize()["rewritten"] == 1
        # rows already in order: the statistics ask for the same order, no gain
        for _ in range(3):
            scatter(store, toks)
        assert store.reorganize()["rewritten"] == 0
        # contiguous importance in a prompt-order node: nothing to gain either
        other = list(range(100, 164))
        put(store, other)
        m = store.match(other)
        for _ in range(3):
            imp = np.zeros((LAYERS, m.length), np.float32)
            imp[:, :16] = 1.0
            store.record_importance(m.segments, imp)
        assert store.reorganize()["rewritten"] == 0


def test_rewrite_of_a_node_whose_file_is_shared_after_a_split(tmp_path):
    a = list(range(3, 67))
    b = a[:30] + list(range(200, 220))
    with ImpressStore(tmp_path, _model(), cfg()) as store:
        put(store, a)
        for _ in range(4):
            scatter(store, a)
        put(store, b)  # splits the node at 30: both halves keep their statistics
        assert store.reorganize(force=True)["rewritten"] == 2
        for toks in (a, b, a[:17], b[:33]):
            assert assert_reads_exact(store, toks) == len(toks)
        # the first file is no longer referenced by any node: deleted
        assert store.stats()["files"] == 3
        assert len(list((tmp_path / CHUNK_DIR).iterdir())) == 3


# -- random sequences against a store that never reorders -------------------------------------
_OPS = st.lists(
    st.one_of(
        st.tuples(st.just("put"), st.integers(0, 5)),
        st.tuples(st.just("imp"), st.integers(0, 5), st.integers(1, 6), st.integers(0, 5)),
        st.tuples(st.just("reorg"), st.booleans()),
        st.tuples(st.just("read"), st.integers(0, 5), st.integers(1, 70)),
        st.tuples(st.just("evict"), st.floats(0.3, 0.9)),
    ),
    min_size=3,
    max_size=18,
)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=_OPS, chunk=st.integers(2, 8), seed=st.integers(0, 10_000), tiers=st.booleans())
def test_random_store_split_reorganise_read_sequences_match_a_store_without_reordering(
    tmp_path_factory, ops, chunk, seed, tiers
):
    rng = np.random.default_rng(seed)
    trunk = rng.integers(3, 256, 40).tolist()
    prompts = [trunk[: rng.integers(8, 41)] + rng.integers(3, 256, rng.integers(0, 30)).tolist() for _ in range(6)]
    d = tmp_path_factory.mktemp("reorder")
    mem = dict(device_bytes=64 * 1024, host_bytes=128 * 1024) if tiers else {}
    evicted = False
    with (
        ImpressStore(d / "a", _model(), cfg(chunk_tokens=chunk, **mem)) as store,
        ImpressStore(d / "b", _model(), cfg(chunk_tokens=chunk)) as plain,
    ):
        for op in ops:
            if op[0] == "put":
                for s in (store, plain):
                    put(s, prompts[op[1]])
            elif op[0] == "imp":
                toks = prompts[op[1]]
                if store.match(toks).length:
                    scatter(store, toks, every=op[2], offset=min(op[3], op[2] - 1))
            elif op[0] == "reorg":
                store.reorganize(force=op[1])
            elif op[0] == "evict":
                budget = max(1, int(store.disk_bytes() * op[1]))
                evicted |= store._gc.enforce(budget, ())["removed_prefixes"] > 0
            else:
                toks = prompts[op[1]][: op[2]]
                got = assert_reads_exact(store, toks)
                want = assert_reads_exact(plain, toks)
                if not evicted:
                    assert got == want
        for toks in prompts:
            assert_reads_exact(store, toks)
    with ImpressStore(d / "a", _model(), cfg(chunk_tokens=chunk)) as store:  # and after a restart
        for toks in prompts:
            assert_reads_exact(store, toks)


# -- yielding, background, processes -------------------------------------------------------
def test_rewrite_waits_for_requests_between_blocks(tmp_path):
    """A request takes its lease while the rewrite is between two blocks: the rewrite
    writes no further block until the lease is released."""
    toks = list(range(3, 131))
    events: list[str] = []
    lock = threading.Lock()
    with ImpressStore(tmp_path, _model(), cfg(reorg_idle_ms=20)) as store:
        put(store, toks)
        for _ in range(4):
            scatter(store, toks)
        reorg = store._reorder.reorganizer
        inner = reorg._between
        paused, resume, waiting, wrote = (threading.Event() for _ in range(4))

        def between():
            if not paused.is_set() and len(events) == 2:  # between the 2nd and 3rd block
                paused.set()
                resume.wait(30)  # the request takes its lease now
                waiting.set()
            inner()  # waits until the store is idle
            with lock:
                events.append("block")
            if waiting.is_set():
                wrote.set()

        reorg._between = between
        worker = threading.Thread(target=store.reorganize)
        worker.start()
        assert paused.wait(30)
        m = store.match(toks)
        lease = store.lease([m])
        with lock:
            events.append("request")
        resume.set()
        assert waiting.wait(30)  # the rewrite is in its wait between blocks, the lease held
        assert not wrote.wait(0.2)  # no block comes while the request holds its lease
        with lock:
            events.append("done")
        lease.release()
        worker.join(60)
        assert not worker.is_alive()
        assert events[:4] == ["block", "block", "request", "done"] and events[4] == "block"
        assert events.count("block") > 4
        assert store.stats()["reorganisations"] == 1
        assert assert_reads_exact(store, toks) == len(toks)


def test_background_reorganiser_rewrites_once_the_store_is_idle(tmp_path):
    toks = list(range(3, 67))
    config = cfg(reorg_idle_ms=0, reorg_min_requests=2)
    with ImpressStore(tmp_path, _model(), config) as store:
        put(store, toks)
        for _ in range(2):
            scatter(store, toks)
        done = threading.Event()
        for _ in range(500):
            if store.stats()["reorganisations"]:
                done.set()
                break
            done.wait(0.02)
        assert store.stats()["reorganisations"] == 1
        assert assert_reads_exact(store, toks) == len(toks)


_CRASH = """
import os, signal, sys
sys.path.insert(0, {tests!r})
sys.path.insert(0, {here!r})
from test_reorder import _model, cfg, scatter
from impress_cache import ImpressStore
from impress_cache.store.catalog import Catalog
where = sys.argv[1]
toks = list(range(3, 67))
store = ImpressStore({path!r}, _model(), cfg())
for _ in range(4):
    scatter(store, toks)
reorg = store._reorder.reorganizer
if where.startswith("block"):
    n = [0]
    inner = reorg._between
    def between():
        n[0] += 1
        if n[0] == int(where[5:]):
            os.kill(os.getpid(), signal.SIGKILL)
        inner()
    reorg._between = between
elif where == "before_commit":
    def replace_node(self, node, new_file):
        os.kill(os.getpid(), signal.SIGKILL)
    Catalog.replace_node = replace_node
elif where == "after_commit":
    real = Catalog.replace_node
    def replace_node(self, node, new_file):
        real(self, node, new_file)
        os.kill(os.getpid(), signal.SIGKILL)
    Catalog.replace_node = replace_node
store.reorganize()
"""


@pytest.mark.parametrize("where", ["block3", "block9", "before_commit", "after_commit"])
def test_kill_during_a_rewrite_leaves_the_old_or_the_new_layout(tmp_path, where):
    toks = list(range(3, 67))
    with ImpressStore(tmp_path, _model(), cfg()) as store:
        put(store, toks)
    script = _CRASH.format(tests=str(ROOT / "tests"), here=str(Path(__file__).parent), path=str(tmp_path))
    proc = subprocess.run([sys.executable, "-c", script, where], capture_output=True, text=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    with ImpressStore(tmp_path, _model(), cfg()) as store:
        assert assert_reads_exact(store, toks) == len(toks)
        (node,) = [n for n in store.tree.nodes() if n.parent is not None]
        reordered = store._catalog.perm_of(node.file_id) is not None
        assert reordered == (where == "after_commit")
        # leftovers (the temporary or the replaced file) are gone once the writer thread's
        # first job, the scan, ran: one file, the indexed one
        store.flush()
        names = sorted(p.name for p in (tmp_path / CHUNK_DIR).iterdir())
        assert names == [store._catalog.records[node.file_id].name]


_TWO = """
import json, sys
sys.path.insert(0, {tests!r})
sys.path.insert(0, {here!r})
from test_reorder import _model, cfg
from impress_cache import ImpressStore
with ImpressStore({path!r}, _model(), cfg()) as store:
    print(json.dumps(store.reorganize(force=True)))
"""


def test_two_processes_never_rewrite_the_same_node(tmp_path):
    prompts = [list(range(3, 67)), [1] + list(range(70, 134)), [2] + list(range(140, 204))]
    with ImpressStore(tmp_path, _model(), cfg()) as store:
        for toks in prompts:
            put(store, toks)
            for _ in range(4):
                scatter(store, toks)
    script = _TWO.format(tests=str(ROOT / "tests"), here=str(Path(__file__).parent), path=str(tmp_path))
    procs = [subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True) for _ in range(2)]
    results = [json.loads(p.communicate(timeout=300)[0].strip().splitlines()[-1]) for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert sum(r["rewritten"] for r in results) == 3  # each node once, by one process or the other
    with ImpressStore(tmp_path, _model(), cfg()) as store:
        assert store.stats()["files"] == 3
        for toks in prompts:
            assert assert_reads_exact(store, toks) == len(toks)


def test_cli_reorg_uses_the_saved_statistics(tmp_path, capsys):
    toks = list(range(3, 67))
    with ImpressStore(tmp_path, _model(), cfg()) as store:
        put(store, toks)
        for _ in range(4):
            scatter(store, toks)
    assert cli_main(["reorg", str(tmp_path), "--chunk-tokens", "4"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["rewritten"] == 1 and out["files"] == 1
    assert cli_main(["verify", str(tmp_path)]) == 0
    with ImpressStore(tmp_path, _model(), cfg()) as store:
        assert assert_reads_exact(store, toks) == len(toks)
        (node,) = [n for n in store.tree.nodes() if n.parent is not None]
        assert store._catalog.perm_of(node.file_id) is not None


def test_store_opened_without_a_model_cannot_serve_requests(tmp_path):
    from impress_cache import ImpressCache
    from impress_cache.errors import CacheUsageError, StoreFormatError

    with pytest.raises(StoreFormatError, match="open it once with the model"):
        ImpressStore(tmp_path / "empty", None)
    with ImpressStore(tmp_path, _model(), cfg()) as store:
        put(store, list(range(3, 20)))
    with ImpressStore(tmp_path, None) as store:
        assert store.match(list(range(3, 20))).length == 17
        with pytest.raises(CacheUsageError, match="without a model"):
            ImpressCache(store)
