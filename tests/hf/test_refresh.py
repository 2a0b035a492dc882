"""Sparse prefills that end exact: the new tokens recomputed against the whole prefix
(``refresh_new_tokens``), the uncertainty guard (``guard_margin``) and always-kept rows
(``keep_sinks``, ``keep_recent``)."""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_model
from helpers import run, stored_prompts
from impress_cache import ImpressCache, ImpressConfig, ImpressStore

DENSE = dict(chunk_tokens=16, important_ratio=1.0)
SPARSE = dict(chunk_tokens=16, important_ratio=0.1, similarity_threshold=0.0, decode="full", guard_margin=0.0)


def _prompts(tmp_path, model, padded):
    return stored_prompts(tmp_path, model, padded)


def _generate(tmp_path, model, ids, mask, new_tokens=3, **cfg):
    with ImpressStore(tmp_path, model, ImpressConfig(**cfg)) as store:
        cache = ImpressCache(store, ids, attention_mask=mask)
        seq, logits = run(model, ids, mask, cache, new_tokens=new_tokens)
    return cache, seq, logits


def _prompt_rows(cache, seq_len, mask):
    """Per layer, the K/V the cache holds for the prompt's real columns (padding zeroed)."""
    keep = mask.bool()[:, None, :, None]
    return [(la.keys[:, :, :seq_len] * keep, la.values[:, :, :seq_len] * keep) for la in cache.layers]


@pytest.mark.parametrize("padded", [False, True], ids=["one", "padded"])
def test_refresh_gives_the_new_tokens_dense_kv(tmp_path, padded):
    model = tiny_model("llama", "sdpa")
    ids, mask = _prompts(tmp_path, model, padded)
    dense, dseq, dlogits = _generate(tmp_path, model, ids, mask, **DENSE)
    cache, seq, logits = _generate(tmp_path, model, ids, mask, **SPARSE)
    assert cache.stats.refreshed_tokens == int(mask[:, cache.reused_tokens :].sum())
    for (k, v), (dk, dv) in zip(_prompt_rows(cache, ids.shape[1], mask), _prompt_rows(dense, ids.shape[1], mask)):
        assert torch.allclose(k, dk, atol=1e-5) and torch.allclose(v, dv, atol=1e-5)
    # without the refresh the new tokens keep the K/V of the sparse prefill
    stale, _, _ = _generate(tmp_path, model, ids, mask, **SPARSE, refresh_new_tokens=False)
    assert stale.stats.refreshed_tokens == 0
    diffs = [
        (k - dk).abs().max().item()
        for (k, _), (dk, _) in zip(_prompt_rows(stale, ids.shape[1], mask), _prompt_rows(dense, ids.shape[1], mask))
    ]
    assert max(diffs) > 1e-3


def test_guard_completes_the_prefix_before_the_first_token(tmp_path):
    model = tiny_model("qwen3", "sdpa")
    ids, mask = _prompts(tmp_path, model, True)
    _, dseq, dlogits = _generate(tmp_path, model, ids, mask, **DENSE)
    cache, seq, logits = _generate(tmp_path, model, ids, mask, **{**SPARSE, "guard_margin": 100.0})
    s = cache.stats
    assert s.guard_triggered == 1 and s.first_token_margin is not None and s.first_token_margin < 100.0
    assert s.bytes_read_guard > 0 and s.bytes_read_decode == 0
    assert torch.equal(seq, dseq)
    assert (logits - dlogits).abs().max() < 1e-4  # the first token's logits too
    # a margin the sparse prefill clears: no completion before the first token
    quiet, _, _ = _generate(tmp_path, model, ids, mask, **{**SPARSE, "guard_margin": 1e-9})
    assert quiet.stats.guard_triggered == 0 and quiet.stats.bytes_read_guard == 0
    assert quiet.stats.bytes_read_decode > 0
    off, _, _ = _generate(tmp_path, model, ids, mask, **SPARSE)
    assert off.stats.guard_triggered == 0 and off.stats.first_token_margin == quiet.stats.first_token_margin
    keep, _, _ = _generate(tmp_path, model, ids, mask, **{**SPARSE, "decode": "keep", "guard_margin": 100.0})
    assert keep.stats.guard_triggered == 0 and keep.stats.bytes_read_guard == 0  # the guard needs decode="full"


def test_kept_rows_are_always_selected(tmp_path):
    model = tiny_model("llama", "sdpa")
    ids, mask = _prompts(tmp_path, model, False)
    cache, _, _ = _generate(tmp_path, model, ids, mask, new_tokens=1, **SPARSE, keep_sinks=4, keep_recent=32)
    p = cache.reused_tokens
    for per_row in cache.selections.values():
        rows = per_row[0]
        for head_rows in rows.reshape(-1, rows.shape[-1]):
            chosen = set(head_rows.tolist())
            assert set(range(4)) <= chosen and set(range(p - 32, p)) <= chosen


def test_after_the_refresh_later_steps_equal_dense(tmp_path):
    """Once the prefix is restored and the new tokens refreshed, the next step's logits are
    those of exact reuse (and, without the refresh, they are not)."""
    from impress_cache.hf.compat import CACHE_KWARG

    model = tiny_model("llama", "sdpa")
    ids, mask = _prompts(tmp_path, model, False)
    step = torch.tensor([[7]])
    logits = {}
    for name, cfg in (("dense", DENSE), ("refresh", SPARSE), ("stale", {**SPARSE, "refresh_new_tokens": False})):
        with ImpressStore(tmp_path, model, ImpressConfig(**cfg)) as store:
            cache = ImpressCache(store, ids, attention_mask=mask)
            run(model, ids, mask, cache, new_tokens=1)  # the prefill; the step below is the first decode step
            with torch.no_grad():
                out = model(step, attention_mask=torch.ones(1, ids.shape[1] + 1, dtype=torch.long), use_cache=True,
                            **{CACHE_KWARG: cache})
            logits[name] = out.logits[0, -1]
            if name != "dense":
                assert cache.stats.bytes_read_decode > 0  # the rest of the prefix was restored
    fresh = (logits["refresh"] - logits["dense"]).abs().max().item()
    stale = (logits["stale"] - logits["dense"]).abs().max().item()
    assert fresh < 1e-5  # float noise (6e-8 here)
    assert stale > 10 * max(fresh, 1e-6)  # 2e-4 here: this tiny random model's logits are small
