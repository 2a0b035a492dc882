"""`PackedColumns` keeps saved statistics' columns in fewer bytes and gives back exactly
the values it was made from; `scratch` arrays are ordinary writable arrays."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from impress_cache.index.columns import PackedColumns, scratch


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, np.float64).view(np.int64)


column = st.one_of(
    st.lists(st.integers(0, 300), min_size=1, max_size=40).map(lambda v: np.array(v, np.float64)),  # counts
    st.lists(st.sampled_from([0.0, -0.0, 0.5, 1.0, 1e9 + 0.25, float("nan"), float("inf")]), min_size=1, max_size=40)
    .map(lambda v: np.array(v, np.float64)),  # few distinct values, signed zeros and NaN included
    st.lists(st.floats(allow_nan=True, allow_infinity=True), min_size=1, max_size=40).map(lambda v: np.array(v, np.float64)),
)


@settings(max_examples=150, deadline=None)
@given(st.lists(column, min_size=1, max_size=6), st.data())
def test_packed_columns_give_back_every_value_bit_for_bit(cols, data):
    n = min(len(c) for c in cols)
    array = np.stack([c[:n] for c in cols], axis=1)
    packed = PackedColumns(array if data.draw(st.booleans()) else np.ascontiguousarray(array.T).T)
    assert packed.shape == array.shape and len(packed) == n
    assert np.array_equal(_bits(packed.to_array()), _bits(array))
    rows = np.array(data.draw(st.lists(st.integers(0, n - 1), max_size=10)), np.int64)
    assert np.array_equal(_bits(packed[rows]), _bits(array[rows])) and packed[rows].shape == (len(rows), array.shape[1])
    i = data.draw(st.integers(0, n - 1))
    assert np.array_equal(_bits(packed[i]), _bits(array[i])) and np.array_equal(_bits(packed[np.int64(i)]), _bits(array[i]))
    j = data.draw(st.integers(0, array.shape[1] - 1))
    assert np.array_equal(_bits(packed[rows, j]), _bits(array[rows, j]))
    assert packed.nbytes <= array.nbytes


def test_statistics_like_columns_take_a_third_or_less():
    """The saved node statistics' form: a count, a few frequencies and shares, sequence
    numbers, the time of a few saves and one time per node."""
    rng = np.random.default_rng(0)
    n = 5000
    array = np.stack([
        rng.integers(0, 3, n), rng.choice(rng.random(20), n), rng.choice(rng.random(16), n),
        np.arange(n), rng.choice(1e9 + rng.random(40), n), 1e9 + rng.random(n),
    ], axis=1).astype(np.float64)
    packed = PackedColumns(array)
    assert np.array_equal(_bits(packed.to_array()), _bits(array))
    assert packed.nbytes < array.nbytes / 3


def test_scratch_arrays_are_zeroed_and_writable():
    a = scratch((3, 4), np.float64)
    assert a.shape == (3, 4) and a.dtype == np.float64 and a.flags.writeable and not a.any()
    a[1, 2] = 7.5
    assert a.T[2, 1] == 7.5
    empty = scratch(0, np.int64)
    assert empty.shape == (0,) and empty.dtype == np.int64
