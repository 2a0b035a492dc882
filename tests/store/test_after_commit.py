"""A step after a write's index transaction has committed fails: the prompt stays stored.

The writer removes its new file only when the index did not take it. A failure after the
commit (the tree update, the bookkeeping of the removals the disk budget made in the same
transaction) is logged and counted, the tree is reloaded from the index, and the file the
index references stays: another process opens the store and reuses the prompt with the
K/V of a dense run."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import tiny_model
from helpers import assert_same_as_uncached, tokens
from impress_cache import ImpressConfig, ImpressStore
from impress_cache.index.radix import RadixTree
from impress_cache.store import CHUNK_DIR
from impress_cache.store.gc import Removal

ROOT = Path(__file__).resolve().parents[2]
CFG = dict(chunk_tokens=16, important_ratio=1.0, reorg_idle_ms=None)

_REUSE = textwrap.dedent(
    """
    import sys, torch
    sys.path.insert(0, {tests!r})
    from conftest import tiny_model
    from helpers import assert_same_as_uncached, tokens
    from impress_cache import ImpressConfig, ImpressStore
    model = tiny_model("llama")
    doc = tokens({seed}, 80)[None]
    with torch.no_grad():
        dense = model(doc, use_cache=True).past_key_values  # the prefill the store saw
    with ImpressStore({path!r}, model, ImpressConfig(**{cfg!r})) as store:
        m = store.match(doc[0].tolist(), limit=79)
        assert m.length == 79, m.length
        got = store.load(m.segments)
        for layer in range(len(dense.layers)):
            assert torch.equal(got.keys[layer], dense.layers[layer].keys[0, :, :79]), layer
            assert torch.equal(got.values[layer], dense.layers[layer].values[0, :, :79]), layer
        cache = assert_same_as_uncached(model, store, doc)
        assert cache.stats.matched_tokens == 79, cache.stats.matched_tokens
        assert store.stats()["quarantined_files"] == 0
    print("reused")
    """
)


def _fail_once(monkeypatch, cls: type, name: str, fail: bool = True) -> list[int]:
    """Make ``cls.name`` raise the first time it is called (a real step of the store;
    ``fail=False``: only count the calls)."""
    real = getattr(cls, name)
    calls: list[int] = []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1 and fail:
            raise RuntimeError(f"injected failure in {name}")
        return real(*args, **kwargs)

    monkeypatch.setattr(cls, name, failing)
    return calls


@pytest.mark.parametrize("step", ["tree", "removals"])
def test_a_failure_after_the_commit_keeps_the_prompt(tmp_path, monkeypatch, caplog, step):
    model = tiny_model("llama")
    a, b = tokens(1, 80)[None], tokens(2, 80)[None]
    cfg = dict(CFG)
    if step == "removals":
        # a budget that b's file only fits by removing a, in b's own transaction
        with ImpressStore(tmp_path, model, ImpressConfig(**cfg)) as store:
            assert_same_as_uncached(model, store, a)
            cfg["disk_bytes"] = store.disk_bytes() + store.stats()["bytes_written"] // 2
    with ImpressStore(tmp_path, model, ImpressConfig(**cfg)) as store:
        calls = _fail_once(monkeypatch, *((RadixTree, "attach") if step == "tree" else (Removal, "settle")))
        assert_same_as_uncached(model, store, b)  # stores b; the step after its commit fails
        assert calls, "the step was not reached"
        monkeypatch.undo()
        names = set(store.index.file_names().values())
        assert names and all((tmp_path / CHUNK_DIR / n).is_file() for n in names)  # b's file kept
        assert store.match(b[0].tolist(), limit=79).length == 79  # the tree follows the index
        stats = store.stats()
        assert stats["after_commit_failures"] == 1 and stats["write_failures"] == 0
        assert "after its index transaction committed" in caplog.text
        if step == "removals":
            assert stats["prefixes_evicted"] == 1 and store.match(a[0].tolist()).length == 0
    script = _REUSE.format(tests=str(ROOT / "tests"), seed=2, path=str(tmp_path), cfg=cfg)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "reused" in proc.stdout, proc.stderr[-3000:]


@pytest.mark.parametrize("reload_fails", [False, True], ids=["tree", "tree-and-reload"])
def test_a_failure_after_a_rewrite_commits_keeps_the_rewritten_file(tmp_path, monkeypatch, reload_fails):
    """The reorganiser's replacement commits, then its tree update fails (and, in the
    second case, the reload after it too: the tree follows at the next look at the
    index): `reorganize` reports the rewrite, the rewritten file (which the index now
    references) serves exact rows, here and after a reopen, and the old file is gone."""
    from impress_cache.store.catalog import Catalog
    from test_reorder import _model, assert_reads_exact, cfg, put, scatter

    toks = list(range(3, 67))
    with ImpressStore(tmp_path, _model(), cfg()) as store:
        put(store, toks)
        for _ in range(4):
            scatter(store, toks)
        calls = _fail_once(monkeypatch, RadixTree, "attach")
        reloads = _fail_once(monkeypatch, Catalog, "reload_tree", fail=reload_fails)
        assert store.reorganize(force=True)["rewritten"] == 1
        assert calls and reloads  # the failed tree update reloaded the tree (or tried to)
        monkeypatch.undo()
        assert store.stats()["after_commit_failures"] == 1
        store._catalog.refresh()
        (node,) = [n for n in store.tree.nodes() if n.parent is not None]
        assert store._catalog.perm_of(node.file_id) is not None  # the tree follows the index
        assert assert_reads_exact(store, toks) == len(toks)
    with ImpressStore(tmp_path, _model(), cfg()) as store:
        (node,) = [n for n in store.tree.nodes() if n.parent is not None]
        assert store._catalog.perm_of(node.file_id) is not None
        assert assert_reads_exact(store, toks) == len(toks)
        assert store.stats()["quarantined_files"] == 0
        names = sorted(p.name for p in (tmp_path / CHUNK_DIR).iterdir())
        assert names == [store._catalog.records[node.file_id].name]


def test_the_budget_s_bookkeeping_runs_after_a_failed_tree_update(tmp_path, monkeypatch):
    """A write whose transaction also evicted (the disk budget) commits, then its tree
    update fails: the tree is reloaded, and the removals' bookkeeping still runs (the
    evicted leaf's statistics go), as after a tree update that worked (review19)."""
    model = tiny_model("llama")
    a, b = tokens(1, 80)[None], tokens(2, 80)[None]
    cfg = dict(CFG)
    with ImpressStore(tmp_path, model, ImpressConfig(**cfg)) as store:
        assert_same_as_uncached(model, store, a)
        cfg["disk_bytes"] = store.disk_bytes() + store.stats()["bytes_written"] // 2
    with ImpressStore(tmp_path, model, ImpressConfig(**cfg)) as store:
        leaf_a = store.match(a[0].tolist()).segments[-1].node.id
        settled = _fail_once(monkeypatch, Removal, "settle", fail=False)
        failed = _fail_once(monkeypatch, RadixTree, "attach")
        assert_same_as_uncached(model, store, b)  # stores b, evicting a in the same transaction
        assert failed and settled, "the bookkeeping did not run after the failed tree update"
        monkeypatch.undo()
        assert store.stats()["after_commit_failures"] == 1 and store.stats()["prefixes_evicted"] == 1
        assert store.match(a[0].tolist()).length == 0 and store.tree.get(leaf_a) is None
        assert leaf_a not in store._values._policy and leaf_a not in store._values._queued
