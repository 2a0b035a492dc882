"""What can go wrong while a keep-mode request re-selects rows (``keep_reselect``) and
while the guard takes its wider step (``guard_ratio``): the files stay leased until
``generate`` returns, a request that recovered from a damaged file re-selects nothing,
and a damaged block in the wider read falls back to the whole-prefix read, which
recomputes. Never an exception out of ``generate``, never other K/V than the stored ones."""

from __future__ import annotations

import shutil

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
    model = tiny_model("llama", "sdpa")
    doc = tokens(11, 300)
    store_dense(tmp_path, model, doc.unsqueeze(0))
    ids = torch.cat([doc, tokens(13, 10)]).unsqueeze(0)
    cfg = ImpressConfig(chunk_tokens=16, important_ratio=0.25, decode="keep", device_bytes=0, host_bytes=0,
                        keep_reselect=1)
    with ImpressStore(tmp_path, model, cfg) as store:
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


def test_a_damaged_block_in_the_wider_read_falls_back_to_the_whole_prefix(tmp_path):
    model = tiny_model("llama", "sdpa")
    doc = tokens(1, 400)
    store_dense(tmp_path, model, doc.unsqueeze(0))
    ids = torch.cat([doc, tokens(3, 12)]).unsqueeze(0)
    sparse = dict(chunk_tokens=16, important_ratio=0.1, similarity_threshold=0.0, decode="full",
                  guard_margin=100.0, device_bytes=0, host_bytes=0)
    with ImpressStore(tmp_path, model, ImpressConfig(**{**sparse, "guard_margin": 0.0})) as store:
        cache = ImpressCache(store, ids)
        run(model, ids, cache=cache, new_tokens=1)
        read = {(layer, int(b)) for layer, rows in cache.selections.items() for b in rows[0].reshape(-1) // 16}
    dense = run(model, ids, new_tokens=3)[0]
    block = next(b for b in range(400 // 16) if (0, b) not in read)  # the prefill does not read it
    damaged = tmp_path / "damaged"
    shutil.copytree(tmp_path, damaged, ignore=shutil.ignore_patterns("damaged"))
    _damage(damaged, model, doc, KV, 0, block)
    with ImpressStore(damaged, model, ImpressConfig(**sparse, guard_ratio=1.0)) as store:
        cache = ImpressCache(store, ids)
        out = run(model, ids, cache=cache, new_tokens=3)[0]
    s = cache.stats
    assert s.guard_triggered == 1 and s.guard_widened == 0 and s.quarantined_files == 1
    assert torch.equal(out, dense)  # recomputed, as without guard_ratio
