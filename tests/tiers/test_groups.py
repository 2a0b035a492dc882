"""Groups of resident blocks sharing one payload storage (impress_cache.tiers.groups)."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from impress_cache.tiers import DEVICE, HOST, TierManager
from impress_cache.tiers.policies import make_policy


class Payload:
    """A payload that says whether it is a view of a shared slab or has its own storage."""

    def __init__(self, name: str, shared: bool = True) -> None:
        self.name, self.shared = name, shared


def own(p: Payload) -> Payload:
    OWNED.append(p.name)
    return Payload(p.name, shared=False)


OWNED: list[str] = []


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _mgr(device=10_000, host=0, policy="lru", clock=None) -> TierManager:
    return TierManager(device, host, make_policy(policy), clock=clock or Clock(), own=own)


def _admit_group(mgr: TierManager, group, keys, nbytes=100) -> list[Payload]:
    payloads = [Payload(str(k)) for k in keys]
    mgr.admit([(k, p, nbytes, 1.0) for k, p in zip(keys, payloads)])
    assert mgr.bind_group(group, keys, payloads, data=("slab", group))
    return payloads


def test_a_group_hit_counts_and_records_every_member():
    mgr = _mgr()
    keys = [("f", i) for i in range(5)]
    _admit_group(mgr, "g", keys)
    mgr.reset_stats()
    hit = mgr.group_hit("g", 1, 4, 0.5)
    assert hit == (("slab", "g"), DEVICE, tuple(keys[1:4]))
    assert mgr.pending_accesses == 3  # recorded, not applied yet
    s = mgr.stats()  # (entering the lock applies them)
    assert mgr.pending_accesses == 0
    assert s["gets"] == 3 and s["device"]["hits"] == 3 and s["device"]["hit_bytes"] == 300
    counts = {k: r["count"] for k, r in mgr.export_stats(keys).items()}
    assert counts == {keys[0]: 0, keys[1]: 1, keys[2]: 1, keys[3]: 1, keys[4]: 0}
    assert mgr.group_hit("g", 3, 6) is None  # outside the group


def test_a_group_hit_records_what_a_lookup_of_the_same_blocks_records():
    a, b = _mgr(policy="score"), _mgr(policy="score")
    keys = [("f", i) for i in range(4)]
    _admit_group(a, "g", keys)
    b.admit([(k, Payload(str(k)), 100, 1.0) for k in keys])
    for t in (1.0, 5.0, 9.0):
        a._clock.t = b._clock.t = t  # type: ignore[attr-defined]
        assert a.group_hit("g", 0, 4, 0.75) is not None
        assert all(h is not None for h in b.lookup(keys, [0.75] * 4, [100] * 4))
    assert a.export_stats(keys) == b.export_stats(keys)
    assert a.stats() == b.stats()


def test_evicting_one_member_dissolves_the_group_and_the_rest_get_their_own_payloads():
    OWNED.clear()
    mgr = _mgr()
    keys = [("f", i) for i in range(4)]
    payloads = _admit_group(mgr, "g", keys)
    assert mgr.evict(keys[2])
    assert mgr.group_hit("g", 0, 2) is None and not mgr.group_intact("g")
    for k, p in zip(keys, payloads):
        if k == keys[2]:
            assert mgr.tier_of(k) is None
            continue
        now = mgr.get(k)
        assert now is not None and now[1] is not p and not now[1].shared and now[1].name == p.name
    assert mgr.group_count == 0


def test_dropping_every_member_copies_nothing():
    OWNED.clear()
    mgr = _mgr()
    keys = [("f", i) for i in range(4)]
    _admit_group(mgr, "g", keys)
    assert mgr.drop_where(lambda k: k[0] == "f") == 4
    assert OWNED == [] and mgr.group_hit("g", 0, 4) is None
    assert mgr.used_bytes(DEVICE) == 0


def test_dropping_some_members_copies_only_the_rest():
    OWNED.clear()
    mgr = _mgr()
    keys = [("f", i) for i in range(4)]
    _admit_group(mgr, "g", keys)
    mgr.drop_many(keys[:1])
    assert sorted(OWNED) == sorted(str(k) for k in keys[1:])


def test_binding_fails_unless_every_member_is_resident_with_its_payload():
    OWNED.clear()
    mgr = _mgr(device=250)  # room for two blocks of 100
    keys = [("f", i) for i in range(3)]
    payloads = [Payload(str(k)) for k in keys]
    mgr.admit([(k, p, 100, 1.0) for k, p in zip(keys, payloads)])
    assert not mgr.bind_group("g", keys, payloads, data="slab")
    resident = [k for k in keys if mgr.tier_of(k) is not None]
    assert len(resident) == 2
    assert sorted(OWNED) == sorted(str(k) for k in resident)  # nothing keeps the slab alive
    assert mgr.group_hit("g", 0, 1) is None


def test_a_block_already_resident_with_another_payload_is_not_bound():
    mgr = _mgr()
    keys = [("f", 0), ("f", 1)]
    mgr.admit([(keys[0], Payload("old", shared=False), 100, 1.0)])
    payloads = [Payload("a"), Payload("b")]
    mgr.admit([(k, p, 100, 1.0) for k, p in zip(keys, payloads)])
    assert not mgr.bind_group("g", keys, payloads, data="slab")
    assert mgr.get(keys[0])[1].name == "old"


def test_a_host_group_is_left_to_per_block_lookups_when_the_device_has_a_budget():
    mgr = TierManager(100, 10_000, make_policy("lru"), clock=Clock(), own=own, disk_to_device=False)
    keys = [("f", i) for i in range(3)]
    _admit_group(mgr, "g", keys)
    assert {mgr.tier_of(k) for k in keys} == {HOST}
    assert mgr.group_hit("g", 0, 3) is None  # a lookup may promote
    host_only = TierManager(0, 10_000, make_policy("lru"), clock=Clock(), own=own)
    _admit_group(host_only, "g", keys)
    assert host_only.group_hit("g", 0, 3)[1] == HOST


def test_a_promotion_dissolves_the_group():
    clock = Clock()
    mgr = TierManager(1000, 10_000, make_policy("lru"), clock=clock, own=own, disk_to_device=False)
    keys = [("f", i) for i in range(3)]
    payloads = _admit_group(mgr, "g", keys)
    hit = mgr.lookup(keys[:1], [1.0], [100])[0]
    assert hit is not None and mgr.tier_of(keys[0]) == DEVICE
    assert mgr.group_hit("g", 0, 3) is None
    assert not mgr.get(keys[0])[1].shared and mgr.get(keys[1])[1] is not payloads[1]


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**31), st.sampled_from(["score", "lru", "lfu"]), st.booleans())
def test_budgets_hold_and_no_dissolved_group_is_served(seed, policy, two_tiers):
    """Random admissions of grouped runs, hits, evictions and drops: the tiers stay within
    their budgets and consistent, an intact group's members are resident with their
    slab payloads, and a group hit is never served after a member changed."""
    rng = random.Random(seed)
    clock = Clock()
    mgr = TierManager(1200, 1500 if two_tiers else 0, make_policy(policy), clock=clock, own=own)
    bound: dict[str, list[tuple[str, int]]] = {}
    for step in range(120):
        clock.t += rng.random()
        op = rng.random()
        if op < 0.4:
            g = f"g{rng.randrange(8)}"
            keys = [(g, i) for i in range(rng.randrange(1, 6))]
            payloads = [Payload(f"{g}/{i}") for i in range(len(keys))]
            mgr.admit([(k, p, 100, rng.random()) for k, p in zip(keys, payloads)])
            if mgr.bind_group(g, keys, payloads, data=g):
                bound[g] = keys
        elif op < 0.7 and bound:
            g = rng.choice(sorted(bound))
            n = len(bound[g])
            hit = mgr.group_hit(g, 0, n, rng.random())
            if hit is not None:
                assert hit[0] == g and all(mgr.tier_of(k) == hit[1] for k in hit[2])
        elif op < 0.85:
            mgr.evict((f"g{rng.randrange(8)}", rng.randrange(5)))
        else:
            mgr.drop_where(lambda k, g=f"g{rng.randrange(8)}": k[0] == g)
        mgr._check_invariants()
        assert mgr.used_bytes(DEVICE) <= 1200 and mgr.used_bytes(HOST) <= (1500 if two_tiers else 0)
        for g in list(bound):
            if mgr.group_intact(g):
                for k in bound[g]:
                    got = mgr._where[k]  # (no access)
                    assert got.payload.shared and got.payload.name == f"{k[0]}/{k[1]}"
            else:
                for k in bound[g]:
                    e = mgr._where.get(k)
                    assert e is None or not e.payload.shared  # nothing keeps the slab alive
                del bound[g]


def test_regroup_binds_resident_blocks_in_no_group_with_new_payloads():
    mgr = _mgr()
    keys = [("f", i) for i in range(3)]
    old = [Payload(str(k), shared=False) for k in keys]
    mgr.admit([(k, p, 100, 1.0) for k, p in zip(keys, old)])
    used = mgr.used_bytes(DEVICE)

    def make(current):
        assert [p.name for p in current] == [p.name for p in old]
        return [Payload(p.name) for p in current], "slab"

    assert mgr.regroup("g", keys, make)
    assert mgr.group_hit("g", 0, 3)[0] == "slab" and mgr.used_bytes(DEVICE) == used
    assert all(mgr.get(k)[1].shared for k in keys)
    assert not mgr.regroup("h", keys[1:], make)  # already in a group
    mgr.evict(keys[0])
    assert not mgr.regroup("g2", keys, make)  # one is not resident
    mgr._check_invariants()
