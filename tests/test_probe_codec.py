"""Probe-key encodings: sizes as documented, and decoding close to the keys."""

from __future__ import annotations

import pytest
import torch

from impress_cache import probe


@pytest.mark.parametrize("encoding, ratio, tol", [("float16", 4.0, 1e-3), ("int8", 7.8, 0.5 / 127 + 1e-3), ("int4", 15.0, 0.5 / 7 + 1e-3)])
def test_size_and_error(encoding, ratio, tol):
    keys = torch.randn(3, 50, 64)
    raw = probe.encode(keys, encoding)
    assert raw.dtype == torch.uint8 and raw.shape == (50, probe.record_bytes(3, 64, encoding))
    fp32_kv_row = 2 * 64 * 4  # K and V of one head and token in float32
    assert fp32_kv_row / (probe.record_bytes(3, 64, encoding) / 3) == pytest.approx(ratio, rel=0.03)
    back = probe.decode(raw, 3, 64, encoding)
    # symmetric quantisation: error within about half a step of each token/head's max
    amax = keys.abs().amax(-1, keepdim=True)
    assert ((back - keys).abs() <= amax * tol).all()
    # a run of tokens is a contiguous byte range
    assert torch.equal(probe.decode(raw[10:20], 3, 64, encoding), back[:, 10:20])


def test_bad_encoding():
    with pytest.raises(ValueError, match="int4"):
        probe.record_bytes(3, 64, "int2")
