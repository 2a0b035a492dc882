"""The answer's K/V go to the store when ``generate`` returns, so the next turn of a
conversation (the prompt, the answer, a new message) matches through the answer."""

from __future__ import annotations

import pytest
import torch

from families import family_model
from helpers import assert_same_as_uncached, left_pad, run, tokens
from impress_cache import ImpressCache, ImpressConfig, ImpressStore
from impress_cache.hf.compat import CACHE_KWARG

EXACT = ImpressConfig(important_ratio=1.0, chunk_tokens=16)


def _turn(model, store, ids, new_tokens=8, **kw):
    cache = ImpressCache(store, store_answer=True)  # (hooks installed before generate is looked up)
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=new_tokens, do_sample=False, **{CACHE_KWARG: cache}, **kw)
    store.flush()
    return out, cache


@pytest.mark.parametrize("family", ["llama", "gemma2", "qwen3_5_text"])
def test_next_turn_matches_through_the_answer(tmp_path, family):
    model = family_model(family)
    prompt = tokens(1, 60).unsqueeze(0)
    with ImpressStore(tmp_path, model, EXACT) as store:
        _turn(model, store, prompt)  # binds through the prefill hook: stores the prompt
        out, _ = _turn(model, store, prompt)  # through the generate wrapper: the answer too
        # the next turn: the prompt, the answer, a new message
        nxt = torch.cat([out, tokens(2, 10).unsqueeze(0)], dim=1)
        c = assert_same_as_uncached(model, store, nxt)
        # everything fed to the model is stored: the prompt and the answer but its last token
        assert c.stats.matched_tokens == 60 + 8 - 1
        assert c.stats.computed_tokens == 1 + 10


def test_a_sparse_answer_is_stored_only_once_it_is_exact(tmp_path):
    model = family_model("llama")
    doc = tokens(1, 200).unsqueeze(0)
    with ImpressStore(tmp_path, model, EXACT) as store:
        run(model, doc, cache=ImpressCache(store))
    prompt = torch.cat([doc, tokens(3, 12).unsqueeze(0)], dim=1)
    for decode, stored in (("keep", False), ("full", True)):
        with ImpressStore(tmp_path, model, ImpressConfig(important_ratio=0.25, chunk_tokens=16, decode=decode)) as store:
            ImpressCache(store)
            out, cache = _turn(model, store, prompt, new_tokens=6)
            assert cache.stats.loaded_tokens < 200
            c = assert_same_as_uncached(model, store, torch.cat([out, tokens(4, 5).unsqueeze(0)], dim=1), new_tokens=2) if stored else None
        if stored:
            assert c.stats.matched_tokens == 212 + 5
        else:
            with ImpressStore(tmp_path, model, EXACT) as store:
                assert store.match(out[0].numpy()).length == 200


def test_beams_and_batches(tmp_path):
    model = family_model("llama")
    a, b = tokens(1, 40), tokens(2, 30)
    with ImpressStore(tmp_path, model, EXACT) as store:
        ImpressCache(store)
        out, _ = _turn(model, store, a.unsqueeze(0), num_beams=2)
        assert store.match(out[0].numpy()).length == 40  # beams: the answer is not stored
        ids, mask = left_pad([a, b])
        out, _ = _turn(model, store, ids, attention_mask=mask)
        assert store.match(out[0].numpy()).length == 40 + 8 - 1  # each row, without its padding
        assert store.match(out[1, 10:].numpy()).length == 30 + 8 - 1
