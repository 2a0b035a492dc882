"""The memory tiers wired into the store: hits, budgets, disk budget, statistics, warm-up."""

from __future__ import annotations

import logging
import time

import pytest
import torch

import impress_cache.store.gc as gc_mod
import impress_cache.store.leases as leases_mod
from conftest import VOCAB, tiny_model
from helpers import assert_same_as_uncached, run, store_dense
from impress_cache import ConfigError, ImpressCache, ImpressConfig, ImpressStore
from impress_cache.tiers.policies import LFUPolicy, LRUPolicy, ScorePolicy
from impress_cache.storage.base import KV
from impress_cache.store import CHUNK_DIR
from impress_cache.tiers import DEVICE, HOST

CT = 16
# tiny llama: 2 layers, 2 KV heads, head_dim 16, float32 -> one 16-token block is
# 2 (K, V) x 2 heads x 16 rows x 16 dims x 4 bytes = 4 KiB
BLOCK = 2 * 2 * CT * 16 * 4


def _tok(seed: int, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (1, n), generator=g)


def _cfg(**kw) -> ImpressConfig:
    """Exact reuse (important_ratio 1.0) unless a test asks for sparse loading."""
    kw.setdefault("important_ratio", 1.0)
    return ImpressConfig(chunk_tokens=CT, fsync=False, **kw)


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def model():
    return tiny_model("llama")


@pytest.fixture
def no_grace(monkeypatch):
    """Disk eviction may remove prefixes matched a moment ago (only leases protect)."""
    monkeypatch.setattr(leases_mod, "MATCH_GRACE_S", 0.0)


def _request(model, store: ImpressStore, ids: torch.Tensor, new_tokens: int) -> tuple[ImpressCache, dict]:
    """One request that does not store its prompt; returns its cache and the store's stats."""
    cache = ImpressCache(store, ids, store_prompt=False)
    run(model, ids, cache=cache, new_tokens=new_tokens)
    return cache, store.stats()


def _reuse(model, store: ImpressStore, ids: torch.Tensor) -> ImpressCache:
    """A request that reuses the store without adding its prompt; output checked exact."""
    ref, _ = run(model, ids, new_tokens=3)
    cache = ImpressCache(store, ids, store_prompt=False)
    out, _ = run(model, ids, cache=cache, new_tokens=3)
    assert torch.equal(out, ref)
    return cache


def _kv_keys(store: ImpressStore, tokens) -> list[tuple[int, int, int, int]]:
    m = store.match(list(tokens))
    lay = store.layout(m.segments)
    return sorted({(u.file_id, KV, layer, u.block) for layer in range(store.spec.num_layers) for u in lay.units})


# ------------------------------------------------------------------- hits and exactness
@pytest.mark.parametrize("policy", ["score", "lru", "lfu"])
def test_second_request_is_served_from_memory_and_stays_exact(tmp_path, model, policy):
    doc = _tok(0, 96)
    q1 = torch.cat([doc, _tok(1, 9)], dim=1)
    q2 = torch.cat([doc, _tok(2, 7)], dim=1)
    with ImpressStore(tmp_path, model, _cfg(policy=policy)) as store:
        assert_same_as_uncached(model, store, doc, new_tokens=3)
        first = assert_same_as_uncached(model, store, q1, new_tokens=3)
        assert first.stats.bytes_read_disk > 0  # nothing was in memory yet
        store.reset_stats()
        second = assert_same_as_uncached(model, store, q2, new_tokens=3)
        assert second.stats.matched_tokens == 96
        assert second.stats.bytes_read_disk == 0
        s = store.stats()
        assert s["bytes_read_disk"] == 0 and s["blocks_read"] == 0
        assert s["tiers"]["memory"]["hit_ratio"] == 1.0
        assert s["tiers"]["memory"]["byte_hit_ratio"] == 1.0
        assert s["tiers"]["device"]["hits"] == s["tiers"]["gets"] == 2 * 6  # 2 layers x 6 blocks
        assert s["important_kv_hit_rate"] == 1.0
        assert s["policy"] == policy


def test_read_blocks_returns_the_same_tensors_from_disk_and_memory(tmp_path, model):
    doc = _tok(3, 40)
    with ImpressStore(tmp_path, model, _cfg()) as store:
        assert_same_as_uncached(model, store, doc, new_tokens=3)
        keys = _kv_keys(store, doc[0].tolist())
        cold = store.read_blocks(keys)
        warm = store.read_blocks(keys)
        assert cold.stats.disk_bytes > 0 and cold.stats.disk_blocks == len(keys)
        assert warm.stats.disk_bytes == 0 and warm.stats.memory_blocks == len(keys)
        for i in range(len(keys)):
            assert torch.equal(cold.block(i), warm.block(i))
    # with both memory budgets at 0 nothing is cached and the blocks are the same tensors
    with ImpressStore(tmp_path, model, _cfg(device_bytes=0, host_bytes=0)) as store:
        blocks = store.read_blocks(keys)
        assert blocks.stats.disk_bytes > 0
        for i in range(len(keys)):
            assert torch.equal(blocks.block(i), warm.block(i))
        assert store.stats()["tiers"]["memory"]["hits"] == 0


def test_duplicate_keys_are_read_and_counted_once(tmp_path, model):
    doc = _tok(4, 40)
    with ImpressStore(tmp_path, model, _cfg()) as store:
        assert_same_as_uncached(model, store, doc, new_tokens=3)
        key = _kv_keys(store, doc[0].tolist())[0]
        store.reset_stats()
        blocks = store.read_blocks([key, key, key])
        assert blocks.slot_of == [0, 0, 0] and blocks.pool.shape[0] == 1
        assert store.stats()["tiers"]["gets"] == 1
        assert store.tiers.export_stats([key])[key]["count"] == 1


def test_a_promoted_host_hit_counts_as_a_host_hit(tmp_path, model):
    doc = _tok(11, 32)  # 2 blocks per layer
    with ImpressStore(tmp_path, model, _cfg()) as store:
        assert_same_as_uncached(model, store, doc, new_tokens=3)
        a, b = [k for k in _kv_keys(store, doc[0].tolist()) if k[2] == 0]
    with ImpressStore(tmp_path, model, _cfg(policy="lru", device_bytes=BLOCK, host_bytes=4 * BLOCK)) as store:
        store.read_blocks([a])  # disk -> device
        store.read_blocks([b])  # disk -> device, a demoted to the host
        assert store.tiers.tier_of(a) == HOST and store.tiers.tier_of(b) == DEVICE
        store.reset_stats()
        store.read_blocks([a])  # host hit, promoted (b demoted)
        s = store.stats()
        assert store.tiers.tier_of(a) == DEVICE
        assert s["lookups"]["kv"]["host"]["blocks"] == 1 and s["lookups"]["kv"]["device"]["blocks"] == 0
        assert s["important_kv_host_hit_rate"] == 1.0 and s["important_kv_device_hit_rate"] == 0.0
        assert s["tiers"]["promotions"] == 1 and s["tiers"]["demotions"] == 1
        assert s["tiers"]["bytes_moved_between_tiers"] == 2 * BLOCK


def test_importance_metrics_from_shares(tmp_path, model):
    doc = _tok(5, 48)  # 3 full blocks per layer
    with ImpressStore(tmp_path, model, _cfg()) as store:
        assert_same_as_uncached(model, store, doc, new_tokens=3)
        keys = [k for k in _kv_keys(store, doc[0].tolist()) if k[2] == 0]
        assert len(keys) == 3
        store.reset_stats()
        store.read_blocks(keys, [1.0, 0.25, 0.0])
        s = store.stats()
        assert s["important_rows_needed"] == pytest.approx(CT * 1.25)
        assert s["important_kv_hit_rate"] == 0.0
        assert s["kv_bytes_read_disk"] == 3 * BLOCK
        assert s["invalid_io_ratio"] == pytest.approx((0.75 + 1.0) / 3)
        store.read_blocks(keys, [0.5, 0.5, 0.5])
        s = store.stats()
        assert s["important_rows_needed"] == pytest.approx(CT * (1.25 + 1.5))
        assert s["important_rows_device"] + s["important_rows_host"] == pytest.approx(CT * 1.5)
        assert s["important_kv_hit_rate"] == pytest.approx(1.5 / 2.75)
        # decode-only reads count as accesses with share 0 and stay out of the metrics
        store.read_blocks(keys, decode=True)
        s2 = store.stats()
        assert s2["important_rows_needed"] == s["important_rows_needed"]
        assert s2["kv_blocks_accessed"] == 9
        assert store.tiers.export_stats([keys[0]])[keys[0]]["count"] == 3
        store.reset_stats()
        s = store.stats()
        assert s["important_rows_needed"] == 0 and s["tiers"]["gets"] == 0 and s["bytes_read_disk"] == 0
        assert s["tiers"]["device"]["used_bytes"] > 0  # residency is kept


def test_sparse_requests_use_the_tiers_and_stay_close(tmp_path, model):
    doc = _tok(6, 256)
    store_dense(tmp_path, model, doc, _cfg(), new_tokens=3)
    cfg = _cfg(important_ratio=0.25, similarity_threshold=0.0, decode="keep")
    with ImpressStore(tmp_path, model, cfg) as store:
        _, s1 = _request(model, store, torch.cat([doc, _tok(7, 8)], dim=1), 2)
        assert s1["important_rows_needed"] > 0 and s1["important_kv_hit_rate"] == 0.0
        assert 0.0 <= s1["invalid_io_ratio"] < 1.0
        assert s1["probe_bytes_read_disk"] > 0
        assert s1["lookups"]["probe"]["disk"]["hit_ratio"] == 1.0
        store.reset_stats()
        # same question: same selection
        c2, s2 = _request(model, store, torch.cat([doc, _tok(7, 8)], dim=1), 2)
        assert s2["important_kv_hit_rate"] == 1.0
        assert s2["kv_bytes_read_disk"] == 0 and s2["probe_bytes_read_disk"] == 0
        assert s2["lookups"]["probe"]["disk"]["blocks"] == 0 < s2["lookups"]["probe"]["blocks"]
        assert c2.stats.bytes_read_disk == 0


def test_full_decode_reads_count_as_unimportant_accesses(tmp_path, model):
    doc = _tok(8, 256)
    with ImpressStore(tmp_path, model, _cfg()) as store:
        assert_same_as_uncached(model, store, doc, new_tokens=3)
        all_keys = _kv_keys(store, doc[0].tolist())
    cfg = _cfg(important_ratio=0.1, similarity_threshold=0.0, decode="full", guard_margin=0.0)
    with ImpressStore(tmp_path, model, cfg) as store:
        cache, s = _request(model, store, torch.cat([doc, _tok(9, 10)], dim=1), 3)
        # every block of the prefix was accessed once: selected ones in the prefill,
        # the others for decoding
        assert s["kv_blocks_accessed"] == len(all_keys)
        assert s["decode_bytes_read_disk"] == cache.stats.bytes_read_decode > 0
        selected = {k for k in all_keys if store.tiers.importance_share(k) > 0}
        assert 0 < len(selected) < len(all_keys)



@pytest.mark.parametrize("weight", [0.0, 0.25])
def test_unimportant_weight_values_blocks_read_only_for_decoding(tmp_path, model, weight):
    """With the paper's score (weight 0) a block read only for decoding is worth nothing;
    with a weight it is worth that weight per access, a selected block stays above it."""
    doc = _tok(8, 256)
    with ImpressStore(tmp_path, model, _cfg()) as store:
        assert_same_as_uncached(model, store, doc, new_tokens=3)
        all_keys = _kv_keys(store, doc[0].tolist())
    cfg = _cfg(important_ratio=0.1, similarity_threshold=0.0, decode="full", unimportant_weight=weight)
    with ImpressStore(tmp_path, model, cfg, clock=Clock()) as store:
        assert store.tiers.policy.unimportant_weight == weight
        _request(model, store, torch.cat([doc, _tok(9, 10)], dim=1), 3)
        unselected = [k for k in all_keys if store.tiers.importance_share(k) == 0.0]
        selected = [k for k in all_keys if store.tiers.importance_share(k) == 1.0]
        assert unselected and selected
        assert [store.tiers.priority(k) for k in unselected] == pytest.approx([weight] * len(unselected))
        assert min(store.tiers.priority(k) for k in selected) > weight
    with pytest.raises(ConfigError, match="unimportant_weight"):
        _cfg(unimportant_weight=1.5)


# ------------------------------------------------------------------- budgets
@pytest.mark.parametrize("policy", ["score", "lru", "lfu"])
def test_budgets_are_respected_and_output_stays_exact(tmp_path, model, policy):
    cfg = _cfg(policy=policy, device_bytes=3 * BLOCK, host_bytes=5 * BLOCK)
    docs = [_tok(20 + i, 64) for i in range(3)]
    with ImpressStore(tmp_path, model, cfg) as store:
        for d in docs:
            assert_same_as_uncached(model, store, d, new_tokens=3)
        for step, i in enumerate([0, 1, 0, 2, 0, 1]):
            q = torch.cat([docs[i], _tok(100 + step, 5)], dim=1)
            assert_same_as_uncached(model, store, q, new_tokens=3)
            for tier in (DEVICE, HOST):
                assert store.tiers.used_bytes(tier) <= store.tiers.budget(tier)
            store.tiers._check_invariants()
        s = store.stats()["tiers"]
        assert s["device"]["used_bytes"] <= 3 * BLOCK and s["host"]["used_bytes"] <= 5 * BLOCK
        assert s["device"]["evictions"] + s["host"]["evictions"] > 0
        assert s["memory"]["misses"] > 0  # LRU may thrash on this cyclic pattern: no hit asserted
        kv = store.stats()["lookups"]["kv"]
        assert sum(kv[src]["blocks"] for src in ("device", "host", "disk")) == kv["blocks"] > 0


def test_class_shares_and_half_life_come_from_config(tmp_path, model):
    shares = {"high": 0.6, "medium": 0.3, "low": 0.1}
    with ImpressStore(tmp_path, model, _cfg(tier_shares=shares, half_life_s=30.0)) as store:
        assert store.tiers.class_shares == shares
        assert isinstance(store.tiers.policy, ScorePolicy)
        assert store.tiers.policy.half_life_s == 30.0
    with ImpressStore(tmp_path, model, _cfg(half_life_s=None)) as store:
        assert store.tiers.policy.half_life_s == float("inf")


# ------------------------------------------------------------------- policy names
def test_policy_names_are_validated():
    with pytest.raises(ConfigError, match="'lfu', 'lru', 'score'"):
        ImpressConfig(policy="fifo")
    with pytest.raises(ConfigError):
        ImpressConfig(policy="")
    with pytest.raises(ConfigError, match="half_life_s"):
        ImpressConfig(half_life_s=0)
    with pytest.raises(ConfigError, match="stats_interval_s"):
        ImpressConfig(stats_interval_s=-1.0)
    assert ImpressConfig(policy="LRU").policy == "LRU"


@pytest.mark.parametrize("name, cls", [("score", ScorePolicy), ("lru", LRUPolicy), ("LFU", LFUPolicy)])
def test_store_uses_the_configured_policy(tmp_path, model, name, cls):
    with ImpressStore(tmp_path, model, _cfg(policy=name)) as store:
        assert type(store.tiers.policy) is cls


# ------------------------------------------------------------------- disk budget
@pytest.fixture
def lean_wal(monkeypatch):
    """The disk budget checkpoints the index's WAL on every call, so the index takes
    about the same room in every store of these tests (a few pages per prompt)."""
    monkeypatch.setattr(gc_mod, "wal_bound", lambda budget: 0)


def _file_bytes(tmp_path, model) -> int:
    """Room one 64-token prompt takes: its chunk file (probe copy included) plus a margin
    for the index rows it adds. Budgets are `_budget(k, size)`: the index and WAL of a
    small store plus ``k`` prompts."""
    probe = tmp_path / "probe"
    with ImpressStore(probe, model, _cfg()) as store:
        assert_same_as_uncached(model, store, _tok(999, 64), new_tokens=3)
        store.index.checkpoint()
        _INDEX_BYTES[0] = store.index.footprint()
        return store._catalog.chunk_bytes


_INDEX_BYTES = [0]


def _budget(k: float, size: int) -> int:
    return _INDEX_BYTES[0] + int(k * size)


@pytest.mark.parametrize("policy", ["score", "lru", "lfu"])
def test_disk_budget_removes_the_least_valuable_prefix(tmp_path, model, policy, no_grace, lean_wal):
    size = _file_bytes(tmp_path, model)
    a, b, c, d = (_tok(30 + i, 64) for i in range(4))
    cfg = _cfg(policy=policy, disk_bytes=_budget(3.5, size))
    with ImpressStore(tmp_path / "s", model, cfg) as store:
        for doc in (a, b, c):
            assert_same_as_uncached(model, store, doc, new_tokens=3)
        assert store.stats()["prefixes_evicted"] == 0
        # a and c are reused, b never is
        for doc, seed in ((a, 40), (c, 41), (a, 42)):
            _reuse(model, store, torch.cat([doc, _tok(seed, 4)], dim=1))
        n_files = len(list((tmp_path / "s" / CHUNK_DIR).iterdir()))
        before = store.disk_bytes()
        assert before <= cfg.disk_bytes
        assert_same_as_uncached(model, store, d, new_tokens=3)  # goes over the budget
        assert store.disk_bytes() <= cfg.disk_bytes
        assert store.match(b[0].tolist()).length == 0  # b is gone
        for doc in (a, c, d):
            assert store.match(doc[0].tolist()).length == 64
        s = store.stats()
        assert s["prefixes_evicted"] == 1 and s["files_evicted"] == 1
        assert len(list((tmp_path / "s" / CHUNK_DIR).iterdir())) == n_files  # one in, one out
        # nothing of b's blocks is left in memory or in the statistics
        known = {f.id for f in store.index.files()}
        assert all(k[0] in known for k in store.tiers.blocks())
        assert all(k[0] in known for k in store.tiers.policy.keys())
    # the removal is durable and the survivors still serve exact output
    with ImpressStore(tmp_path / "s", model, cfg) as store:
        assert store.match(b[0].tolist()).length == 0
        cache = assert_same_as_uncached(model, store, torch.cat([c, _tok(43, 4)], dim=1), new_tokens=3)
        assert cache.stats.matched_tokens >= 64


def test_disk_budget_never_removes_a_prefix_in_use(tmp_path, model, no_grace, lean_wal, caplog):
    size = _file_bytes(tmp_path, model)
    a, b, d = (_tok(50 + i, 64) for i in range(3))
    cfg = _cfg(disk_bytes=_budget(2.5, size))
    with ImpressStore(tmp_path / "s", model, cfg) as store:
        assert_same_as_uncached(model, store, a, new_tokens=3)
        assert_same_as_uncached(model, store, b, new_tokens=3)
        _reuse(model, store, torch.cat([a, _tok(60, 4)], dim=1))  # a is valuable
        # a request on b (the least valuable prefix) still needs its rows when d is written
        qb = torch.cat([b, _tok(61, 4)], dim=1)
        held = store.lease([store.match(qb[0].tolist())])
        assert_same_as_uncached(model, store, d, new_tokens=3)
        assert store.match(b[0].tolist()).length == 64  # in use: kept
        assert store.match(a[0].tolist()).length == 0  # the next least valuable went instead
        # the held prefix still produces exact output
        _reuse(model, store, qb)
        # once the request is done, b can go (d is reused twice, so b is the least valuable)
        held.release()
        for seed in (63, 64):
            _reuse(model, store, torch.cat([d, _tok(seed, 4)], dim=1))
        store.config.disk_bytes = _budget(1.5, size)
        store.enforce_disk_budget()
        assert store.match(b[0].tolist()).length == 0
        assert store.match(d[0].tolist()).length == 64
        # everything in use: the store stays over budget and says so
        held = store.lease([store.match(d[0].tolist())])
        store.config.disk_bytes = 1
        with caplog.at_level(logging.WARNING, logger="impress_cache.store"):
            result = store.enforce_disk_budget()
        assert result["removed_prefixes"] == 0 and "in use" in caplog.text
        assert store.match(d[0].tolist()).length == 64
        held.release()


@pytest.mark.parametrize("ratio, decode", [(1.0, "full"), (0.25, "keep"), (0.25, "full")])
def test_a_cache_holds_its_prefix_only_while_it_needs_the_disk(tmp_path, model, ratio, decode):
    """Reads run during the prefill and, for a sparse prefill with decode="full", the rest
    of the prefix after it: the lease lasts exactly that long."""
    doc = _tok(80, 128)
    store_dense(tmp_path, model, doc, _cfg(), new_tokens=3)
    q = torch.cat([doc, _tok(81, 6)], dim=1)
    with ImpressStore(tmp_path, model, _cfg(important_ratio=ratio, decode=decode, similarity_threshold=0.0)) as store:
        files = {seg.file_id for seg in store.match(q[0].tolist()).segments}
        cache = ImpressCache(store, q, store_prompt=False)
        assert store.leased_files() == {f: 1 for f in files}
        run(model, q, cache=cache, new_tokens=3)  # prefill, then decode steps
        assert store.leased_files() == {}
        assert cache.get_seq_length() == q.shape[1] + 2


def test_disk_budget_keeps_files_that_other_nodes_still_use(tmp_path, model, no_grace, lean_wal):
    """After a split two nodes share a file: it is only deleted with its last node."""
    common, tail1, tail2 = _tok(70, 48), _tok(71, 32), _tok(72, 32)
    p1 = torch.cat([common, tail1], dim=1)
    p2 = torch.cat([common, tail2], dim=1)
    with ImpressStore(tmp_path, model, _cfg()) as store:
        assert_same_as_uncached(model, store, p1, new_tokens=3)
        assert_same_as_uncached(model, store, p2, new_tokens=3)  # splits p1's node after 48 tokens
        _reuse(model, store, torch.cat([p2, _tok(73, 3)], dim=1))  # p2 valuable
        assert len(store.tree) == 3 and len(store.index.files()) == 2
        store.index.checkpoint()
        total = store.disk_bytes()
        store.config.disk_bytes = total - 1
        result = store.enforce_disk_budget()
        # removing p1's tail frees nothing (its file still holds the common part), so the
        # next least valuable leaf goes too until a file is free
        remaining = {n.file_id for n in store.tree.nodes()}
        on_disk = {p.name for p in (tmp_path / CHUNK_DIR).iterdir()}
        for f in store.index.files():
            assert f.name in on_disk
            assert f.id in remaining
        assert result["removed_files"] >= 1 and store.disk_bytes() <= total - 1
        for m in (p1, p2):
            got = store.match(m[0].tolist()).length
            if got:
                _reuse(model, store, torch.cat([m[:, :got], _tok(74, 3)], dim=1))


def test_reused_file_ids_never_serve_stale_blocks(tmp_path, model, no_grace, lean_wal):
    size = _file_bytes(tmp_path, model)
    a, b = _tok(80, 64), _tok(81, 64)
    with ImpressStore(tmp_path / "s", model, _cfg(disk_bytes=_budget(1.5, size))) as store:
        assert_same_as_uncached(model, store, a, new_tokens=3)
        _reuse(model, store, torch.cat([a, _tok(90, 3)], dim=1))  # a's blocks in memory
        ids_a = {f.id for f in store.index.files()}
        store.config.disk_bytes = 1
        store.enforce_disk_budget()
        assert store.index.files() == [] and len(store.tiers) == 0
        store.config.disk_bytes = _budget(1.5, size)
        assert_same_as_uncached(model, store, b, new_tokens=3)
        assert not {f.id for f in store.index.files()} & ids_a  # ids are never used twice
        cache = _reuse(model, store, torch.cat([b, _tok(91, 3)], dim=1))
        assert cache.stats.matched_tokens == 64


# ------------------------------------------------------------------- statistics and warm-up
@pytest.mark.parametrize("policy", ["score", "lru"])
def test_block_statistics_survive_reopen(tmp_path, model, policy):
    doc = _tok(100, 64)
    cfg = _cfg(policy=policy)
    with ImpressStore(tmp_path, model, cfg) as store:
        assert_same_as_uncached(model, store, doc, new_tokens=3)
        for seed in (101, 102, 103):
            assert_same_as_uncached(model, store, torch.cat([doc, _tok(seed, 4)], dim=1), new_tokens=3)
        keys = _kv_keys(store, doc[0].tolist())
        keys = [k for k in keys if k[0] == keys[0][0]]
        store.read_blocks(keys[:2], [0.2, 0.2])
        t_before = time.time()
        before = store.tiers.export_stats(keys)
        order = sorted(keys, key=lambda k: (store.tiers.priority(k), k))
    with ImpressStore(tmp_path, model, cfg) as store:
        after = store.tiers.export_stats(keys)
        elapsed = time.time() - t_before
        # the score policy's frequency decays over the time between the two exports
        # (closing and reopening, longer on a loaded machine), and by nothing else
        decay = 2.0 ** (-elapsed / cfg.half_life_s) if policy == "score" else 1.0
        assert set(after) == set(keys)
        for k in keys:
            assert after[k]["count"] == before[k]["count"] >= 3
            assert after[k]["share"] == pytest.approx(before[k]["share"])
            # (saved ages mix the wall clock and the store's monotonic clock, read one after
            # the other: a loaded machine can run other threads between the two reads, so
            # allow a quarter of a second of decay on top)
            slack = 2.0 ** (-0.25 / cfg.half_life_s) if policy == "score" else 1.0
            assert before[k]["freq"] * decay * slack * (1 - 1e-9) <= after[k]["freq"] <= before[k]["freq"] * (1 + 1e-6)
            assert after[k]["age_s"] >= before[k]["age_s"]
        assert sorted(keys, key=lambda k: (store.tiers.priority(k), k)) == order
        assert len(store.tiers) == 0  # statistics, not payloads


def test_statistics_are_saved_periodically(tmp_path, model):
    clock = Clock()
    doc = _tok(110, 32)
    cfg = _cfg(stats_interval_s=10.0)
    store = ImpressStore(tmp_path, model, cfg, clock=clock)
    try:
        assert_same_as_uncached(model, store, doc, new_tokens=3)
        keys = _kv_keys(store, doc[0].tolist())
        store.read_blocks(keys)
        assert store.index.load_block_stats() == []  # not due yet: no save was scheduled
        clock.t += 11.0
        store.read_blocks(keys)
        deadline = time.monotonic() + 30.0  # the save runs on the writer thread
        while not store.index.load_block_stats() and time.monotonic() < deadline:
            time.sleep(0.01)
        saved = dict(store.index.load_block_stats())
        assert set(saved) == set(keys) and all(r["count"] == 2 for r in saved.values())
    finally:
        store.close()


def test_warmup_fills_the_tiers(tmp_path, model):
    doc = _tok(120, 80)
    q = torch.cat([doc, _tok(121, 6)], dim=1)
    store_dense(tmp_path, model, doc, _cfg(), new_tokens=3)
    with ImpressStore(tmp_path, model, _cfg()) as store:
        assert len(store.tiers) == 0
        summary = store.warmup([doc[0], [1, 2, 3]])
        assert summary["prompts"] == 1 and summary["matched_tokens"] == 80
        assert summary["blocks"] == 2 * 5 and summary["bytes_read_disk"] > 0
        assert store.tiers.used_bytes(DEVICE) + store.tiers.used_bytes(HOST) == 2 * 5 * BLOCK
        keys = _kv_keys(store, doc[0].tolist())
        assert all(store.tiers.export_stats([k])[k]["count"] == 1 for k in keys)
        store.reset_stats()
        cache = assert_same_as_uncached(model, store, q, new_tokens=3)
        assert cache.stats.bytes_read_disk == 0 and cache.stats.matched_tokens == 80
        with pytest.raises(TypeError, match="tokenizer"):
            store.warmup(["a string"])


def test_warmup_respects_budgets(tmp_path, model):
    docs = [_tok(130 + i, 64) for i in range(3)]
    with ImpressStore(tmp_path, model, _cfg()) as store:
        for d in docs:
            assert_same_as_uncached(model, store, d, new_tokens=3)
    cfg = _cfg(device_bytes=2 * BLOCK, host_bytes=4 * BLOCK)
    with ImpressStore(tmp_path, model, cfg) as store:
        store.warmup(d[0] for d in docs)
        assert store.tiers.used_bytes(DEVICE) <= 2 * BLOCK
        assert store.tiers.used_bytes(HOST) <= 4 * BLOCK
        assert store.tiers.used_bytes(DEVICE) > 0 and store.tiers.used_bytes(HOST) > 0
        store.tiers._check_invariants()
