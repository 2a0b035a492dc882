"""Sparse prefix loading inside a real forward: positions, masks and padding are right.

On a one-layer model the prefill with a sparse prefix must equal a dense forward over the
whole prompt whose 4-D mask hides the prefix columns that were not selected.
"""

from __future__ import annotations

import pytest
import torch

from conftest import VOCAB, tiny_model
from helpers import assert_same_as_uncached, left_pad, run, store_dense
from impress_cache import ImpressCache, ImpressConfig, ImpressStore
from impress_cache.hf.compat import CACHE_KWARG

NEW = 12


def _tok(seed, n):
    return torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))


def _positions(mask2d):
    """Positions as generate derives them from a left-padded mask."""
    return (mask2d.long().cumsum(-1) - 1).clamp(min=0)


def _masked_reference(model, ids, mask2d, reused, selected_per_row, kv_heads):
    """Dense forward; new tokens see only the selected prefix columns (4-D additive mask)."""
    b, L = ids.shape
    causal = torch.tril(torch.ones(L, L, dtype=torch.bool))
    m = causal.unsqueeze(0).repeat(b, 1, 1) & mask2d.bool().unsqueeze(1)
    for i in range(b):
        pad = int((mask2d[i] == 0).sum())
        keep = torch.zeros(L, dtype=torch.bool)
        keep[pad + selected_per_row[i]] = True
        keep[reused:] = True
        m[i, reused:, :reused] &= keep[:reused]
    # padding query rows attend to themselves so no row is empty
    m |= torch.eye(L, dtype=torch.bool).unsqueeze(0)
    additive = torch.zeros(m.shape, dtype=torch.float32).masked_fill_(~m, torch.finfo(torch.float32).min)
    with torch.no_grad():
        out = model(ids, attention_mask=additive.unsqueeze(1), position_ids=_positions(mask2d), use_cache=False)
    return out.logits[:, reused:]


@pytest.mark.parametrize("selection, block_scores", [("token", "rows"), ("block", "rows"), ("block", "bounds")])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("padded", [False, True])
def test_sparse_prefill_equals_masked_dense(tmp_path, arch, selection, block_scores, padded):
    model = tiny_model(arch, "eager", num_hidden_layers=1)
    a, b = _tok(1, 200), _tok(2, 150)
    cfg_dense = ImpressConfig(chunk_tokens=16, important_ratio=1.0)
    with ImpressStore(tmp_path, model, cfg_dense) as store:
        assert_same_as_uncached(model, store, a.unsqueeze(0))
        assert_same_as_uncached(model, store, b.unsqueeze(0))
    rows = [torch.cat([a, _tok(3, NEW)])]
    if padded:
        rows.append(torch.cat([b, _tok(4, NEW)]))
    ids, mask = left_pad(rows)
    cfg = ImpressConfig(
        chunk_tokens=16, important_ratio=0.3, selection=selection, decode="keep", similarity_threshold=0.0,
        block_scores=block_scores,
    )
    with ImpressStore(tmp_path, model, cfg) as store:
        cache = ImpressCache(store, ids, attention_mask=mask)
        reused = cache.reused_tokens
        assert reused == ids.shape[1] - NEW
        with torch.no_grad():
            out = model(
                ids[:, reused:],
                attention_mask=mask,
                position_ids=_positions(mask)[:, reused:],
                **{CACHE_KWARG: cache},
                use_cache=True,
            )
        sel = cache.selections[0]
        assert not cache.stats.fallback_layers
        k = reused - cache.layers[0].hidden  # prefix rows each layer holds
        for i in range(ids.shape[0]):
            assert sel[i].dim() == 1 and sel[i].numel() == k
            assert torch.equal(sel[i], torch.unique(sel[i]))
        ref = _masked_reference(model, ids, mask, reused, sel, 2)
        assert torch.allclose(out.logits, ref, atol=1e-4), (out.logits - ref).abs().max()
        assert cache.stats.loaded_tokens == k * ids.shape[0]
        assert 0 < cache.stats.bytes_read_rows
        if selection == "block":
            # whole units: at most one partly used block per row
            assert cache.stats.invalid_io_ratio < 0.5


def test_fallback_selects_per_head_and_still_runs(tmp_path):
    model = tiny_model("llama", "sdpa")
    doc = _tok(5, 256)
    store_dense(tmp_path, model, doc.unsqueeze(0))
    q = torch.cat([doc, _tok(6, 10)]).unsqueeze(0)
    # a threshold of 1.0 can only be met by identical probe sets: random heads disagree
    cfg = ImpressConfig(chunk_tokens=16, important_ratio=0.25, similarity_threshold=1.0)
    with ImpressStore(tmp_path, model, cfg) as store:
        cache = ImpressCache(store, q)
        run(model, q, cache=cache)
        assert cache.stats.fallback_layers == [0, 1]
        assert cache.selections[0][0].shape == (2, 64)  # [kv_heads, k]
        # the probe copy holds both KV heads, so the fallback scored with it and read only
        # the blocks the heads chose; decode="full" read the rest afterwards
        full = 2 * 2 * 16 * 4 * 2 * 256
        s = cache.stats
        assert 0 < s.bytes_read_rows < full
        assert s.bytes_read_rows + s.bytes_read_decode + s.bytes_read_guard == full


def test_full_decode_reads_the_rest_after_prefill(tmp_path):
    model = tiny_model("llama", "sdpa")
    doc = _tok(7, 512)
    store_dense(tmp_path, model, doc.unsqueeze(0))
    q = torch.cat([doc, _tok(8, 10)]).unsqueeze(0)
    cfg = ImpressConfig(chunk_tokens=16, important_ratio=0.1, similarity_threshold=0.0, decode="full")
    with ImpressStore(tmp_path, model, cfg) as store:
        cache = ImpressCache(store, q)
        run(model, q, cache=cache, new_tokens=4)
        s = cache.stats
        full = 2 * 2 * 16 * 4 * 2 * 512  # layers x kv_heads x head_dim x fp32 x (K,V) x tokens
        assert s.bytes_read_rows < full / 2 * 0.5
        assert s.bytes_read_rows + s.bytes_read_decode + s.bytes_read_guard == full
        # after the prefill every layer holds the whole prefix again
        assert all(layer.hidden == 0 for layer in cache.layers)
        assert cache.get_seq_length() == q.shape[1] + 3


def test_damaged_probe_copy_is_quarantined_and_the_prefix_recomputed(tmp_path):
    """Probe copies are read during the prefill: a damaged one is quarantined and the
    remaining layers select their rows from the prefix recomputed on the side."""
    from impress_cache.storage.base import PROBE
    from impress_cache.store import CHUNK_DIR, QUARANTINE_DIR

    model = tiny_model("llama", "sdpa")
    doc = _tok(9, 256)
    store_dense(tmp_path, model, doc.unsqueeze(0))
    (f,) = (tmp_path / CHUNK_DIR).iterdir()
    with ImpressStore(tmp_path, model, ImpressConfig(chunk_tokens=16, important_ratio=1.0)) as store:
        fid = store.match(doc.tolist()).segments[0].file_id
        offsets, _ = store.index.block_table(fid)
    raw = bytearray(f.read_bytes())
    raw[int(offsets[PROBE, 1, 3]) + 1] ^= 0xFF
    f.write_bytes(bytes(raw))
    q = torch.cat([doc, _tok(10, 8)]).unsqueeze(0)
    with ImpressStore(tmp_path, model, ImpressConfig(chunk_tokens=16, important_ratio=0.25)) as store:
        cache = ImpressCache(store, q)
        out, _ = run(model, q, cache=cache)
        assert out.shape == (1, q.shape[1] + 8)
        assert cache.stats.quarantined_files == 1
        assert cache.stats.recomputed_layers >= 1  # layer 1 on: rows from the recomputed prefix
        assert store.match(q[0].tolist()).length == 0  # the damaged prefix is gone
    assert (tmp_path / QUARANTINE_DIR / f.name).exists()
    # a dense request now computes the prompt and gives the exact output
    with ImpressStore(tmp_path, model, ImpressConfig(chunk_tokens=16, important_ratio=1.0)) as store:
        again = assert_same_as_uncached(model, store, q)
        assert again.stats.matched_tokens == 0


def test_prefetch_changes_reads_not_answers(tmp_path):
    """Reading the next layer's blocks ahead (``prefetch``) selects and answers the same;
    ``"agreed"`` reads ahead only what two layers chose, so never more than ``"next"``."""
    from impress_cache.errors import ConfigError

    model = tiny_model("llama", "sdpa", num_hidden_layers=4)
    doc = _tok(9, 512)
    store_dense(tmp_path, model, doc.unsqueeze(0))
    q = torch.cat([doc, _tok(10, 10)]).unsqueeze(0)
    got = {}
    for mode in (False, True, "next", "agreed"):
        cfg = ImpressConfig(chunk_tokens=16, important_ratio=0.25, decode="keep", prefetch=mode, reorg_idle_ms=None)
        with ImpressStore(tmp_path, model, cfg) as store:
            cache = ImpressCache(store, q)
            seqs, logits = run(model, q, cache=cache, new_tokens=3)
            got[mode] = (seqs, logits, cache.selections, cache.stats)
    seqs, logits, sel, off = got[False]
    assert off.prefetch_hit_rate == 0.0
    for mode in (True, "next", "agreed"):
        m_seqs, m_logits, m_sel, stats = got[mode]
        assert torch.equal(m_seqs, seqs) and torch.equal(m_logits, logits)
        assert {k: [t.tolist() for t in v.values()] for k, v in m_sel.items()} == {
            k: [t.tolist() for t in v.values()] for k, v in sel.items()
        }
        assert stats.prefetch_hit_rate > 0.0
        assert stats.bytes_read_rows >= off.bytes_read_rows  # read ahead: never fewer blocks
    assert got["agreed"][3].bytes_read_rows <= got["next"][3].bytes_read_rows
    assert got[True][3].bytes_read_rows == got["next"][3].bytes_read_rows
    with pytest.raises(ConfigError, match="prefetch"):
        ImpressConfig(prefetch="sometimes")


def test_agreed_read_ahead_with_nothing_agreed(tmp_path):
    """Tiny selections: some pairs of layers choose no block in common and start no
    read-ahead (an empty read once failed the request with an IndexError); the answers
    are those without read-ahead."""
    model = tiny_model("llama", "sdpa", num_hidden_layers=6)
    doc = _tok(11, 512)
    store_dense(tmp_path, model, doc.unsqueeze(0))
    q = torch.cat([doc, _tok(12, 6)]).unsqueeze(0)
    out = {}
    for mode in (False, "agreed"):
        cfg = ImpressConfig(chunk_tokens=16, important_ratio=0.02, decode="keep", prefetch=mode, reorg_idle_ms=None)
        with ImpressStore(tmp_path, model, cfg) as store:
            cache = ImpressCache(store, q)
            out[mode] = (*run(model, q, cache=cache, new_tokens=2), cache.stats)
    assert torch.equal(out[False][0], out["agreed"][0]) and torch.equal(out[False][1], out["agreed"][1])
    # some layers did read ahead (the ones whose neighbours agreed): more rows read than without
    assert out["agreed"][2].bytes_read_rows >= out[False][2].bytes_read_rows
