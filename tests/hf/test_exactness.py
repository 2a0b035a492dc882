"""With important_ratio=1.0, generate through an ImpressCache equals generate without one."""

from __future__ import annotations

import pytest
import torch

from conftest import ARCHS, VOCAB, tiny_model
from helpers import assert_same_as_uncached, left_pad
from impress_cache import ImpressConfig, ImpressStore
from impress_cache.hf.compat import CACHE_KWARG

CFG = ImpressConfig(important_ratio=1.0, chunk_tokens=16)


def _tokens(seed: int, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (n,), generator=g)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("arch", sorted(ARCHS))
@pytest.mark.parametrize("sample_seed", [None, 1234], ids=["greedy", "sampled"])
def test_single_prompt_then_divergent_reuse(tmp_path, arch, attn, sample_seed):
    model = tiny_model(arch, attn)
    doc = _tokens(1, 90)
    with ImpressStore(tmp_path / "kv", model, CFG) as store:
        first = assert_same_as_uncached(model, store, doc.unsqueeze(0), sample_seed=sample_seed)
        assert first.stats.matched_tokens == 0 and first.stats.computed_tokens == 90
        # diverges in the middle of the stored prompt: the common 61 tokens are reused
        second = torch.cat([doc[:61], _tokens(2, 20)]).unsqueeze(0)
        c = assert_same_as_uncached(model, store, second, sample_seed=sample_seed)
        assert c.stats.matched_tokens == 61 and c.stats.computed_tokens == 20
        assert c.stats.bytes_read_disk > 0


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("arch", sorted(ARCHS))
@pytest.mark.parametrize("sample_seed", [None, 7], ids=["greedy", "sampled"])
def test_left_padded_batch_with_different_prefix_lengths(tmp_path, arch, attn, sample_seed):
    model = tiny_model(arch, attn)
    a, b = _tokens(3, 80), _tokens(4, 50)
    with ImpressStore(tmp_path / "kv", model, CFG) as store:
        ids, mask = left_pad([a, b])
        assert_same_as_uncached(model, store, ids, mask, sample_seed=sample_seed)
        rows = [torch.cat([a[:70], _tokens(5, 15)]), torch.cat([b[:40], _tokens(6, 10)])]
        ids, mask = left_pad(rows)
        c = assert_same_as_uncached(model, store, ids, mask, sample_seed=sample_seed)
        # row 0 (85 tokens, no padding) stored 70, row 1 (50 tokens, 35 pads) stored 40:
        # both reuse columns [0, min(0 + 70, 35 + 40)) = [0, 70)
        assert [r.stored_match for r in c.stats.rows] == [70, 40]
        assert c.stats.reused_columns == 70
        assert [r.matched_tokens for r in c.stats.rows] == [70, 35]
        assert c.stats.computed_tokens == 15 + 15


def test_reopened_store_serves_same_output(tmp_path):
    model = tiny_model("qwen3")
    doc = _tokens(8, 120).unsqueeze(0)
    with ImpressStore(tmp_path / "kv", model, CFG) as store:
        assert_same_as_uncached(model, store, doc)
    with ImpressStore(tmp_path / "kv", model, CFG) as store:
        c = assert_same_as_uncached(model, store, doc)
        assert c.stats.matched_tokens == 119


def test_num_return_sequences_expands_cache(tmp_path):
    model = tiny_model("llama")
    doc = _tokens(9, 64).unsqueeze(0)
    with ImpressStore(tmp_path / "kv", model, CFG) as store:
        assert_same_as_uncached(model, store, doc)
        from impress_cache import ImpressCache

        torch.manual_seed(0)
        ref = model.generate(doc, do_sample=True, num_return_sequences=3, max_new_tokens=6)
        cache = ImpressCache(store, doc)
        torch.manual_seed(0)
        out = model.generate(doc, do_sample=True, num_return_sequences=3, max_new_tokens=6, **{CACHE_KWARG: cache})
        assert torch.equal(ref, out)
        assert cache.stats.matched_tokens == 63
