"""Node statistics saved in the index come back when the store reopens, whether a node's
record is installed alone (first use) or all at once (the eviction order starts)."""

from __future__ import annotations

import pytest

from impress_cache import ImpressStore
from test_reorder import _model, cfg, put


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _prompts() -> list[list[int]]:
    return [[5, 6, 7, 8] + [20 + i, 30 + i, 40 + i, 50 + i] for i in range(6)] + [[9, 9, 9, 1, 2]]


def _hold_writer(monkeypatch):
    """The writer thread's jobs wait for the returned event (the deferred reads among them)."""
    import threading

    from impress_cache.store.writer import PromptWriter

    go = threading.Event()
    background = PromptWriter.background
    monkeypatch.setattr(PromptWriter, "background", lambda self, fn: background(self, lambda: (go.wait(60), fn())))
    return go


def _used(store: ImpressStore, clock: Clock) -> list[int]:
    """Store `_prompts` and access some nodes twice, with shares; returns the node ids."""
    for toks in _prompts():
        put(store, toks)
        clock.t += 1.0
    ids = sorted(n.id for n in store.tree.nodes())
    for k, node_id in enumerate(ids[::2] * 2):
        store._values.access([node_id], share=0.25 + 0.1 * (k % 5))
        clock.t += 0.5
    return ids


@pytest.mark.parametrize("policy", ["lru", "lfu", "score"])
@pytest.mark.parametrize("install", ["one_by_one", "at_once"])
def test_saved_node_values_come_back(tmp_path, policy, install):
    clock = Clock()
    with ImpressStore(tmp_path, _model(), cfg(policy=policy), clock=clock) as store:
        ids = _used(store, clock)
        before = {i: store._values.sort_key(i) for i in ids}
    clock.t += 10.0  # closed meanwhile: every node equally older, the order stays
    with ImpressStore(tmp_path, _model(), cfg(policy=policy), clock=clock) as store:
        assert sorted(n.id for n in store.tree.nodes()) == ids
        if install == "at_once":
            store._values.reset_order([n.id for n in store.tree.nodes() if n.is_leaf()], start=True)
        after = {i: store._values.sort_key(i) for i in ids}
        assert sorted(ids, key=before.__getitem__) == sorted(ids, key=after.__getitem__)
        if policy == "lru":
            assert after == before  # the key is the access order itself
        # an access after the reopen is more recent than every saved one
        store._values.access([ids[1]])
        if policy == "lru":
            assert store._values.sort_key(ids[1]) == max(store._values.sort_key(i) for i in ids)


def test_a_request_before_the_writer_thread_gets_the_saved_values_first(tmp_path, monkeypatch):
    """Opening does not read the node statistics (the writer thread does, as its first
    job); a request that comes before it reads them itself, and its access counts on top."""
    toks = _prompts()[2]
    with ImpressStore(tmp_path, _model(), cfg(policy="lfu")) as store:
        for p in _prompts():
            put(store, p)
        leaf = store.match(toks).segments[-1].node.id
        for _ in range(3):
            store.lease([store.match(toks)]).release()
        saved = store._values._policy.stats_of(leaf)["count"]
    assert saved >= 3
    go = _hold_writer(monkeypatch)
    store = ImpressStore(tmp_path, _model(), cfg(policy="lfu"))
    try:
        assert store._values.saved.pending  # not read while opening
        store.lease([store.match(toks)]).release()  # the request's access: the saved ones come first
        assert not store._values.saved.pending
        assert store._values._policy.stats_of(leaf)["count"] == saved + 1
    finally:
        go.set()
        store.close()
    with ImpressStore(tmp_path, _model(), cfg(policy="lfu")) as store:
        store.flush()  # the writer thread read them
        assert not store._values.saved.pending
        assert store._values._policy.stats_of(leaf)["count"] == saved + 1


def test_saved_importance_is_read_after_open_and_before_a_request_adds_to_it(tmp_path, monkeypatch):
    """Row importance (what the reorganiser sorts by) is read after open too; a request
    that records importance before the writer thread read it adds to the saved sums."""

    import numpy as np

    from test_reorder import scatter

    toks = list(range(3, 35))
    with ImpressStore(tmp_path, _model(), cfg(half_life_s=None)) as store:
        put(store, toks)
        scatter(store, toks)
        (node,) = [n for n in store.tree.nodes() if n.parent is not None]
        saved = store._importance.get(node.id)
    go = _hold_writer(monkeypatch)
    store = ImpressStore(tmp_path, _model(), cfg(half_life_s=None))
    try:
        assert store._importance.saved.pending  # not read while opening
        scatter(store, toks)  # a request's importance: the saved sums come first
        assert not store._importance.saved.pending
        now = store._importance.get(node.id)
        assert now.requests == saved.requests + 1
        assert np.array_equal(now.scores, 2 * saved.scores)
    finally:
        go.set()
        store.close()


@pytest.mark.parametrize("policy", ["lru", "lfu", "score"])
def test_saved_values_kept_packed_answer_as_the_full_columns_do(tmp_path, monkeypatch, policy):
    """The saved statistics wait as `PackedColumns` (narrow columns, the same values):
    the keys, the eviction order and the records made from them are those of the
    ``float64`` columns they were read as."""
    import threading

    import numpy as np

    import impress_cache.store.values as values
    from impress_cache.index.columns import PackedColumns
    from impress_cache.store.persist import rebase_columns
    from impress_cache.tiers.policies import make_policy

    clock = Clock()
    with ImpressStore(tmp_path, _model(), cfg(policy=policy), clock=clock) as store:
        ids = _used(store, clock)
        leaves = [n.id for n in store.tree.nodes() if n.is_leaf()]
    with ImpressStore(tmp_path, _model(), cfg(policy=policy), clock=clock) as store:
        read = store.index.load_node_stats()  # (as saved at the close)
        saved_ids, cols = np.array(read[0]), rebase_columns(np.array(read[1]), clock())  # (once for both)
    assert len(saved_ids) == len(ids)

    def opened(pack: bool) -> values.NodeValues:
        monkeypatch.setattr(values, "PackedColumns", PackedColumns if pack else np.asarray)
        nv = values.NodeValues(make_policy(policy), clock)
        nv.saved.defer(lambda: (saved_ids.copy(), cols.copy()), threading.RLock())
        nv.saved.load()
        return nv

    packed, full = opened(True), opened(False)
    assert isinstance(packed._saved, PackedColumns) and packed._saved.nbytes < cols.nbytes
    assert isinstance(full._saved, np.ndarray)
    for nv in (packed, full):
        nv.reset_order(leaves, start=True)
    assert [packed.pop() for _ in leaves] == [full.pop() for _ in leaves]
    assert {i: packed.sort_key(i) for i in ids} == {i: full.sort_key(i) for i in ids}
    assert packed.export() == full.export()
    packed.access(ids[:2]), full.access(ids[:2])
    assert packed.export() == full.export()
