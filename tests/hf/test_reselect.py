"""Re-selection while decoding with ``decode="keep"`` (``keep_reselect``): every layer keeps
holding ``k`` prefix rows, and they are always the stored K/V of the positions it chose."""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_model
from helpers import run, stored_prompts
from impress_cache import ImpressCache, ImpressConfig, ImpressStore

KEEP = dict(chunk_tokens=16, important_ratio=0.25, decode="keep", device_bytes=0, host_bytes=0)
NEW = 4


def _prompts(tmp_path, model, padded):
    return stored_prompts(tmp_path, model, padded, seeds=(11, 12, 13, 14), sizes=(300, 240, 230, 10, 7))


def _generate(tmp_path, model, ids, mask, **cfg):
    """The cache, the tokens and the request's `Reselector` (``generate`` drops it when it
    returns, with the lease: nothing is read after that)."""
    with ImpressStore(tmp_path, model, ImpressConfig(**cfg)) as store:
        cache = ImpressCache(store, ids, attention_mask=mask)
        sparse = cache._request.sparse
        reselector = sparse.reselector if sparse is not None else None
        seq, _ = run(model, ids, mask, cache, new_tokens=NEW)
        assert sparse is None or sparse.reselector is None  # dropped at the end of generate
        assert cache._request._lease is None
    return cache, seq, reselector


@pytest.mark.parametrize("padded", [False, True], ids=["one", "padded"])
def test_reselected_rows_are_the_stored_rows_of_the_chosen_positions(tmp_path, padded):
    model = tiny_model("llama", "sdpa")
    ids, mask = _prompts(tmp_path, model, padded)
    dense, _, _ = _generate(tmp_path, model, ids, mask, chunk_tokens=16, important_ratio=1.0)
    cache, seq, reselector = _generate(tmp_path, model, ids, mask, **KEEP, keep_reselect=1)
    sparse = cache._request.sparse
    assert reselector is not None
    k, reused, layers = sparse.k, cache.reused_tokens, len(cache.layers)
    s = cache.stats
    # the refresh before the first decode step, then one per decode step (NEW - 1 of them)
    assert s.reselections == layers * NEW
    assert s.refreshed_tokens == int(mask[:, reused:].sum())
    assert s.bytes_read_decode > 0 and s.reselect_seconds > 0
    changed = False
    for li, layer in enumerate(cache.layers):
        # k prefix rows, then every prompt and generated column after the prefix
        assert layer.keys.shape[2] == k + ids.shape[1] - reused + NEW - 1
        for i in range(ids.shape[0]):
            lay = sparse.layouts[sparse.row_of(i)]
            k_i, pad = min(k, lay.length), reused - lay.length
            rows = reselector.held(li, i)
            at = (rows.expand(layer.keys.shape[1], -1) if rows.dim() == 1 else rows) + pad
            for head in range(layer.keys.shape[1]):
                want_k = dense.layers[li].keys[i, head, at[head]]
                want_v = dense.layers[li].values[i, head, at[head]]
                assert torch.allclose(layer.keys[i, head, k - k_i : k], want_k, atol=1e-6)
                assert torch.allclose(layer.values[i, head, k - k_i : k], want_v, atol=1e-6)
            if k_i < k:
                assert not layer.keys[i, :, : k - k_i].any()  # a shorter prefix leaves masked zeros
            changed |= not torch.equal(rows, sparse.selections[li][i])
    assert changed  # the decode steps chose other rows than the prefill


def test_reselect_every_n_tokens_and_off(tmp_path):
    model = tiny_model("llama", "sdpa")
    ids, mask = _prompts(tmp_path, model, False)
    every2, _, _ = _generate(tmp_path, model, ids, mask, **KEEP, keep_reselect=2)
    layers = len(every2.layers)
    assert every2.stats.reselections == layers * (1 + (NEW - 1) // 2)  # the refresh, then steps 2, 4, ...
    plain, _, plain_r = _generate(tmp_path, model, ids, mask, **KEEP, keep_reselect=1, keep_reselect_decay=0.0)
    decayed, _, decayed_r = _generate(tmp_path, model, ids, mask, **KEEP, keep_reselect=1, keep_reselect_decay=1.0)
    assert plain.stats.reselections == decayed.stats.reselections == layers * NEW
    assert not plain_r._ranked and decayed_r._ranked  # past rankings are kept only with a decay
    off, _, none = _generate(tmp_path, model, ids, mask, **KEEP)
    assert off.stats.reselections == 0 and off.stats.bytes_read_decode == 0
    assert none is None
    full, _, _ = _generate(tmp_path, model, ids, mask, **{**KEEP, "decode": "full"}, keep_reselect=1)
    assert full.stats.reselections == 0  # decode="full" holds the whole prefix: nothing to re-select
