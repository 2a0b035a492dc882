"""What can go wrong while a keep-mode request re-selects rows (``keep_reselect``): the
files stay leased until ``generate`` returns, and a request that recovered from a
damaged file re-selects nothing. Never an exception out of ``generate``, never other
K/V than the stored ones."""

from __future__ import annotations


import torch
from transformers import LogitsProcessor, LogitsProcessorList

from conftest import tiny_model
from helpers import run, store_dense, tokens
from impress_cache import ImpressCache, ImpressConfig, ImpressStore
from impress_cache.hf.compat import CACHE_KWARG
from impress_cache.storage.base import KV, PROBE
from impress_cache.store import CHUNK_DIR


def _damage(path, model, doc, kind, layer, block):
    (f,) = (path / CHUNK_DIR).iterdir()
    with ImpressStore(path, model, ImpressConfig(chunk_tokens=16, important_ratio=1.0)) as store:
        offsets, _ = store.index.block_table(store.match(doc.tolist()).segments[0].file_id)
    raw = bytearray(f.read_bytes())
    raw[int(offsets[kind, layer, block]) + 1] ^= 0xFF
    f.write_bytes(bytes(raw))


KEEP_RESELECT = ImpressConfig(chunk_tokens=16, important_ratio=0.25, decode="keep", device_bytes=0, host_bytes=0,
                              keep_reselect=1)


def _stored_doc(tmp_path, seed):
    """A tiny model, a 300-token document stored densely, and a prompt of it plus 10
    question tokens."""
    model = tiny_model("llama", "sdpa")
    doc = tokens(seed, 300)
    store_dense(tmp_path, model, doc.unsqueeze(0))
    return model, doc, torch.cat([doc, tokens(seed + 1, 10)]).unsqueeze(0)


class _EvictOnce(LogitsProcessor):
    """Between two decode steps, asks the store to evict everything it can."""

    def __init__(self, store):
        self.store, self.calls, self.result = store, 0, None

    def __call__(self, input_ids, scores):
        self.calls += 1
        if self.calls == 2:
            self.result = self.store._gc.enforce(0)
        return scores


def test_the_leased_prefix_survives_eviction_while_rows_are_reselected(tmp_path):
    model, _, ids = _stored_doc(tmp_path, 11)
    with ImpressStore(tmp_path, model, KEEP_RESELECT) as store:
        calm = run(model, ids, cache=ImpressCache(store, ids), new_tokens=6)[0]
        cache = ImpressCache(store, ids)
        evict = _EvictOnce(store)
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=6, do_sample=False, logits_processor=LogitsProcessorList([evict]),
                                 **{CACHE_KWARG: cache})
        assert evict.result is not None and evict.result["removed_files"] == 0  # the request's lease held
        assert torch.equal(out, calm)
        assert cache.stats.reselections > 0 and cache.stats.quarantined_files == 0
        # generate returned: the lease is gone and the prefix can be evicted
        assert store._gc.enforce(0)["removed_files"] == 1


def test_a_request_that_recomputed_its_prefix_reselects_nothing(tmp_path):
    model = tiny_model("llama", "sdpa")
    doc = tokens(9, 256)
    store_dense(tmp_path, model, doc.unsqueeze(0))
    _damage(tmp_path, model, doc, PROBE, 1, 3)  # found mid-prefill: the prefix is recomputed
    ids = torch.cat([doc, tokens(10, 8)]).unsqueeze(0)
    cfg = ImpressConfig(chunk_tokens=16, important_ratio=0.25, decode="keep", keep_reselect=1)
    with ImpressStore(tmp_path, model, cfg) as store:
        cache = ImpressCache(store, ids)
        run(model, ids, cache=cache, new_tokens=4)
    assert cache.stats.quarantined_files == 1 and cache.stats.reselections == 0


def test_a_damaged_block_found_by_reselection_keeps_the_held_rows(tmp_path):
    """A block only a re-selection reads (the prefill chose none of its rows) fails its
    checksum: the request keeps the rows it holds (each still the stored K/V of its
    position), re-selects nothing more and the file is quarantined."""
    model, doc, ids = _stored_doc(tmp_path, 21)
    cfg = KEEP_RESELECT
    with ImpressStore(tmp_path, model, ImpressConfig(chunk_tokens=16, important_ratio=1.0)) as store:
        dense = ImpressCache(store, ids, store_prompt=False)
        run(model, ids, cache=dense, new_tokens=1)
    with ImpressStore(tmp_path, model, cfg) as store:
        calm = ImpressCache(store, ids, store_prompt=False)
        sparse = calm._request.sparse
        reselector = sparse.reselector
        run(model, ids, cache=calm, new_tokens=4)
    layer = 1
    prefill = {int(p) // 16 for p in sparse.selections[layer][0].flatten()}
    later = sorted({int(p) // 16 for p in reselector.held(layer, 0).flatten()} - prefill)
    assert later  # re-selection read blocks the prefill did not
    _damage(tmp_path, model, doc, KV, layer, later[0])
    with ImpressStore(tmp_path, model, cfg) as store:
        cache = ImpressCache(store, ids, store_prompt=False)
        sparse = cache._request.sparse
        reselector = sparse.reselector
        out = run(model, ids, cache=cache, new_tokens=4)[0]
        assert store.match(ids[0].tolist()).length == 0  # quarantined: nothing reuses the file
    assert out.shape[1] == ids.shape[1] + 4
    assert reselector.failed
    k = sparse.k
    for li, la in enumerate(cache.layers):
        at = reselector.held(li, 0)
        at = at.expand(la.keys.shape[1], -1) if at.dim() == 1 else at
        for head in range(la.keys.shape[1]):
            assert torch.allclose(la.keys[0, head, :k], dense.layers[li].keys[0, head, at[head]], atol=1e-6)
            assert torch.allclose(la.values[0, head, :k], dense.layers[li].values[0, head, at[head]], atol=1e-6)
