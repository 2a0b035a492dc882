"""The K/V codec of blocks at rest (`storage.kv_codec`): layout, error bounds, bytes."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from impress_cache import ImpressConfig
from impress_cache.errors import ConfigError
from impress_cache.storage import kv_codec
from impress_cache.storage.base import KV, iter_blocks

CODECS = kv_codec.KV_CODECS


def _bound(x: torch.Tensor, codec: str) -> torch.Tensor:
    """The documented error bound per value (plus float32 rounding of the scale)."""
    absmax = x.abs().amax(dim=-1, keepdim=True)
    if codec == "int8":
        bound = absmax / 254
    else:
        scale = absmax / 448
        bound = x.abs() / 16 + scale / 1024
    # (rows whose absmax is near float32's smallest normals may flush to zero)
    return bound * (1 + 1e-5) + absmax * 1e-6 + 1e-36


@pytest.mark.parametrize("codec", CODECS)
def test_round_trip_within_the_bound_and_the_layout(codec):
    torch.manual_seed(0)
    x = torch.randn(2, 3, 16, 64) * torch.logspace(-3, 3, 16)[None, None, :, None]
    raw = kv_codec.encode(x, codec)
    assert raw.dtype == torch.uint8 and raw.shape == (2, 3, 16, 68)
    codes, scales = kv_codec.split(raw, 64, codec)
    assert scales.shape == (2, 3, 16, 1)
    # the scale is the row's absmax over the codec's largest code
    levels = 127 if codec == "int8" else 448
    assert torch.allclose(scales, x.abs().amax(-1, keepdim=True) / levels, rtol=1e-6)
    y = kv_codec.decode(raw, 64, codec)
    assert ((y - x).abs() <= _bound(x, codec)).all()
    # not exact: a codec loses precision
    assert not torch.equal(y, x)


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_decode_into_a_strided_view_of_the_pool_dtype(codec, dtype):
    torch.manual_seed(1)
    x = torch.randn(2, 2, 7, 32).to(dtype)
    raw = kv_codec.encode(x, codec)
    pool = torch.full((3, 2, 2, 16, 32), 9.0, dtype=dtype)
    kv_codec.decode_into(raw, pool[1, :, :, :7], codec)
    want = kv_codec.decode(raw, 32, codec).to(dtype)
    assert torch.equal(pool[1, :, :, :7], want)
    assert (pool[1, :, :, 7:] == 9).all() and (pool[0] == 9).all() and (pool[2] == 9).all()
    tol = 0.02 if codec == "int8" else 0.1
    assert (pool[1, :, :, :7].float() - x.float()).abs().max() <= tol * x.float().abs().max() + 0.01


@pytest.mark.parametrize("codec", CODECS)
def test_zero_rows_stay_exact_zero_and_other_rows_keep_their_own_scale(codec):
    x = torch.zeros(2, 1, 4, 8)
    x[0, 0, 1] = torch.linspace(-1e6, 1e6, 8)  # one huge row does not touch its neighbours
    x[1, 0, 2] = torch.linspace(-1e-6, 1e-6, 8)
    y = kv_codec.decode(kv_codec.encode(x, codec), 8, codec)
    assert torch.equal(y[:, :, 0], torch.zeros(2, 1, 8)) and torch.equal(y[:, :, 3], torch.zeros(2, 1, 8))
    assert ((y - x).abs() <= _bound(x, codec)).all()


@pytest.mark.parametrize("codec", CODECS)
def test_head_dim_not_a_multiple_of_four(codec):
    x = torch.randn(2, 2, 5, 6)
    raw = kv_codec.encode(x, codec)
    assert raw.shape[-1] == 10
    assert ((kv_codec.decode(raw, 6, codec) - x).abs() <= _bound(x, codec)).all()


_values = st.floats(min_value=-(2.0**120), max_value=2.0**120, allow_nan=False, allow_infinity=False, width=32)


@settings(max_examples=60, deadline=None)
@given(
    codec=st.sampled_from(CODECS),
    heads=st.integers(1, 4),
    rows=st.integers(1, 9),
    dim=st.integers(1, 20),
    data=st.data(),
)
def test_property_round_trip_bound_over_shapes_and_values(codec, heads, rows, dim, data):
    n = 2 * heads * rows * dim
    vals = data.draw(st.lists(st.one_of(_values, st.just(0.0)), min_size=n, max_size=n))
    x = torch.tensor(vals, dtype=torch.float32).reshape(2, heads, rows, dim)
    raw = kv_codec.encode(x, codec)
    assert raw.shape == (2, heads, rows, dim + 4) and raw.numel() == rows * kv_codec.row_bytes(heads, dim)
    y = kv_codec.decode(raw, dim, codec)
    assert torch.isfinite(y).all()
    assert ((y - x).abs() <= _bound(x, codec)).all()
    assert (y[x == 0] == 0).all()
    assert torch.equal(torch.sign(y[y != 0]), torch.sign(x[y != 0]))


@pytest.mark.parametrize("codec", CODECS)
def test_bytes_ratio_against_float32_and_blocks(codec):
    heads, dim, rows = 3, 64, 16  # SmolLM2's KV shape
    dense = 2 * heads * dim * 4
    assert kv_codec.row_bytes(heads, dim) / dense == pytest.approx(0.2656, abs=1e-4)
    keys = [torch.randn(heads, 40, dim) for _ in range(2)]
    values = [torch.randn(heads, 40, dim) for _ in range(2)]
    plain = list(iter_blocks(keys, values, rows))
    coded = list(iter_blocks(keys, values, rows, codec))
    assert [(b.layer, b.block, b.rows) for b in plain] == [(b.layer, b.block, b.rows) for b in coded]
    for p, c in zip(plain, coded):
        assert c.kind == KV and c.dtype == torch.uint8 and c.shape == (2, heads, c.rows, dim + 4)
        assert c.nbytes == c.rows * kv_codec.row_bytes(heads, dim) and c.nbytes / p.nbytes == pytest.approx(0.2656, abs=1e-4)
        raw = torch.frombuffer(bytearray(c.payload), dtype=torch.uint8).view(c.shape)
        dense_block = torch.frombuffer(bytearray(p.payload), dtype=torch.float32).view(p.shape)
        assert torch.equal(kv_codec.decode(raw, dim, codec), kv_codec.decode(kv_codec.encode(dense_block, codec), dim, codec))


def test_config_validates_kv_codec():
    assert ImpressConfig().kv_codec is None
    for codec in CODECS:
        assert ImpressConfig(kv_codec=codec).kv_codec == codec
    for bad in ("int4", "INT8", "", 8):
        with pytest.raises(ConfigError, match=r"kv_codec must be None or one of 'int8', 'fp8', got"):
            ImpressConfig(kv_codec=bad)
