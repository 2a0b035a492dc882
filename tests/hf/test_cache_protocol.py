"""Every operation ``generate`` may call on a cache (transformers 5.23 and 5.24): correct, or
a clear `CacheUsageError` naming what is not supported."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from conftest import VOCAB, tiny_model
from helpers import assert_same_as_uncached, left_pad, run, store_dense
from impress_cache import CacheUsageError, ImpressCache, ImpressConfig, ImpressStore
from impress_cache.hf.cache import ImpressLayer
from impress_cache.hf.compat import CACHE_KWARG

CFG = ImpressConfig(important_ratio=1.0, chunk_tokens=16)


def _tokens(seed: int, n: int) -> torch.Tensor:
    return torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.fixture
def stored(tmp_path):
    """A store holding two prompts, and a left-padded batch of two prompts that reuse them."""
    model = tiny_model("llama")
    a, b = _tokens(1, 70), _tokens(2, 50)
    with ImpressStore(tmp_path, model, CFG) as store:
        assert_same_as_uncached(model, store, a.unsqueeze(0))
        assert_same_as_uncached(model, store, b.unsqueeze(0))
        rows = [torch.cat([a[:60], _tokens(3, 6)]), torch.cat([b[:45], _tokens(4, 9)])]
        yield store, rows


def test_is_croppable_and_crop_removes_computed_rows_exactly(stored):
    store, rows = stored
    model = store.model
    ids = rows[0].unsqueeze(0)
    impress, dynamic = ImpressCache(store), DynamicCache()
    assert impress.is_croppable and all(isinstance(la, ImpressLayer) and la.is_croppable for la in impress.layers)
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=5, do_sample=False, **{CACHE_KWARG: impress})
        ref = model.generate(ids, max_new_tokens=5, do_sample=False, **{CACHE_KWARG: dynamic})
        assert torch.equal(out, ref)
        assert impress.get_seq_length() == dynamic.get_seq_length() == ids.shape[1] + 4
        impress.crop(-3)
        dynamic.crop(-3)
        assert impress.get_seq_length() == dynamic.get_seq_length() == ids.shape[1] + 1
        # the next step after the crop sees the same rows as with a DynamicCache
        nxt = out[:, ids.shape[1] + 1 : ids.shape[1] + 2]
        a = model(nxt, use_cache=True, **{CACHE_KWARG: impress}).logits
        b = model(nxt, use_cache=True, **{CACHE_KWARG: dynamic}).logits
    assert torch.allclose(a, b, atol=1e-5)
    impress.crop(0)  # a no-op, as generate's deferred stop check calls it
    with pytest.raises(CacheUsageError, match="cut into the reused prefix"):
        impress.crop(-impress.get_seq_length())
    with pytest.raises(ValueError, match="positive"):
        impress.crop(3)


def test_crop_before_the_first_forward_cannot_remove_prefix_rows(stored):
    store, rows = stored
    cache = ImpressCache(store, rows[0].unsqueeze(0))
    assert cache.get_seq_length() == 60
    cache.crop(0)
    with pytest.raises(CacheUsageError, match="cut into the reused prefix"):
        cache.crop(-1)


@pytest.mark.parametrize("bind", ["generate", "ids"])
def test_beam_search_is_exact(stored, bind):
    """generate expands the batch for beams and reorders the cache every step."""
    store, rows = stored
    ids, mask = left_pad(rows)
    kwargs = dict(num_beams=3, num_return_sequences=2, max_new_tokens=6, do_sample=False, attention_mask=mask)
    with torch.no_grad():
        ref = store.model.generate(ids, **kwargs)
        cache = ImpressCache(store) if bind == "generate" else ImpressCache(store, ids, attention_mask=mask)
        out = store.model.generate(ids, **kwargs, **{CACHE_KWARG: cache})
    assert torch.equal(out, ref)
    # row 0: 60 stored of 66; row 1: 12 pads + 45 stored of 54 -> 57 columns
    assert cache.stats.reused_columns == 57 and cache.layers[0].keys.shape[0] == 6


def test_reorder_select_and_repeat_before_the_first_forward_move_the_prefix_rows(stored):
    """Operations on rows act on prefix rows not placed yet and on the prompt the hooks
    check, so the cache then serves the reordered / selected / repeated batch exactly."""
    store, rows = stored
    model = store.model
    ids, mask = left_pad(rows)
    swapped = torch.tensor([1, 0])
    cache = ImpressCache(store, ids, attention_mask=mask)
    cache.reorder_cache(swapped)
    seq, _ = run(model, ids[swapped], mask[swapped], cache=cache)
    ref, _ = run(model, ids[swapped], mask[swapped])
    assert torch.equal(seq, ref)

    cache = ImpressCache(store, ids, attention_mask=mask)
    cache.batch_select_indices(torch.tensor([1]))
    seq, _ = run(model, ids[1:], mask[1:], cache=cache)
    assert torch.equal(seq, run(model, ids[1:], mask[1:])[0])

    cache = ImpressCache(store, ids, attention_mask=mask)
    cache.batch_repeat_interleave(2)
    rep = torch.tensor([0, 0, 1, 1])
    seq, _ = run(model, ids[rep], mask[rep], cache=cache)
    assert torch.equal(seq, run(model, ids[rep], mask[rep])[0])


def test_reorder_and_select_after_generate_act_on_the_held_rows(stored):
    store, rows = stored
    ids, mask = left_pad(rows)
    cache = ImpressCache(store)
    run(store.model, ids, mask, cache=cache)
    keys = [la.keys.clone() for la in cache.layers]
    cache.reorder_cache(torch.tensor([1, 0]))
    assert all(torch.equal(la.keys, k[[1, 0]]) for la, k in zip(cache.layers, keys))
    cache.batch_select_indices(torch.tensor([0]))
    assert all(torch.equal(la.keys, k[[1]]) for la, k in zip(cache.layers, keys))


@pytest.mark.parametrize("guard_margin", [0.0, 100.0], ids=["after-prefill", "guard"])
def test_sparse_beam_search_restores_the_whole_prefix_in_beam_order(tmp_path, guard_margin):
    model = tiny_model("llama")
    doc = _tokens(5, 256)
    store_dense(tmp_path, model, doc.unsqueeze(0))
    q = torch.cat([doc, _tokens(6, 10)]).unsqueeze(0)
    cfg = ImpressConfig(
        chunk_tokens=16, important_ratio=0.25, similarity_threshold=0.0, decode="full", guard_margin=guard_margin
    )
    with ImpressStore(tmp_path, model, cfg) as store, torch.no_grad():
        cache = ImpressCache(store)
        out = model.generate(q, num_beams=2, max_new_tokens=4, do_sample=False, **{CACHE_KWARG: cache})
        assert out.shape == (1, q.shape[1] + 4)
        read = cache.stats.bytes_read_guard if guard_margin else cache.stats.bytes_read_decode
        assert read > 0 and cache.stats.guard_triggered == (guard_margin > 0)
        assert all(la.hidden == 0 for la in cache.layers)
        assert cache.get_seq_length() == q.shape[1] + 3
        # a row operation before the sparse prefill maps the batch onto the planned rows
        early = ImpressCache(store, q)
        early.batch_select_indices(torch.tensor([0]))
        seq, _ = run(model, q, cache=early, new_tokens=3)
        assert seq.shape == (1, q.shape[1] + 3) and early.stats.loaded_tokens > 0


def test_layers_take_the_dtype_of_the_incoming_keys(stored):
    """5.24 removed ``layer.dtype``: prefix rows take the dtype (and device) of the keys the
    attention layer hands over."""
    store, rows = stored
    cache = ImpressCache(store, rows[0].unsqueeze(0))
    layer = cache.layers[0]
    new = torch.zeros(1, 2, 6, 16, dtype=torch.bfloat16)  # the stored rows are float32
    cache.check_forward(rows[0][None, 60:], None)  # what the model's forward hook does before any update
    keys, values = cache.update(new, new, 0, kwargs={})  # 5.24 passes the module's kwargs
    assert keys.dtype == values.dtype == torch.bfloat16 and keys.shape[-2] == 66
    assert layer.keys.dtype == torch.bfloat16


def test_cache_truthiness_length_and_reset(stored):
    store, rows = stored
    cache = ImpressCache(store)
    # Cache has __len__ (number of layers) and no __bool__ in 5.24: never empty-looking
    assert len(cache) == store.spec.num_layers and bool(cache)
    with pytest.raises(CacheUsageError, match="no prompt"):
        cache.update(torch.zeros(1, 2, 1, 16), torch.zeros(1, 2, 1, 16), 0)
    with pytest.raises(CacheUsageError, match="cannot be reset"):
        cache.reset()


def test_a_reorder_between_sparse_prefill_and_decoding_reorders_the_whole_prefix(tmp_path):
    """With ``decode="full"`` the whole prefix is read in the background and restored
    before the first decode step; a reorder in between must apply to it as well."""
    model = tiny_model("llama")
    a, b = _tokens(7, 128), _tokens(8, 128)
    store_dense(tmp_path, model, a.unsqueeze(0))
    store_dense(tmp_path, model, b.unsqueeze(0))
    ids = torch.stack([torch.cat([a, _tokens(9, 8)]), torch.cat([b, _tokens(10, 8)])])

    def prefix_after_reorder(cfg):
        with ImpressStore(tmp_path, model, cfg) as store, torch.no_grad():
            cache = ImpressCache(store, ids, store_prompt=False)
            c = cache.reused_tokens
            model(ids[:, c:], use_cache=True, **{CACHE_KWARG: cache})
            cache.reorder_cache(torch.tensor([1, 0]))
            model(torch.tensor([[5], [6]]), use_cache=True, **{CACHE_KWARG: cache})
            return c, [la.keys[:, :, :c].clone() for la in cache.layers]

    c, dense = prefix_after_reorder(CFG)
    cs, sparse = prefix_after_reorder(
        ImpressConfig(chunk_tokens=16, important_ratio=0.25, similarity_threshold=0.0, decode="full")
    )
    assert c == cs == 128
    assert all(torch.equal(d, s) for d, s in zip(dense, sparse))
