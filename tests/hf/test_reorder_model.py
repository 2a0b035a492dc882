"""Generation on reordered stores: exact at important_ratio=1.0, and token selection reads
the same rows (so gives the same output) as on the store in prompt order."""

from __future__ import annotations

import shutil

import pytest
import torch

from conftest import VOCAB, tiny_model
from helpers import assert_same_as_uncached, left_pad, run
from impress_cache import ImpressCache, ImpressConfig, ImpressStore

DENSE = ImpressConfig(important_ratio=1.0, chunk_tokens=16, reorg_idle_ms=None)


def _tokens(seed: int, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (n,), generator=g)


def _reordered(path, model, docs: list[torch.Tensor], fmt: str = "safetensors") -> None:
    """Store ``docs``, let sparse requests gather importance, rewrite every node."""
    sparse = ImpressConfig(important_ratio=0.25, chunk_tokens=16, reorg_idle_ms=None, selection="token")
    with ImpressStore(path, model, DENSE, storage_format=fmt) as store:
        for doc in docs:
            assert_same_as_uncached(model, store, doc.unsqueeze(0))
    with ImpressStore(path, model, sparse, storage_format=fmt) as store:
        for i in range(4):
            for j, doc in enumerate(docs):
                ids = torch.cat([doc, _tokens(100 + 10 * i + j, 12)]).unsqueeze(0)
                run(model, ids, cache=ImpressCache(store), new_tokens=2)
        assert store.reorganize(force=True)["rewritten"] >= len(docs)


@pytest.mark.parametrize("fmt", ["safetensors", "hdf5"])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_reordered_store_is_exact_at_ratio_one(tmp_path, arch, fmt):
    model = tiny_model(arch)
    a, b = _tokens(1, 150), _tokens(2, 90)
    _reordered(tmp_path, model, [a, b], fmt)
    with ImpressStore(tmp_path, model, DENSE) as store:
        c = assert_same_as_uncached(model, store, torch.cat([a, _tokens(3, 20)]).unsqueeze(0))
        assert c.stats.matched_tokens == 150
        ids, mask = left_pad([torch.cat([a[:120], _tokens(4, 9)]), torch.cat([b, _tokens(5, 30)])])
        c = assert_same_as_uncached(model, store, ids, mask, sample_seed=3)
        assert [r.stored_match for r in c.stats.rows] == [120, 90]


def test_token_selection_on_a_reordered_store_gives_the_same_output(tmp_path):
    model = tiny_model("llama")
    doc = _tokens(7, 200)
    _reordered(tmp_path / "a", model, [doc])
    with ImpressStore(tmp_path / "b", model, DENSE) as store:
        assert_same_as_uncached(model, store, doc.unsqueeze(0))
    # similarity_threshold=0: one shared row set per layer (the per-KV-head fallback would
    # choose other rows than the past requests recorded)
    cfg = ImpressConfig(
        important_ratio=0.25, chunk_tokens=16, reorg_idle_ms=None, selection="token", decode="keep",
        similarity_threshold=0.0,
    )
    # a question the past requests asked: its important rows are the ones the rewrite
    # packed (on a random tiny model other questions rank other rows)
    ids = torch.cat([doc, _tokens(100, 12)]).unsqueeze(0)
    outs = []
    for name in ("a", "b"):
        with ImpressStore(tmp_path / name, model, cfg) as store:
            cache = ImpressCache(store)
            outs.append((run(model, ids, cache=cache), cache.stats))
    (seq_a, logits_a), stats_a = outs[0]
    (seq_b, logits_b), stats_b = outs[1]
    assert torch.equal(seq_a, seq_b) and torch.equal(logits_a, logits_b)
    assert stats_a.rows_selected == stats_b.rows_selected > 0
    # the reordered store packs what the past requests selected: fewer blocks per row
    assert stats_a.blocks_touched < stats_b.blocks_touched
    shutil.rmtree(tmp_path)
