"""``important_ratio="auto"`` (the default) through ``generate``: the store's cost model
chooses exact reuse or sparse loading per request, reports it, and learns from it."""

from __future__ import annotations

import torch

from conftest import tiny_model
from helpers import assert_same_as_uncached, run, stored_prompts
from impress_cache import ImpressCache, ImpressConfig, ImpressStore
from impress_cache.store.costs import FILE

TIERS_OFF = dict(device_bytes=0, host_bytes=0)
#: what a store would have measured on a disk delivering 1 MB/s, with free compute and selection
SLOW_DISK = {"bw_disk": 1e6, "compute_row": 1e-9, "select_row": 1e-12, "guard_rate": 0.0}


def _request(store, ids, mask, store_prompt=True):
    cache = ImpressCache(store, ids, attention_mask=mask, store_prompt=store_prompt)
    run(model=store.model, ids=ids, mask=mask, cache=cache, new_tokens=3)
    return cache.stats


def test_a_fresh_store_reuses_exactly_then_knows_its_compute_cost(tmp_path):
    model = tiny_model("llama")
    ids, mask = stored_prompts(tmp_path, model, padded=False)
    with ImpressStore(tmp_path, model, ImpressConfig(chunk_tokens=16, **TIERS_OFF)) as store:
        assert store.config.important_ratio == "auto"
        cache = assert_same_as_uncached(model, store, ids, mask, bind="ids")
        s = cache.stats
        assert s.plan == "exact" and "no read from disk measured yet" in s.plan_reason and s.plan_ratio is None
        assert s.matched_tokens > 0 and s.bytes_read_probe == 0
        assert store.costs.values["compute_row"] > 0
        assert "compute_token" not in store.costs.values
        fresh = torch.randint(3, model.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(5))
        s = _request(store, fresh, torch.ones_like(fresh))  # reuses nothing: what a new token costs
        assert s.matched_tokens == 0 and store.costs.values["compute_token"] > 0
    saved = (tmp_path / FILE).read_text()
    assert "compute_row" in saved


def test_a_slow_disk_gets_sparse_loading_and_it_is_reported(tmp_path):
    model = tiny_model("llama")
    ids, mask = stored_prompts(tmp_path, model, padded=True)
    with ImpressStore(tmp_path, model, ImpressConfig(chunk_tokens=16, **TIERS_OFF)) as store:
        store.costs.values.update(SLOW_DISK)
        s = _request(store, ids, mask)
        assert s.plan == "sparse" and s.bytes_read_probe > 0 and s.loaded_tokens < s.reused_columns * 2
        assert s.predicted_sparse_seconds < s.predicted_exact_seconds
        assert s.plan_ratio == store.config.auto_ratio  # reads dominate: no larger ratio is nearly free
        assert store.costs.counts.get("select_row", 0) >= 1  # the sparse request measured its selection
    # an explicit ratio is kept whatever the model says
    with ImpressStore(tmp_path, model, ImpressConfig(chunk_tokens=16, important_ratio=1.0, **TIERS_OFF)) as store:
        store.costs.values.update(SLOW_DISK)
        s = _request(store, ids, mask)
        assert s.plan == "" and s.bytes_read_probe == 0


def test_a_prefix_in_the_memory_tiers_is_reused_exactly(tmp_path):
    model = tiny_model("qwen3")
    ids, mask = stored_prompts(tmp_path, model, padded=False)
    with ImpressStore(tmp_path, model, ImpressConfig(chunk_tokens=16, important_ratio="auto")) as store:
        _request(store, ids, mask, store_prompt=False)  # exact (nothing measured): its blocks enter the memory tiers
        store.fetcher.submit(lambda: None).result()  # (admitted on the fetcher thread)
        store.costs.values.update(SLOW_DISK)
        s = _request(store, ids, mask)
        assert s.plan == "exact" and "memory tiers" in s.plan_reason


def test_auto_answers_equal_dense_reuse_with_decode_full(tmp_path):
    model = tiny_model("llama")
    ids, mask = stored_prompts(tmp_path, model, padded=False)
    with ImpressStore(tmp_path, model, ImpressConfig(chunk_tokens=16, **TIERS_OFF)) as store:
        store.costs.values.update(SLOW_DISK)
        cache = ImpressCache(store, ids, attention_mask=mask)
        seq, logits = run(model, ids, mask, cache, new_tokens=6)
        ref_seq, ref_logits = run(model, ids, mask, None, new_tokens=6)
        assert cache.stats.plan == "sparse"
        # decode="full" with the refresh: once the first token agrees, every later step
        # sees dense reuse's K/V (the guard makes the first token agree where it is unsure)
        assert torch.equal(seq[:, ids.shape[1]], ref_seq[:, ids.shape[1]])
        assert torch.equal(seq, ref_seq)
        assert (logits[:, 1:] - ref_logits[:, 1:]).abs().max().item() < 1e-4
