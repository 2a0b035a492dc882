"""A sparse request that meets a damaged block ends as an undamaged one would (issue 25, item 2).

With ``decode="full"`` a sparse request restores the whole prefix for decoding, recomputes
its new tokens against it and lets the uncertainty guard replace uncertain first-token
logits by exact ones. Before this, a recovery during the prefill (a damaged probe copy or
K/V block, the prefix then recomputed on the side) skipped all three: the request decoded
from its selected rows only and its logits drifted from dense reuse's. Each case below
damages one kind of block in a real chunk file and compares the answer (tokens and
logits) with the same request on the undamaged store, and with ``generate`` without a
cache.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from conftest import VOCAB, tiny_model
from helpers import run, store_dense
from impress_cache import ImpressCache, ImpressConfig, ImpressStore
from impress_cache.storage.base import KV, PROBE
from impress_cache.store import CHUNK_DIR, QUARANTINE_DIR

NEW = 8
CFG = dict(chunk_tokens=16, important_ratio=0.25, decode="full", device_bytes=0, host_bytes=0, reorg_idle_ms=None)


def _tok(seed: int, n: int) -> torch.Tensor:
    return torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))


def _flip(path, offsets) -> None:
    raw = bytearray(path.read_bytes())
    for off in offsets:
        raw[int(off) + 1] ^= 0xFF
    path.write_bytes(bytes(raw))


@pytest.fixture(scope="module")
def stored(tmp_path_factory):
    """A store holding one 128-token prefix (dense, exact), the prompt that reuses it,
    the undamaged sparse answer and the answer without a cache."""
    base = tmp_path_factory.mktemp("stored")
    model = tiny_model("llama", "sdpa")
    doc = _tok(21, 128)
    store_dense(base, model, doc.unsqueeze(0))
    q = torch.cat([doc, _tok(22, 12)]).unsqueeze(0)
    clean = tmp_path_factory.mktemp("clean")
    shutil.copytree(base, clean, dirs_exist_ok=True)
    with ImpressStore(clean, model, ImpressConfig(**CFG)) as store:
        cache = ImpressCache(store, q)
        seq, logits = run(model, q, cache=cache, new_tokens=NEW)
        fid = store.match(doc.tolist()).segments[0].file_id
        offsets, _ = store.index.block_table(fid)
        assert cache.stats.recomputed_layers == 0 and cache.stats.quarantined_files == 0
        selected = {int(b) for b in torch.as_tensor(cache.selections[1][0]).flatten().div(16, rounding_mode="floor")}
    plain = run(model, q, new_tokens=NEW)
    return base, model, q, (seq, logits), plain, offsets, selected


@pytest.mark.parametrize("damage", ["probe", "kv_prefill", "missing", "kv_full_read"])
def test_a_recovered_sparse_request_answers_as_an_undamaged_one(stored, tmp_path, damage):
    base, model, q, (ref_seq, ref_logits), (plain_seq, plain_logits), offsets, selected = stored
    shutil.copytree(base, tmp_path, dirs_exist_ok=True)
    (f,) = (tmp_path / CHUNK_DIR).iterdir()
    if damage == "probe":  # one piece of layer 1's probe copy: found while layer 1 selects
        _flip(f, [offsets[PROBE, 1, 3]])
    elif damage == "kv_prefill":  # every K/V block of layer 1: found while layer 1 reads its rows
        _flip(f, offsets[KV, 1])
    elif damage == "missing":  # the file's tail cut off: the last probe pieces are missing
        os.truncate(f, int(offsets[PROBE, 1, -1]))
    else:  # a K/V block no layer-1 selection reads: found by the background read of the whole prefix
        unread = next(b for b in range(offsets.shape[2]) if b not in selected)
        _flip(f, [offsets[KV, 1, unread]])
    with ImpressStore(tmp_path, model, ImpressConfig(**CFG)) as store:
        cache = ImpressCache(store, q)
        seq, logits = run(model, q, cache=cache, new_tokens=NEW)
        s = cache.stats
        assert s.quarantined_files == 1
        assert (s.recomputed_layers >= 1) == (damage != "kv_full_read")
        # the state an undamaged request reaches: every layer holds the whole prefix again
        assert all(layer.hidden == 0 for layer in cache.layers)
        assert cache.get_seq_length() == q.shape[1] + NEW - 1
        assert s.refreshed_tokens > 0  # the new tokens were recomputed against the whole prefix
    assert (tmp_path / QUARANTINE_DIR / f.name).exists()
    assert torch.equal(seq, ref_seq) and torch.equal(seq, plain_seq)
    assert (logits - ref_logits).abs().max().item() <= 1e-4
    assert (logits - plain_logits).abs().max().item() <= 1e-4


def test_the_guard_is_active_after_a_recovery(stored, tmp_path):
    """With an uncertainty guard that always fires, the first token's logits after a
    recovery are the exact ones (the whole prefix restored before it), as without damage."""
    base, model, q, _, (plain_seq, plain_logits), offsets, _ = stored
    shutil.copytree(base, tmp_path, dirs_exist_ok=True)
    (f,) = (tmp_path / CHUNK_DIR).iterdir()
    _flip(f, [offsets[PROBE, 1, 3]])
    with ImpressStore(tmp_path, model, ImpressConfig(**{**CFG, "guard_margin": 100.0})) as store:
        cache = ImpressCache(store, q)
        seq, logits = run(model, q, cache=cache, new_tokens=NEW)
        assert cache.stats.recomputed_layers >= 1 and cache.stats.guard_triggered == 1
    assert torch.equal(seq, plain_seq)
    assert (logits[:, 0] - plain_logits[:, 0]).abs().max().item() <= 1e-4


def test_a_prefix_recomputed_for_every_layer_is_not_counted_as_matched(stored, tmp_path):
    """Every K/V block of layer 0 damaged under dense reuse: the prefix is recomputed for
    every layer, so nothing was reused: ``matched_tokens`` is 0 and the prompt counts as
    computed (before, the planned 128 tokens stayed "matched")."""
    base, model, q, _, (plain_seq, plain_logits), offsets, _ = stored
    shutil.copytree(base, tmp_path, dirs_exist_ok=True)
    (f,) = (tmp_path / CHUNK_DIR).iterdir()
    _flip(f, offsets[KV, 0])
    with ImpressStore(tmp_path, model, ImpressConfig(**{**CFG, "important_ratio": 1.0})) as store:
        cache = ImpressCache(store, q)
        seq, logits = run(model, q, cache=cache, new_tokens=NEW)
        s = cache.stats
        assert s.quarantined_files == 1 and s.recomputed_layers == 2
        assert s.matched_tokens == 0 and s.computed_tokens == q.shape[1]
        assert s.rows[0].stored_match == 128 and s.rows[0].matched_tokens == 0
    assert torch.equal(seq, plain_seq) and (logits - plain_logits).abs().max().item() <= 1e-4
