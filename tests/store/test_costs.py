"""The cost model behind ``important_ratio="auto"`` (`store.costs`): its decisions, its
means and its file."""

from __future__ import annotations

import json
import logging

from hypothesis import given, settings
from hypothesis import strategies as st

from impress_cache.store.costs import FILE, FREE, MARGIN, RATIOS, CostModel, Prefix

MIB = 2**20


def _measured(bw: float, compute_row: float = 5e-5, select_row: float = 3e-8, guard_rate: float = 0.2) -> CostModel:
    m = CostModel()
    m.observe_read("disk", 100 * MIB, 100 * MIB / bw)
    m.observe_exact(1000, 16, 1000 * compute_row, 0.0)
    m.observe_sparse(1000, 16, 10, 1000 * 10 * select_row, 0.0, 0)
    m.values["guard_rate"] = guard_rate
    return m


def _prefix(rows: int = 8000, full: int = 350 * MIB, layers: int = 30, new: int = 16, source: str = "disk") -> Prefix:
    return Prefix(source, rows, new, layers, full, lambda r: int(r * full), guard=True)


def _plan(m: CostModel, rows: int = 8000, full: int = 350 * MIB, ratio: float = 0.25, layers: int = 30, new: int = 16):
    return m.plan(_prefix(rows, full, layers, new), ratio)


def test_nothing_measured_reuses_exactly_and_says_why():
    p = _plan(CostModel())
    assert p.mode == "exact" and "no read from disk measured" in p.reason and p.exact_seconds is None


def test_a_prefix_in_the_memory_tiers_is_reused_exactly():
    assert _plan(_measured(50e6), full=0).mode == "exact"


def test_a_fast_disk_gets_exact_reuse_and_a_slow_one_sparse_loading():
    fast = _plan(_measured(1.5e9))  # reads hide behind the prefill: sparse only adds selection
    slow = _plan(_measured(200e6))
    assert fast.mode == "exact" and fast.sparse_seconds > fast.exact_seconds
    assert slow.mode == "sparse" and slow.sparse_seconds < MARGIN * slow.exact_seconds


def test_an_expensive_selection_or_a_guard_that_always_fires_keeps_exact_reuse():
    assert _plan(_measured(200e6, select_row=5e-6)).mode == "exact"
    assert _plan(_measured(300e6, guard_rate=1.0)).mode == "exact"


def test_each_source_has_its_own_bandwidth():
    m = _measured(1.5e9)
    assert m.plan(_prefix(source="remote"), 0.2).mode == "exact"  # remote never measured
    m.observe_read("remote", 50 * MIB, 1.0)
    assert m.plan(_prefix(source="remote"), 0.2).mode == "sparse"
    assert _plan(m).mode == "exact"


def test_small_reads_and_bad_values_do_not_move_the_means():
    m = CostModel()
    m.observe_read("disk", 1000, 1e-6)  # latency, not bandwidth
    m.observe_exact(0, 16, 1.0, 0.0)
    m.observe_sparse(100, 16, 4, float("nan"), 0.0, 10)
    m.observe_tokens(0, 1.0)
    assert m.values == {}


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(1e6, 1e10), min_size=1, max_size=20))
def test_the_bandwidth_mean_stays_within_what_was_seen(samples):
    m = CostModel()
    for bw in samples:
        m.observe_read("disk", 64 * MIB, 64 * MIB / bw)
    assert min(samples) * (1 - 1e-9) <= m.values["bw_disk"] <= max(samples) * (1 + 1e-9)
    assert m.counts["bw_disk"] == len(samples)


@settings(max_examples=80, deadline=None)
@given(
    st.floats(20e6, 5e9), st.floats(1e-6, 2e-4), st.floats(1e-9, 1e-6), st.floats(0, 1),
    st.integers(64, 131072), st.floats(0.05, 0.9),
)
def test_a_slower_disk_never_turns_sparse_loading_back_into_exact_reuse(bw, compute, select, guard, rows, ratio):
    full = rows * 30 * 12 * 1024
    m = _measured(bw, compute, select, guard)
    p = _plan(m, rows, full, ratio)
    if p.mode == "sparse":
        assert p.sparse_seconds < MARGIN * p.exact_seconds
        slower = _measured(bw / 2, compute, select, guard)
        assert _plan(slower, rows, full, ratio).mode == "sparse"
    else:
        assert p.sparse_seconds >= MARGIN * p.exact_seconds


def test_a_long_new_turn_hides_the_read_and_keeps_exact_reuse():
    """Many new tokens: the prefill's compute hides the whole read, and every new query
    scores every row, so sparse loading would only add work."""
    m = _measured(200e6)
    m.observe_tokens(500, 500 * 2e-3)
    assert _plan(m, new=16).mode == "sparse"
    long_turn = _plan(m, new=2000)
    assert long_turn.mode == "exact" and long_turn.exact_seconds >= 2000 * 2e-3


def test_the_new_tokens_cost_is_taken_out_of_the_per_row_compute():
    m = CostModel()
    m.observe_tokens(100, 1.0)  # 10 ms per token
    m.observe_exact(1000, 100, 1.5, 0.0)  # of 1.5 s, 1.0 s were the new tokens'
    assert abs(m.values["compute_row"] - 0.5 / 1000) < 1e-12
    assert CostModel().observe_exact(1000, 100, 1.5, 0.0) is None  # (nothing known of tokens: all on the rows)


def test_a_larger_ratio_is_taken_when_it_is_nearly_free():
    """On a slow remote the bytes dominate: the configured ratio stays. Where selection and
    compute dominate the sparse prediction, more rows cost little and a larger ratio is used."""
    bytes_bound = _plan(_measured(30e6, compute_row=1e-5, guard_rate=0.0), ratio=0.2)
    assert bytes_bound.mode == "sparse" and bytes_bound.ratio == 0.2
    compute_bound = _measured(200e6, compute_row=1e-4, select_row=1e-9, guard_rate=0.0)  # 0.8 s compute, 1.8 s read
    p = compute_bound.plan(_prefix(full=350 * MIB), 0.2)
    assert p.mode == "sparse" and p.ratio == 0.25


@settings(max_examples=80, deadline=None)
@given(
    st.floats(20e6, 5e9), st.floats(1e-6, 2e-4), st.floats(1e-9, 1e-6), st.floats(0, 1),
    st.integers(64, 131072), st.floats(0.05, 0.5), st.integers(1, 4096),
)
def test_a_chosen_ratio_is_never_below_the_configured_one_nor_much_slower(bw, compute, select, guard, rows, ratio, new):
    full = rows * 30 * 12 * 1024
    m = _measured(bw, compute, select, guard)
    p = m.plan(_prefix(rows, full, new=new), ratio)
    base = _base_prediction(m, rows, full, new, ratio)
    if p.mode == "sparse":
        assert p.ratio in (ratio, *RATIOS) and p.ratio >= ratio
        assert p.sparse_seconds < MARGIN * p.exact_seconds
        assert p.sparse_seconds <= FREE * base.sparse_seconds * (1 + 1e-9)
    else:
        assert p.ratio is None and base.mode == "exact"


def _base_prediction(m: CostModel, rows: int, full: int, new: int, ratio: float):
    """The plan at ``ratio`` alone (larger ratios read as much, so they are never taken)."""
    return m.plan(Prefix("disk", rows, new, 30, full, lambda r: int(min(r, ratio) * full), True), ratio)


def test_saved_and_loaded_with_the_store_folder(tmp_path):
    m = CostModel.load(tmp_path, writable=True)
    m.observe_read("disk", 64 * MIB, 0.5)
    m.save()
    again = CostModel.load(tmp_path, writable=True)
    assert again.values == m.values and again.counts == m.counts
    assert (tmp_path / FILE).stat().st_mode & 0o777 == 0o644


def test_read_only_keeps_the_model_in_memory(tmp_path):
    m = CostModel.load(tmp_path, writable=False)
    m.observe_read("disk", 64 * MIB, 0.5)
    m.save()
    assert not (tmp_path / FILE).exists()


def test_a_damaged_file_is_ignored_with_a_warning(tmp_path, caplog):
    (tmp_path / FILE).write_text("{not json")
    with caplog.at_level(logging.WARNING):
        m = CostModel.load(tmp_path, writable=True)
    assert m.values == {} and "ignoring the saved cost model" in caplog.text
    (tmp_path / FILE).write_text(json.dumps({"values": {"bw_disk": -5, "compute_row": "x", "select_row": 1e-8}, "counts": {}}))
    assert CostModel.load(tmp_path, writable=True).values == {"select_row": 1e-8}
