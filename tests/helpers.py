"""Comparing generate with an ImpressCache against generate without any cache."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import torch

from impress_cache import ImpressCache, ImpressStore
from impress_cache.hf.compat import CACHE_KWARG
from impress_cache.store.blockset import BlockSet


def left_pad(rows: list[torch.Tensor], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack 1-D token tensors into a left-padded batch and its attention mask."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r):] = r
        mask[i, width - len(r):] = 1
    return ids, mask


def run(model, ids, mask=None, cache=None, sample_seed=None, new_tokens=8, cache_kwarg=CACHE_KWARG):
    """generate with fixed settings; returns (sequences, stacked raw logits).

    The cache goes in under ``cache_kwarg``: by default the name the installed
    transformers uses (``cache`` from 5.24 on, ``past_key_values`` before)."""
    kwargs = dict(max_new_tokens=new_tokens, output_logits=True, return_dict_in_generate=True)
    if sample_seed is None:
        kwargs["do_sample"] = False
    else:
        kwargs.update(do_sample=True, top_k=0, top_p=1.0, temperature=1.0)
        torch.manual_seed(sample_seed)
    if mask is not None:
        kwargs["attention_mask"] = mask
    if cache is not None:
        kwargs[cache_kwarg] = cache
    with torch.no_grad():
        out = model.generate(ids, **kwargs)
    return out.sequences, torch.stack(out.logits, 1)


def assert_same_as_uncached(
    model, store: ImpressStore, ids, mask=None, sample_seed=None, new_tokens=8, atol=1e-4, bind="generate",
    cache_kwarg=CACHE_KWARG,
):
    """Run with and without the store's cache; tokens equal, logits within atol. Returns the cache.

    ``bind="generate"``: the cache is built empty (``ImpressCache(store)``) and binds to
    the prompt generate receives; ``bind="ids"``: it is built with the prompt up front."""
    ref_seq, ref_logits = run(model, ids, mask, None, sample_seed, new_tokens)
    cache = ImpressCache(store) if bind == "generate" else ImpressCache(store, ids, attention_mask=mask)
    seq, logits = run(model, ids, mask, cache, sample_seed, new_tokens, cache_kwarg)
    assert torch.equal(seq, ref_seq), f"tokens differ:\n{seq}\n{ref_seq}"
    err = (logits - ref_logits).abs().max().item()
    assert err <= atol, f"max logit error {err} > {atol}"
    store.flush()
    return cache


def store_dense(path, model, doc: torch.Tensor, config=None, new_tokens=8) -> None:
    """Store ``doc`` (``[1, n]``) with exact reuse checked; ``config`` defaults to 16-token chunks."""
    from impress_cache import ImpressConfig

    config = config if config is not None else ImpressConfig(chunk_tokens=16, important_ratio=1.0)
    with ImpressStore(path, model, config) as store:
        assert_same_as_uncached(model, store, doc.to(model.device), new_tokens=new_tokens)


def blockset_of(layout, units, keys: torch.Tensor, values: torch.Tensor) -> BlockSet:
    """The K/V blocks of ``units`` cut from in-memory ``[H, P, D]`` keys and values."""
    return layout.blocks_from(keys, values, list(units))


def tokens(seed: int, n: int) -> torch.Tensor:
    """``n`` random token ids of the tiny models' vocabulary (ids >= 3), fixed by ``seed``."""
    from conftest import VOCAB

    return torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))


def stored_prompts(path, model, padded: bool, seeds=(1, 2, 3, 4), sizes=(400, 300, 280, 12, 9)):
    """A stored document followed by new tokens; with ``padded`` a second row: a second
    stored document, cut short, followed by new tokens. Returns ``(ids, mask)`` left-padded.
    ``sizes``: first document, second document, its cut, new tokens of each row."""
    a, b = tokens(seeds[0], sizes[0]), tokens(seeds[1], sizes[1])
    store_dense(path, model, a.unsqueeze(0))
    rows = [torch.cat([a, tokens(seeds[2], sizes[3])])]
    if padded:
        store_dense(path, model, b.unsqueeze(0))
        rows.append(torch.cat([b[: sizes[2]], tokens(seeds[3], sizes[4])]))
    return left_pad(rows)



def index_value(store_path, query: str):
    """The first column of the first row ``query`` returns from a store's index (its own
    connection, closed again)."""
    conn = sqlite3.connect(Path(store_path) / "index.sqlite")
    try:
        return conn.execute(query).fetchone()[0]
    finally:
        conn.close()
