"""Incremental disk eviction: the heap of candidate leaves removes exactly what a full scan
of the tree would (lowest value first among free leaves, then among leaves held only by
their grace period; never a leased or protected one), in any mix of writes, accesses,
leases, splits and clock steps."""

from __future__ import annotations

from collections import Counter

import hypothesis.strategies as st
from hypothesis import HealthCheck, example, given, settings

import impress_cache.store.gc as gc_mod
from impress_cache.store.leases import FREE, GRACE
from impress_cache.store.changes import TreeChanges
from test_reorder import _model, cfg, put

#: prefixes removed per example (the last test checks the examples really evicted)
evictions: list[int] = []
SYSTEM = [[7, 8, 9, 10, 11, 12], [20, 21, 22, 23], [7, 8, 9, 30, 31]]


def reference_order(store, protect: set[int], now: float, steps: int) -> list[int]:
    """The removal order of a full scan: every step takes the leaf with the lowest
    ``(sort_key, id)`` among free leaves, or else among leaves in their grace period."""
    nodes = list(store._catalog.tree.nodes())
    parent = {n.id: n.parent.id for n in nodes}
    children = Counter(parent.values())
    file_of = {n.id: n.file_id for n in nodes}
    key = {n.id: store._values.sort_key(n.id) for n in nodes}
    state = {f: store._leases.protection(f, now) for f in set(file_of.values())}
    alive, order = set(parent), []
    while len(order) < steps:
        leaves = [n for n in alive if children[n] == 0 and n not in protect]
        pool = [n for n in leaves if state[file_of[n]] == FREE] or [n for n in leaves if state[file_of[n]] == GRACE]
        if not pool:
            break
        victim = min(pool, key=lambda n: (key[n], n))
        order.append(victim)
        alive.remove(victim)
        children[parent[victim]] -= 1
    return order


#: prompts that share system prompts and parts of their tails (so writes split nodes)
POOL = [
    SYSTEM[i % 3] + tail
    for i, tail in enumerate(
        [[40, 41], [40, 41, 42, 43], [44], [40, 45, 46], [47, 48, 49], [40, 41, 50], [51], [52, 53, 54, 55]]
    )
] + [[60, 61, 62], [60, 61, 63, 64]]
prompt = st.integers(0, len(POOL) - 1)
op = st.one_of(
    st.tuples(st.just("put"), prompt),
    st.tuples(st.just("put"), prompt),
    st.tuples(st.just("evict"), st.floats(0.0, 1.0), st.integers(0, 2)),
    st.tuples(st.just("use"), prompt, st.floats(0.1, 1.0), st.sampled_from([0.0, 6.0])),
    st.tuples(st.just("hold"), prompt),
    st.tuples(st.just("release")),
    st.tuples(st.just("match"), prompt),
    st.tuples(st.just("tick"), st.sampled_from([0.5, 3.0, 10.0])),
    st.tuples(st.just("evict"), st.floats(0.0, 1.0), st.integers(0, 2)),
)


def _tokens(p: int) -> list[int]:
    return POOL[p]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(op, min_size=8, max_size=40), batch=st.sampled_from([1, 3, 16]))
# a prefix reused after it was written goes after one written later and never reused
@example(ops=[("put", 8), ("put", 6), ("use", 8, 1.0, 6.0), ("evict", 0.3, 0)], batch=16)  # = EXPLICIT
def test_incremental_eviction_removes_what_a_full_scan_would(tmp_path_factory, monkeypatch, ops, batch):
    monkeypatch.setattr(gc_mod, "BATCH", batch)  # removals per index transaction
    monkeypatch.setattr(gc_mod, "wal_bound", lambda budget: 0)  # no room kept for the WAL
    clock = [100.0]
    d = tmp_path_factory.mktemp("evict")
    from impress_cache import ImpressStore

    with ImpressStore(d, _model(), cfg(), clock=lambda: clock[0]) as store:
        held = []
        catalog = store._catalog
        removed: list[int] = []
        total = 0
        remove = TreeChanges.remove_leaf

        def recording_remove(self, cat, conn, node):
            removed.append(node.id)
            return remove(self, cat, conn, node)

        monkeypatch.setattr(TreeChanges, "remove_leaf", recording_remove)
        for o in ops:
            kind = o[0]
            if kind == "put":
                put(store, _tokens(o[1]))
            elif kind == "use":
                m = store.match(_tokens(o[1]))
                if m.length:
                    store.lease([m], share=o[2]).release()
                clock[0] += o[3]  # 6 s: past the grace period of this match
            elif kind == "hold":
                m = store.match(_tokens(o[1]))
                if m.length:
                    held.append(store.lease([m]))
            elif kind == "release" and held:
                held.pop(0).release()
            elif kind == "match":
                store.match(_tokens(o[1]))
            elif kind == "tick":
                clock[0] += o[1]
            elif kind == "evict":
                leaves = sorted(n.id for n in catalog.tree.nodes() if not n.children)
                protect = set(leaves[: o[2]])
                store.index.checkpoint()  # the budget keeps the chunk files' share ``o[1]``
                budget = store.index.footprint() + int(catalog.chunk_bytes * o[1])
                expected = reference_order(store, protect, clock[0], 10**6)
                removed.clear()
                store._gc.enforce(budget, protect)
                assert removed == expected[: len(removed)]
                total += len(removed)
                # it stops only within budget or when nothing may go
                assert store.disk_bytes() <= budget or reference_order(store, protect, clock[0], 1) == []
                for node_id in removed:
                    assert catalog.tree.get(node_id) is None
                # every file left is referenced and on disk; every removed file is gone
                referenced = {n.file_id for n in catalog.tree.nodes()}
                assert set(catalog.records) == referenced == {f.id for f in store.index.files()}
                assert catalog.chunk_bytes == sum(f.file_bytes for f in store.index.files())
        evictions.append(total)
        for lease in held:
            lease.release()
        # the heap stays bounded by the nodes it knows
        assert store._values.queued() <= max(256, 4 * (len(catalog.tree) + 1)) + 1


EXPLICIT = [("put", 8), ("put", 6), ("use", 8, 1.0, 6.0), ("evict", 0.3, 0)]


def test_the_examples_evict(tmp_path_factory, monkeypatch):
    """Guard against a vacuous property: the examples above end with removals."""
    if not evictions:  # run alone (or under -k): the explicit example, undecorated
        test_incremental_eviction_removes_what_a_full_scan_would.hypothesis.inner_test(
            tmp_path_factory, monkeypatch, ops=EXPLICIT, batch=16
        )
        assert evictions[-1] > 0
        return
    # the explicit example (run first) evicts; of the generated ones, how many do varies
    # from run to run (8 of 40 in the fewest seen), so ask for a few
    assert evictions[0] > 0
    assert sum(1 for n in evictions[1:] if n) >= 3


@settings(max_examples=40, deadline=None)
@given(
    st.sampled_from(["score", "lru", "lfu"]),
    st.lists(
        st.tuples(
            st.integers(0, 50), st.floats(0, 1e6), st.floats(0, 1), st.integers(0, 10**9),
            st.floats(-1e6, 1e9), st.floats(-1e6, 1e9),
        ),
        min_size=1, max_size=20,
    ),
)
def test_column_keys_are_the_records_keys(name, rows):
    """The keys the eviction heap starts from (`sort_keys` of saved columns) are exactly
    the keys of the records those columns become (`sort_key`), for every policy."""
    import numpy as np

    from impress_cache.tiers.policies import make_policy

    policy = make_policy(name)
    cols = np.array(rows, np.float64).reshape(-1, 6)
    keys = policy.sort_keys(cols)
    for i, row in enumerate(rows):
        policy.load_stats(i, {
            "count": row[0], "freq": row[1], "share": row[2], "seq": row[3], "freq_time": row[4], "last_access": row[5],
        })
        assert (float(keys[i]), row[3]) == policy.sort_key(i, 0.0)


def test_a_leaf_split_by_the_evicting_write_leaves_no_stale_candidate(tmp_path, monkeypatch):
    """A write at the budget splits a leaf that its eviction passed over: the old node id
    is not put back among the candidates (it is no longer in the tree)."""
    from impress_cache import ImpressStore

    monkeypatch.setattr(gc_mod, "wal_bound", lambda b: 0)
    a = list(range(100, 140))
    with ImpressStore(tmp_path, _model(), cfg()) as store:
        put(store, a)
        store.flush()
        for s in range(5):
            put(store, [7 + s] + list(range(200 + 40 * s, 239 + 40 * s)))
            store.flush()
    with ImpressStore(tmp_path, _model(), cfg()) as store:
        store.enforce_disk_budget()
        size = store.disk_bytes()
    with ImpressStore(tmp_path, _model(), cfg(disk_bytes=size)) as store:
        store.enforce_disk_budget()
        put(store, a[:20] + list(range(900, 920)))  # splits a's leaf, evicts another prefix
        store.flush()
        assert store.stats()["prefixes_evicted"] >= 1
        tree = store._catalog.tree
        assert [n for n in store._values._queued if tree.get(n) is None] == []
