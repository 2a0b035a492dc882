"""Tests of the memory tiers (impress_cache.tiers) and the eviction policies (tiers/policies/)."""

from __future__ import annotations

import math
import random
import threading
from collections.abc import Hashable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
)

from impress_cache.tiers.policies import (
    POLICIES,
    EvictionPolicy,
    LFUPolicy,
    LRUPolicy,
    ScorePolicy,
    make_policy,
)
from impress_cache.tiers import DEVICE, HOST, TierError, TierManager


class FakeClock:
    """Manually advanced clock."""

    def __init__(self, t: float = 0.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        self.t += dt


def fill_host(mgr: TierManager, keys, nbytes: int = 100, share: float | None = None) -> None:
    for k in keys:
        mgr.touch(k, share)
        assert mgr.get(k) is None
        assert mgr.put_from_disk(k, f"p{k}", nbytes) is not None


# ---------------------------------------------------------------------- policies
def test_lru_orders_by_recency() -> None:
    pol = LRUPolicy()
    for k in "abc":
        pol.on_access(k, 0.0)
    pol.on_access("a", 0.0)  # same clock reading: the counter still orders
    order = sorted("abc", key=lambda k: pol.sort_key(k, 0.0))
    assert order == ["b", "c", "a"]


def test_lfu_orders_by_count_then_recency() -> None:
    pol = LFUPolicy()
    for k, n in (("a", 3), ("b", 1), ("c", 2), ("d", 1)):
        for _ in range(n):
            pol.on_access(k, 0.0)
    order = sorted("abcd", key=lambda k: pol.sort_key(k, 0.0))
    assert order == ["b", "d", "c", "a"]


def test_score_is_frequency_times_share() -> None:
    pol = ScorePolicy(half_life_s=None, unimportant_weight=0.0)  # the paper's score
    for _ in range(3):
        pol.on_access("many_unimportant", 0.0, 0.1)  # 3 x 0.1
    pol.on_access("once_important", 0.0, 1.0)  # 1 x 1.0
    for _ in range(2):
        pol.on_access("twice_mid", 0.0, 0.4)  # 2 x 0.4
    assert pol.priority("many_unimportant", 0.0) == pytest.approx(0.3)
    assert pol.priority("twice_mid", 0.0) == pytest.approx(0.8)
    order = sorted(pol.keys(), key=lambda k: pol.sort_key(k, 0.0))
    assert order == ["many_unimportant", "twice_mid", "once_important"]


def test_unimportant_weight_counts_unselected_rows() -> None:
    pol = ScorePolicy(half_life_s=None, unimportant_weight=0.25)
    for _ in range(8):
        pol.on_access("hot_unselected", 0.0, 0.0)  # 8 x 0.25
    pol.on_access("cold_selected", 0.0, 1.0)  # 1 x 1.0
    pol.on_access("half", 0.0, 0.5)  # 1 x (0.25 + 0.75 x 0.5)
    assert pol.priority("hot_unselected", 0.0) == pytest.approx(2.0)
    assert pol.priority("half", 0.0) == pytest.approx(0.625)
    order = sorted(pol.keys(), key=lambda k: pol.sort_key(k, 0.0))
    assert order == ["half", "cold_selected", "hot_unselected"]
    # the policy's default weight is the configuration's
    from impress_cache import ImpressConfig

    assert ScorePolicy().unimportant_weight == ImpressConfig().unimportant_weight == 0.1
    for bad in (-0.1, 1.5, True, "0.5"):
        with pytest.raises(ValueError):
            ScorePolicy(unimportant_weight=bad)


def test_share_moving_average() -> None:
    pol = ScorePolicy(share_ema=0.25)
    pol.on_access("a", 0.0, 0.8)  # first observation sets the average
    assert pol.importance_share("a") == pytest.approx(0.8)
    pol.on_access("a", 0.0, 0.0)
    assert pol.importance_share("a") == pytest.approx(0.6)
    pol.on_access("a", 0.0, None)  # unknown counts as 1.0
    assert pol.importance_share("a") == pytest.approx(0.7)


def test_importance_classes_and_thresholds() -> None:
    pol = LRUPolicy()
    for k, s in (("h", 0.5), ("m", 0.2), ("l", 0.19)):
        pol.on_access(k, 0.0, s)
    assert [pol.importance_class(k) for k in "hml"] == ["high", "medium", "low"]
    assert pol.importance_class("never_seen") == "high"
    custom = LRUPolicy(high_threshold=0.8, low_threshold=0.4)
    custom.on_access("x", 0.0, 0.5)
    assert custom.importance_class("x") == "medium"
    with pytest.raises(ValueError):
        LRUPolicy(high_threshold=0.1, low_threshold=0.4)


def test_score_decay_halves_per_half_life() -> None:
    pol = ScorePolicy(half_life_s=10.0)
    pol.on_access("a", 0.0)
    pol.on_access("a", 0.0)
    assert pol.priority("a", 10.0) == pytest.approx(1.0)
    assert pol.priority("a", 30.0) == pytest.approx(0.25)
    pol.on_access("a", 30.0)  # 0.25 + 1
    assert pol.decayed_frequency("a", 30.0) == pytest.approx(1.25)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 5), st.floats(0, 1), st.sampled_from([0.0, 1.0, 7.5, 40.0])),
        min_size=2,
        max_size=40,
    ),
    st.floats(0, 200),
)
def test_score_sort_key_matches_priority_at_any_time(ops, later) -> None:
    pol = ScorePolicy(half_life_s=20.0)
    now = 0.0
    for key, share, dt in ops:
        now += dt
        pol.on_access(key, now, share)
    when = now + later
    keys = list(pol.keys())
    for a in keys:
        for b in keys:
            pa, pb = pol.priority(a, when), pol.priority(b, when)
            if pa < pb * (1 - 1e-9):
                assert pol.sort_key(a, 0.0) < pol.sort_key(b, 0.0)


def test_stats_roundtrip_with_rebased_clock() -> None:
    pol = ScorePolicy(half_life_s=100.0)
    pol.on_access("a", 1000.0, 0.3)
    pol.on_access("a", 1050.0, 0.5)
    saved = pol.stats_of("a", now=1100.0)
    assert saved["age_s"] == pytest.approx(50.0)
    fresh = ScorePolicy(half_life_s=100.0)
    fresh.load_stats("a", saved, now=5.0)  # new process, new clock origin
    assert fresh.priority("a", 5.0) == pytest.approx(pol.priority("a", 1100.0))
    assert fresh.importance_share("a") == pytest.approx(0.4)
    assert fresh.stats_of("a")["last_access"] == pytest.approx(-45.0)
    fresh.on_access("b", 6.0)
    assert fresh.stats_of("b")["seq"] > saved["seq"]
    fresh.forget("a")
    assert "a" not in fresh and fresh.stats_of("a")["count"] == 0
    with pytest.raises(ValueError):
        fresh.load_stats("c", {"share": 2.0})


def test_registry() -> None:
    assert set(POLICIES) == {"score", "lru", "lfu"}
    assert isinstance(make_policy("score", half_life_s=5.0), ScorePolicy)
    assert isinstance(make_policy("LRU"), LRUPolicy)
    with pytest.raises(ValueError, match="lfu, lru, score"):
        make_policy("fifo")


# ---------------------------------------------------------------------- manager basics
def test_constructor_validation() -> None:
    with pytest.raises(ValueError):
        TierManager(10, 10, LRUPolicy(), class_shares={"high": 0.5, "medium": 0.5, "low": 0.5})
    with pytest.raises(ValueError):
        TierManager(10, 10, LRUPolicy(), class_shares={"high": 1.0})
    with pytest.raises(ValueError):
        TierManager(-1, 10, LRUPolicy())
    mgr = TierManager(10, 0, LRUPolicy())
    with pytest.raises(TierError):
        mgr.put_from_disk("a", None, -3)
    with pytest.raises(TierError):
        mgr.used_bytes("gpu")


def test_tier_error_is_an_impress_error_under_every_import_path() -> None:
    import impress_cache
    from impress_cache import errors
    from impress_cache.tiers import manager, view

    assert TierError is errors.TierError is view.TierError is manager.TierError is impress_cache.TierError
    assert issubclass(TierError, errors.ImpressError) and issubclass(TierError, ValueError)
    with pytest.raises(errors.ImpressError):
        TierManager(10, 0, LRUPolicy()).used_bytes("gpu")


@pytest.mark.parametrize(
    ("policy", "expected_victim"),
    [("lru", "b"), ("lfu", "c"), ("score", "a")],
)
def test_eviction_order_in_manager(policy: str, expected_victim: str) -> None:
    clock = FakeClock()
    shares = {"high": 1.0, "medium": 0.0, "low": 0.0}  # every block is a candidate
    paper = {"unimportant_weight": 0.0} if policy == "score" else {}  # the paper's score
    mgr = TierManager(0, 300, make_policy(policy, **paper), class_shares=shares, clock=clock)
    # a: 3 accesses x share 0.3 = 0.9, b: 2 x 1.0 = 2 (least recent), c: 1 x 1.0 = 1
    plan = [("a", 0.3), ("b", 1.0), ("a", 0.3), ("b", 1.0), ("a", 0.3), ("c", 1.0)]
    for k, s in plan:
        mgr.touch(k, s)
        if mgr.tier_of(k) is None:
            assert mgr.put_from_disk(k, k, 100) == HOST
    mgr.touch("d", 1.0)
    mgr.touch("d", 1.0)
    mgr.touch("d", 1.0)  # d beats every resident block under all three policies
    assert mgr.put_from_disk("d", "d", 100) == HOST
    assert set(mgr.blocks(HOST)) == {"a", "b", "c", "d"} - {expected_victim}
    assert mgr.stats()["host"]["evictions"] == 1


def test_time_decay_lets_old_hot_block_go() -> None:
    clock = FakeClock()
    mgr = TierManager(0, 100, ScorePolicy(half_life_s=60.0), clock=clock)
    for _ in range(10):
        mgr.touch("old_hot", 1.0)
    assert mgr.put_from_disk("old_hot", "x", 100) == HOST
    clock.advance(60.0)  # old_hot: 5.0
    mgr.touch("new", 1.0)
    assert mgr.put_from_disk("new", "y", 100) is None  # 1.0 < 5.0: refused
    clock.advance(4 * 60.0)  # old_hot: 10 / 32 = 0.31; new: 1 / 16
    mgr.touch("new", 1.0)  # new: 1.06
    assert mgr.put_from_disk("new", "y", 100) == HOST
    assert mgr.tier_of("old_hot") is None


def test_without_decay_a_stale_block_stays() -> None:
    clock = FakeClock()
    mgr = TierManager(0, 100, ScorePolicy(half_life_s=None), clock=clock)
    for _ in range(10):
        mgr.touch("old_hot", 1.0)
    mgr.put_from_disk("old_hot", "x", 100)
    clock.advance(1e6)
    for _ in range(5):
        mgr.touch("new", 1.0)
    assert mgr.put_from_disk("new", "y", 100) is None


def test_decay_heap_finds_true_minimum_after_time_passes() -> None:
    clock = FakeClock()
    mgr = TierManager(0, 300, ScorePolicy(half_life_s=10.0), clock=clock)
    for _ in range(8):
        mgr.touch("early", 1.0)  # 8 at t=0
    mgr.put_from_disk("early", 0, 100)
    clock.advance(20.0)
    for _ in range(3):
        mgr.touch("mid", 1.0)  # 3 at t=20; early is 2 now
    mgr.put_from_disk("mid", 0, 100)
    clock.advance(10.0)
    mgr.touch("late", 1.0)  # 1 at t=30; early 1.0, mid 1.5: tie early/late
    mgr.touch("late", 1.0)
    mgr.put_from_disk("late", 0, 100)
    clock.advance(10.0)  # early 0.5, mid 0.75, late 1.0
    for _ in range(2):
        mgr.touch("new", 1.0)
    assert mgr.put_from_disk("new", 0, 100) == HOST
    assert set(mgr.blocks(HOST)) == {"mid", "late", "new"}


# ---------------------------------------------------------------------- class shares
@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_low_burst_cannot_evict_high_within_share(policy: str) -> None:
    clock = FakeClock()
    mgr = TierManager(0, 1000, make_policy(policy, share_ema=1.0), clock=clock)
    high = [f"h{i}" for i in range(3)]  # 300 bytes = exactly the high share
    fill_host(mgr, high, share=0.9)
    assert mgr.class_bytes(HOST)["high"] == 300
    for i in range(60):
        k = f"l{i}"
        for _ in range(20):  # very hot, very recent: beats the high blocks on priority
            mgr.touch(k, 0.05)
        clock.advance(1.0)
        mgr.put_from_disk(k, k, 100)
        mgr._check_invariants()
    assert set(high) <= set(mgr.blocks(HOST))
    assert mgr.class_bytes(HOST) == {"high": 300, "medium": 0, "low": 700}
    assert mgr.used_bytes(HOST) == 1000


def test_class_within_share_reclaims_borrowed_space() -> None:
    mgr = TierManager(0, 1000, LRUPolicy(share_ema=1.0), clock=FakeClock())
    fill_host(mgr, [f"h{i}" for i in range(10)], share=0.9)  # high borrows everything
    assert mgr.class_bytes(HOST)["high"] == 1000
    mgr.touch("low", 0.0)
    assert mgr.put_from_disk("low", "x", 100) == HOST
    assert "h0" not in mgr  # least recent high block was over share: it goes
    assert mgr.class_bytes(HOST) == {"high": 900, "medium": 0, "low": 100}


def test_own_class_is_a_candidate_but_protected_classes_are_not() -> None:
    mgr = TierManager(0, 1000, LRUPolicy(share_ema=1.0), clock=FakeClock())
    fill_host(mgr, ["h0", "h1", "h2"], share=0.9)  # 300: high at share
    fill_host(mgr, [f"m{i}" for i in range(5)], share=0.3)  # 500: medium at share
    fill_host(mgr, ["l0", "l1"], share=0.0)  # 200: low at share
    mgr.touch("l2", 0.0)
    assert mgr.put_from_disk("l2", "x", 100) == HOST
    assert "l0" not in mgr and {"h0", "m0", "l1", "l2"} <= set(mgr.blocks())
    mgr.touch("big_low", 0.0)
    assert mgr.put_from_disk("big_low", "x", 300) is None  # only 200 bytes of low exist
    assert mgr.used_bytes(HOST) == 1000


def test_borrower_stops_losing_blocks_once_back_within_share() -> None:
    mgr = TierManager(0, 1000, LRUPolicy(share_ema=1.0), clock=FakeClock())
    fill_host(mgr, [f"h{i}" for i in range(4)], share=0.9)  # 400: high 100 over share
    fill_host(mgr, [f"m{i}" for i in range(4)], share=0.3)  # 400: medium within share
    fill_host(mgr, ["l0", "l1"], share=0.0)  # 200: low at share
    mgr.touch("big_low", 0.0)
    assert mgr.put_from_disk("big_low", "x", 200) == HOST
    # h0 (oldest, over share) goes; then high is at its share, so the own class pays
    assert set(mgr.blocks()) == {"h1", "h2", "h3", "m0", "m1", "m2", "m3", "l1", "big_low"}
    assert mgr.class_bytes(HOST) == {"high": 300, "medium": 400, "low": 300}


def test_reclassification_on_touch_moves_bytes() -> None:
    mgr = TierManager(0, 1000, ScorePolicy(share_ema=1.0), clock=FakeClock())
    fill_host(mgr, ["a"], share=0.9)
    assert mgr.class_bytes(HOST)["high"] == 100
    mgr.touch("a", 0.1)
    assert mgr.class_bytes(HOST) == {"high": 0, "medium": 0, "low": 100}
    mgr._check_invariants()


# ---------------------------------------------------------------------- promotion
def test_host_hit_with_higher_priority_is_promoted() -> None:
    clock = FakeClock()
    mgr = TierManager(100, 300, ScorePolicy(), clock=clock)
    mgr.touch("cold", 1.0)
    mgr.put_from_disk("cold", ("host", "cold"), 100)
    assert mgr.get("cold") == (DEVICE, ("host", "cold"))  # device was empty: promoted
    mgr.touch("hot", 1.0)
    mgr.put_from_disk("hot", ("host", "hot"), 100)
    mgr.touch("hot", 1.0)
    mgr.touch("hot", 1.0)
    tier, _ = mgr.get("hot")
    assert tier == DEVICE and mgr.tier_of("hot") == DEVICE
    assert mgr.tier_of("cold") == HOST  # demoted, not dropped
    s = mgr.stats()
    assert s["promotions"] == 2 and s["bytes_promoted"] == 200
    assert s["demotions"] == 1 and s["bytes_demoted"] == 100
    assert s["host"]["hits"] == 2 and s["device"]["hits"] == 0
    assert s["device"]["evictions"] == 1


def test_host_hit_with_lower_priority_stays_in_host() -> None:
    mgr = TierManager(100, 300, ScorePolicy(), clock=FakeClock())
    for _ in range(5):
        mgr.touch("hot", 1.0)
    mgr.put_from_disk("hot", "h", 100)
    assert mgr.get("hot")[0] == DEVICE
    mgr.touch("cold", 1.0)
    mgr.put_from_disk("cold", "c", 100)
    assert mgr.get("cold") == (HOST, "c")
    assert mgr.tier_of("hot") == DEVICE and mgr.stats()["promotions"] == 1


def test_transforms_and_disk_to_device() -> None:
    to_dev = lambda p: ("dev", p[1])  # noqa: E731
    to_host = lambda p: ("host", p[1])  # noqa: E731
    mgr = TierManager(
        100, 100, LRUPolicy(), clock=FakeClock(), to_device=to_dev, to_host=to_host,
        disk_to_device=True,
    )
    assert mgr.put_from_disk("a", ("host", "a"), 100) == DEVICE
    assert mgr.get("a") == (DEVICE, ("dev", "a"))
    mgr.touch("b")
    assert mgr.put_from_disk("b", ("host", "b"), 100) == DEVICE
    assert mgr.get("a") == (HOST, ("host", "a"))  # demoted through to_host
    mgr.touch("c")
    assert mgr.put_from_disk("c", ("host", "c"), 100) == DEVICE
    assert mgr.tier_of("a") is None and mgr.tier_of("b") == HOST


def test_host_budget_zero_uses_device() -> None:
    mgr = TierManager(100, 0, LRUPolicy(), clock=FakeClock())
    assert mgr.put_from_disk("a", "x", 60) == DEVICE
    assert mgr.put_from_disk("b", "y", 60) == DEVICE
    assert mgr.tier_of("a") is None  # dropped: no host to demote to
    assert mgr.put_from_disk("big", "z", 101) is None
    both_off = TierManager(0, 0, LRUPolicy())
    assert both_off.put_from_disk("a", "x", 0) is None


def test_failing_transform_refuses_cleanly() -> None:
    def boom(_payload):
        raise MemoryError("device full")

    mgr = TierManager(100, 100, LRUPolicy(), clock=FakeClock(), to_device=boom)
    mgr.put_from_disk("a", "x", 50)
    assert mgr.get("a") == (HOST, "x")
    mgr._check_invariants()


# ---------------------------------------------------------------------- removal, batches
def test_evict_and_drop() -> None:
    mgr = TierManager(0, 200, LRUPolicy(), clock=FakeClock())
    fill_host(mgr, ["a", "b"])
    assert mgr.evict("a") and not mgr.evict("a")
    assert "a" in mgr.policy  # evict keeps the statistics
    assert mgr.drop("b") and "b" not in mgr.policy
    assert mgr.drop("zz") is False
    assert mgr.blocks() == []


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 9), max_size=12), st.lists(st.integers(0, 14), max_size=15))
def test_drop_many_equals_evicting_and_forgetting_each(resident: list[int], dropped: list[int]) -> None:
    """`drop_many` (the blocks of deleted files, under one hold of the lock; `drop` is one
    key of it) leaves the manager as evicting each key from memory and forgetting its
    size and statistics does, known or not, resident or not."""
    managers = [TierManager(150, 200, ScorePolicy(), clock=FakeClock()) for _ in range(2)]
    for mgr in managers:
        for k in resident:
            mgr.touch(k, 0.5)
            mgr.put_from_disk(k, k, 50)
        mgr.touch(12, 0.3)  # statistics, never resident
    one, many = managers
    removed = 0
    for k in dropped:
        removed += one.evict(k)
        one._sizes.pop(k, None)
        one.policy.forget(k)
    assert many.drop_many(dropped) == removed
    assert sorted(many.blocks(), key=str) == sorted(one.blocks(), key=str)
    assert set(many.policy.keys()) == set(one.policy.keys())
    assert many.stats() == one.stats()
    many._check_invariants()


def test_batch_lookup_and_admit_equal_single_calls() -> None:
    """lookup/admit of one key are touch+get and put_from_disk (lookup reports the tier
    the block was found in)."""
    clock_a, clock_b = FakeClock(), FakeClock()
    a = TierManager(150, 200, ScorePolicy(), clock=clock_a)
    b = TierManager(150, 200, ScorePolicy(), clock=clock_b)
    rng = random.Random(0)
    for step in range(200):
        k, share = rng.randrange(12), rng.random()
        (got_a,) = a.lookup([k], [share], [50])
        b.touch(k, share)
        found = b.tier_of(k)
        hit = b.get(k, 50)
        assert got_a == (None if hit is None else (found, hit[1]))
        if got_a is None:
            assert a.admit([(k, k, 50, share)]) == [b.put_from_disk(k, k, 50, share)]
        clock_a.advance(1.0)
        clock_b.advance(1.0)
    assert a.stats() == b.stats()
    a._check_invariants()


class EagerLookup(TierManager):
    """`lookup` as it was before accesses were deferred: each key touched, then looked up,
    at once (the specification the deferred version must match)."""

    def lookup(self, keys, shares, sizes):  # type: ignore[no-untyped-def]
        with self._lock, self._protecting(keys):
            now = self._now()
            out = []
            for key, share, size in zip(keys, shares, sizes):
                self._touch(key, share, now)
                entry = self._where.get(key)
                found = None if entry is None else entry.tier
                hit = self._get(key, size, now, sync=False)
                out.append(None if hit is None or found is None else (found, hit[1]))
            return out


@settings(max_examples=80, deadline=None)
@given(
    steps=st.lists(
        st.tuples(
            st.lists(st.integers(0, 15), min_size=1, max_size=6, unique=True),
            st.floats(0.0, 1.0),
            st.sampled_from(["admit", "settle", "export", "evict", "touch", "none"]),
            st.floats(0.0, 30.0),
        ),
        max_size=40,
    ),
    policy=st.sampled_from(["lru", "lfu", "score"]),
    host=st.sampled_from([0, 200]),
)
def test_deferred_accesses_change_nothing(steps, policy: str, host: int) -> None:
    """`lookup` records device hits and misses and applies them later (`TouchLog`): every
    answer, residency, counter and statistic equals applying each access at once,
    whatever comes in between (host hits, admissions, evictions, time)."""
    ca, cb = FakeClock(), FakeClock()
    a = TierManager(150, host, make_policy(policy), clock=ca)
    b = EagerLookup(150, host, make_policy(policy), clock=cb)
    for keys, share, op, dt in steps:
        got = a.lookup(keys, [share] * len(keys), [50] * len(keys))
        assert got == b.lookup(keys, [share] * len(keys), [50] * len(keys))
        misses = [(k, f"p{k}", 50, share) for k, g in zip(keys, got) if g is None]
        if op == "admit":
            assert a.admit(misses, protect=keys) == b.admit(misses, protect=keys)
        elif op == "settle":
            a.settle()
        elif op == "export":
            assert a.export_stats() == b.export_stats()
        elif op == "evict":
            assert a.evict(keys[0]) == b.evict(keys[0])
        elif op == "touch":
            a.touch(keys[-1], share)
            b.touch(keys[-1], share)
        ca.advance(dt)
        cb.advance(dt)
    assert a.stats() == b.stats()
    for tier in (DEVICE, HOST):
        assert sorted(map(str, a.blocks(tier))) == sorted(map(str, b.blocks(tier)))
    assert a.export_stats() == b.export_stats()
    assert a.pending_accesses == 0  # every call above applied what was pending
    a._check_invariants()


def test_lookup_defers_device_hits_and_settle_applies_them() -> None:
    mgr = TierManager(300, 0, LFUPolicy(), clock=FakeClock())
    assert mgr.admit([(k, k, 100, 1.0) for k in "abc"]) == [DEVICE] * 3
    assert mgr.lookup(["a", "b", "z"], [1.0] * 3, [100] * 3) == [(DEVICE, "a"), (DEVICE, "b"), None]
    assert mgr.pending_accesses == 3  # recorded, not applied: the request path paid only lookups
    assert mgr.settle() == 3 and mgr.pending_accesses == 0
    stats = mgr.export_stats()
    assert stats["a"]["count"] == stats["b"]["count"] == stats["z"]["count"] == 1  # each looked up once
    assert stats["c"]["count"] == 0


def test_a_failing_recorded_access_is_kept_and_retried() -> None:
    from impress_cache.tiers.touchlog import TouchLog

    seen, fail = [], {"b"}

    def apply(key, share, now):
        if key in fail:
            raise RuntimeError(key)
        seen.append(key)

    log = TouchLog(apply)
    with log.raw:
        log.record([("a", 1.0, 0.0), ("b", 1.0, 0.0), ("c", 1.0, 0.0)])
    with pytest.raises(RuntimeError):
        with log:
            pass
    assert seen == ["a"] and log.pending == 2  # b and c stay recorded, in order
    fail.clear()
    with log:
        pass
    assert seen == ["a", "b", "c"] and log.pending == 0


def test_a_batch_never_evicts_its_own_blocks() -> None:
    """Admitting the misses of a request never evicts the request's other blocks."""
    mgr = TierManager(0, 200, LRUPolicy(), class_shares={"high": 1.0, "medium": 0.0, "low": 0.0}, clock=FakeClock())
    fill_host(mgr, ["old", "hit"])  # "old" is not part of the request: the only allowed victim
    mgr.lookup(["hit", "x", "y"], [1.0] * 3, [100] * 3)
    assert mgr.admit([("x", "x", 100, 1.0), ("y", "y", 100, 1.0)], protect=["hit"]) == [HOST, None]
    assert set(mgr.blocks(HOST)) == {"hit", "x"}  # y would have needed "hit" or "x": refused
    # without protection the same admission evicts the request's own hit
    other = TierManager(0, 200, LRUPolicy(), class_shares={"high": 1.0, "medium": 0.0, "low": 0.0}, clock=FakeClock())
    fill_host(other, ["old", "hit"])
    other.lookup(["hit", "x", "y"], [1.0] * 3, [100] * 3)
    assert other.put_from_disk("x", "x", 100) == HOST and other.put_from_disk("y", "y", 100) == HOST
    assert "hit" not in other
    mgr._check_invariants()


def test_stats_and_reset() -> None:
    mgr = TierManager(100, 100, LRUPolicy(), clock=FakeClock())
    assert mgr.get("a", nbytes=40) is None
    mgr.put_from_disk("a", "x", 40)
    assert mgr.get("a")[0] == DEVICE  # host hit, promoted
    assert mgr.get("a")[0] == DEVICE  # device hit
    assert mgr.get("zz") is None  # unknown size: 0 bytes
    s = mgr.stats()
    assert s["gets"] == 4
    assert s["memory"] == {
        "hits": 2, "misses": 2, "hit_ratio": 0.5, "hit_bytes": 80, "miss_bytes": 40,
        "byte_hit_ratio": pytest.approx(2 / 3),
    }
    assert s["device"]["hits"] == 1 and s["device"]["misses"] == 3
    assert s["host"]["hit_ratio"] == 0.25
    assert s["bytes_admitted_from_disk"] == 40
    mgr.reset_stats()
    s = mgr.stats()
    assert s["gets"] == 0 and s["memory"]["hits"] == 0 and s["device"]["used_bytes"] == 40


# ---------------------------------------------------------------------- heap correctness
@settings(max_examples=80, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["touch", "put", "adv"]),
            st.integers(0, 9),
            st.floats(0.0, 1.0),
        ),
        max_size=80,
    ),
    st.sampled_from(sorted(POLICIES)),
)
def test_victims_are_the_true_minimum(ops, policy: str) -> None:
    """Brute-force reference: evicted blocks are the lowest-priority ones."""
    clock = FakeClock()
    pol = make_policy(policy, half_life_s=30.0) if policy == "score" else make_policy(policy)
    # One class gets the whole budget so that every block is a candidate.
    mgr = TierManager(
        0, 250, pol, class_shares={"high": 1.0, "medium": 0.0, "low": 0.0}, clock=clock
    )
    sizes = {k: 40 + 10 * (k % 3) for k in range(10)}
    for op, k, x in ops:
        if op == "touch":
            mgr.touch(k)  # share 1.0: class "high" for all
        elif op == "adv":
            clock.advance(x * 60.0)
        elif op == "put" and k not in mgr:
            now = clock()
            before = set(mgr.blocks(HOST))
            tier = mgr.put_from_disk(k, k, sizes[k])
            after = set(mgr.blocks(HOST))
            evicted = before - after
            free = 250 - sum(sizes[b] for b in before)
            cands = sorted(
                before,
                key=lambda b: (pol.priority(b, now), pol.stats_of(b)["seq"]),
            )
            if tier is None:
                assert evicted == set()
            if evicted:
                worst = max(pol.priority(b, now) for b in evicted)
                kept = [pol.priority(b, now) for b in cands if b not in evicted]
                assert all(worst <= p * (1 + 1e-9) + 1e-12 for p in kept)
                assert worst <= pol.priority(k, now) * (1 + 1e-9) + 1e-12
                assert free + sum(sizes[b] for b in evicted) >= sizes[k]
                # minimal: the space was still short before the last victim went
                last = max(evicted, key=lambda b: pol.sort_key(b, now))
                assert free + sum(sizes[b] for b in evicted) - sizes[last] < sizes[k]
            if tier is None and free < sizes[k]:
                # refused: no prefix of the candidates beaten by k frees enough space
                pk = pol.sort_key(k, now)
                got = free
                for b in cands:
                    if not pol.sort_key(b, now) < pk:
                        break
                    got += sizes[b]
                assert got < sizes[k]
        mgr._check_invariants()


class AgePolicy(EvictionPolicy):
    """Policy whose order changes with time: count divided by age."""

    name = "age"
    time_invariant_order = False

    def priority(self, key: Hashable, now: float) -> float:
        stats = self.stats_of(key)
        return stats["count"] / (1.0 + now - stats["last_access"])


def test_time_variant_policy_is_rekeyed_before_eviction() -> None:
    clock = FakeClock()
    mgr = TierManager(0, 200, AgePolicy(), clock=clock)
    for _ in range(4):
        mgr.touch("a")  # 4 at t=0
    mgr.put_from_disk("a", "a", 100)
    clock.advance(1.0)
    mgr.touch("b")  # 1 at t=1. At t=1: a 2.0 > b 1.0
    mgr.put_from_disk("b", "b", 100)
    clock.advance(100.0)  # a 4/102 = 0.039, b 1/101 = 0.0099: b still lower
    mgr.touch("b")
    mgr.touch("b")  # b 3/1 = 3.0 now, a 0.039
    mgr.touch("c")
    mgr.touch("c")  # c 2.0 beats a
    assert mgr.put_from_disk("c", "c", 100) == HOST
    assert set(mgr.blocks()) == {"b", "c"}
    mgr._check_invariants()


# ---------------------------------------------------------------------- threads
def test_concurrent_use_keeps_invariants() -> None:
    mgr = TierManager(500, 1000, ScorePolicy())
    errors: list[BaseException] = []

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for _ in range(400):
                k = rng.randrange(40)
                mgr.touch(k, rng.random())
                if mgr.get(k) is None:
                    mgr.put_from_disk(k, k, 50 + k)
                if rng.random() < 0.1:
                    mgr.evict(k)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    mgr._check_invariants()
    assert mgr.stats()["gets"] == 1600


# ---------------------------------------------------------------------- stateful model
SIZES = {k: 10 + (k * 37) % 90 for k in range(12)}
KEYS = st.integers(0, 11)
SHARES = st.one_of(st.none(), st.floats(0.0, 1.0))


def _walk_numbers(obj, path=""):
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _walk_numbers(v, f"{path}.{k}")
    elif isinstance(obj, (int, float)):
        yield path, obj


class TierMachine(RuleBasedStateMachine):
    """Random operations against a model: disk = dict of every stored block."""

    @initialize(
        policy=st.sampled_from(sorted(POLICIES)),
        device=st.sampled_from([0, 60, 150, 300]),
        host=st.sampled_from([0, 100, 250, 500]),
        shares=st.sampled_from(
            [{"high": 0.3, "medium": 0.5, "low": 0.2}, {"high": 1.0, "medium": 0.0, "low": 0.0},
             {"high": 0.2, "medium": 0.2, "low": 0.6}]
        ),
        disk_to_device=st.booleans(),
    )
    def setup(self, policy, device, host, shares, disk_to_device) -> None:
        self.clock = FakeClock()
        kw = {"half_life_s": 100.0} if policy == "score" else {}
        self.mgr = TierManager(
            device, host, make_policy(policy, **kw), class_shares=shares, clock=self.clock,
            to_device=lambda p: (DEVICE, p[1]), to_host=lambda p: (HOST, p[1]),
            disk_to_device=disk_to_device,
        )
        self.disk: dict[int, int] = {}
        self.gets = 0

    @rule(k=KEYS, share=SHARES)
    def put_from_disk(self, k, share) -> None:
        self.disk[k] = SIZES[k]
        tier = self.mgr.put_from_disk(k, (HOST, k), SIZES[k], share)
        assert tier is None or self.mgr.tier_of(k) == tier

    @rule(k=KEYS)
    def get(self, k) -> None:
        self.gets += 1
        res = self.mgr.get(k)
        if res is not None:
            tier, payload = res
            assert k in self.disk
            assert payload == (tier, k)
            assert self.mgr.tier_of(k) == tier

    @rule(k=KEYS, share=SHARES)
    def touch(self, k, share) -> None:
        self.mgr.touch(k, share)

    @rule(k=KEYS)
    def drop(self, k) -> None:
        was = k in self.mgr
        assert self.mgr.drop(k) == was
        self.disk.pop(k, None)
        assert k not in self.mgr

    @rule(k=KEYS)
    def evict(self, k) -> None:
        self.mgr.evict(k)
        assert k not in self.mgr

    @rule(dt=st.sampled_from([0.0, 1.0, 50.0, 400.0]))
    def advance(self, dt) -> None:
        self.clock.advance(dt)

    @invariant()
    def consistent(self) -> None:
        mgr = self.mgr
        mgr._check_invariants()
        dev, host = set(mgr.blocks(DEVICE)), set(mgr.blocks(HOST))
        assert not dev & host
        for tier, keys in ((DEVICE, dev), (HOST, host)):
            used = mgr.used_bytes(tier)
            assert used <= mgr.budget(tier)
            assert used == sum(SIZES[k] for k in keys)
        # resident blocks are stored blocks; every stored block is readable
        assert dev | host <= set(self.disk)
        for k in self.disk:
            assert mgr.tier_of(k) in (DEVICE, HOST, None)  # None: read from disk
            if k in mgr:
                assert mgr.nbytes_of(k) == SIZES[k]
        s = mgr.stats()
        for path, value in _walk_numbers(s):
            assert value >= 0, path
        assert s["gets"] == self.gets
        assert s["memory"]["hits"] + s["memory"]["misses"] == self.gets
        for tier in (DEVICE, HOST):
            assert s[tier]["hits"] + s[tier]["misses"] == self.gets
            assert 0.0 <= s[tier]["hit_ratio"] <= 1.0
            assert 0.0 <= s[tier]["byte_hit_ratio"] <= 1.0


TestTierMachine = TierMachine.TestCase
TestTierMachine.settings = settings(max_examples=120, stateful_step_count=40, deadline=None)


def test_math_sanity_of_default_shares() -> None:
    mgr = TierManager(1000, 0, LRUPolicy())
    assert math.isclose(sum(mgr.class_shares.values()), 1.0)


def test_a_bad_share_fails_its_lookup_and_leaves_the_manager_usable() -> None:
    mgr = TierManager(1000, 0, LRUPolicy())
    mgr.put_from_disk("a", "A", 10, 1.0)
    with pytest.raises((TypeError, ValueError)):
        mgr.lookup(["a"], ["x"], [10])
    assert mgr.pending_accesses == 0  # nothing of it was recorded
    assert mgr.lookup(["a"], [1.0], [10]) == [(DEVICE, "A")]
    assert len(mgr) == 1 and mgr.stats()

