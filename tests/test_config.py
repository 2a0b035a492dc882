"""Every configuration value is validated when the config is created."""

from __future__ import annotations

import pytest

from conftest import tiny_model
from impress_cache import ConfigError, ImpressConfig, ImpressStore


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"chunk_tokens": 0}, "chunk_tokens"),
        ({"chunk_tokens": 2.5}, "chunk_tokens"),
        ({"important_ratio": 0.0}, "important_ratio"),
        ({"important_ratio": 1.5}, "important_ratio"),
        ({"probe_heads": 0}, "probe_heads"),
        ({"selection": "tokens"}, "selection"),
        ({"decode": "partial"}, "decode"),
        ({"kv_dtype": "int8"}, "kv_dtype"),
        ({"device_bytes": -1}, "device_bytes"),
        ({"tier_shares": {"high": 0.5, "medium": 0.5, "low": 0.5}}, "tier_shares"),
        ({"similarity_threshold": 2.0}, "similarity_threshold"),
        ({"similarity_alpha": "0.6"}, "similarity_alpha"),
        ({"important_ratio": True}, "important_ratio"),
        ({"fsync": "yes"}, "fsync"),
        ({"probe_dtype": "int2"}, "probe_dtype"),
        ({"selection": "h20"}, "selection"),
        ({"block_scores": "minmax"}, "block_scores"),
        ({"block_scores": None}, "block_scores"),
        ({"refresh_new_tokens": 1}, "refresh_new_tokens"),
        ({"guard_margin": -0.1}, "guard_margin"),
        ({"guard_margin": float("nan")}, "guard_margin"),
        ({"guard_margin": "1"}, "guard_margin"),
        ({"guard_margin": True}, "guard_margin"),
        ({"keep_sinks": -1}, "keep_sinks"),
        ({"keep_recent": 1.5}, "keep_recent"),
        ({"keep_reselect": -1}, "keep_reselect"),
        ({"keep_reselect": 0.5}, "keep_reselect"),
        ({"keep_reselect_decay": 1.5}, "keep_reselect_decay"),
        ({"keep_reselect_decay": -0.1}, "keep_reselect_decay"),
    ],
)
def test_config_out_of_range(kwargs, field):
    with pytest.raises(ConfigError, match=field):
        ImpressConfig(**kwargs)


def test_store_needs_config_object(tmp_path):
    with pytest.raises(TypeError, match="ImpressConfig"):
        ImpressStore(tmp_path, tiny_model("llama"), {"chunk_tokens": 16})
