"""Generate with a store that keeps K/V encoded (``kv_codec``): close to a run without any
cache, not exact; without a codec the same run is exact."""

from __future__ import annotations

import pytest
import torch

from conftest import VOCAB, tiny_model
from helpers import run
from impress_cache import ImpressCache, ImpressConfig, ImpressStore


def _tokens(seed: int, n: int) -> torch.Tensor:
    return torch.randint(3, VOCAB, (1, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("codec", [None, "int8", "fp8"])
def test_reuse_from_an_encoded_store_is_close_to_no_cache(tmp_path, codec, attn):
    model = tiny_model("llama", attn=attn, max_position_embeddings=2048)
    doc = _tokens(0, 320)
    prompt = torch.cat([doc, _tokens(1, 8)], dim=1)
    ref_seq, ref_logits = run(model, prompt, new_tokens=6)
    cfg = ImpressConfig(chunk_tokens=16, important_ratio=1.0, reorg_idle_ms=None, kv_codec=codec)
    with ImpressStore(tmp_path, model, cfg) as store:
        run(model, doc, cache=ImpressCache(store), new_tokens=1)
        store.flush()
    with ImpressStore(tmp_path, model, cfg) as store:
        cache = ImpressCache(store)
        seq, logits = run(model, prompt, cache=cache, new_tokens=6)
    assert cache.stats.matched_tokens == 320
    err = (logits - ref_logits).abs().max().item()
    assert torch.equal(seq, ref_seq)  # greedy tokens equal for every step
    if codec is None:
        assert err <= 1e-4  # exact reuse
    else:
        scale = ref_logits.abs().max().item()
        assert 0 < err <= (0.01 if codec == "int8" else 0.05) * scale, (err, scale)
