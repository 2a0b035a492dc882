"""Clear errors for input a cache cannot serve, and for a cache used with another prompt."""

from __future__ import annotations

import pytest
import torch

from conftest import VOCAB, tiny_model
from helpers import assert_same_as_uncached, left_pad, run
from impress_cache import CacheUsageError, ImpressCache, ImpressConfig, ImpressStore
from impress_cache.hf.compat import CACHE_KWARG

CFG = ImpressConfig(chunk_tokens=16, important_ratio=1.0)


def _doc(seed=0, n=96):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (1, n), generator=g)


# -- bad input gets a clear error -------------------------------------------------------
@pytest.fixture
def store(tmp_path):
    with ImpressStore(tmp_path, tiny_model("llama"), CFG) as s:
        yield s


@pytest.mark.parametrize(
    "bad, message",
    [
        ([[1, 2, 3]], "must be a torch.Tensor"),
        (torch.tensor([1, 2, 3]), r"shape \[batch, seq\]"),
        (torch.zeros((1, 0), dtype=torch.long), r"shape \[batch, seq\]"),
        (torch.rand(1, 5), "integer token ids"),
        (torch.tensor([[1, 2, VOCAB]]), "token ids in"),
    ],
)
def test_bad_input_ids(store, bad, message):
    with pytest.raises(CacheUsageError, match=message):
        ImpressCache(store, bad)


def test_right_padding_is_refused(store):
    ids = torch.tensor([[5, 6, 7, 0]])
    with pytest.raises(CacheUsageError, match="left padding"):
        ImpressCache(store, ids, attention_mask=torch.tensor([[1, 1, 1, 0]]))


def test_cache_reused_for_second_request(store):
    model = store.model
    doc = _doc(4, 40)
    cache = ImpressCache(store, doc)
    run(model, doc, cache=cache)
    longer = torch.cat([doc, _doc(5, 10)], dim=1)
    with pytest.raises(CacheUsageError, match="already served a request|differ from those"):
        run(model, longer, cache=cache)


def test_cache_built_for_other_prompt(store):
    model = store.model
    doc = _doc(6, 40)
    assert_same_as_uncached(model, store, doc)
    other = doc.clone()
    other[0, -3] = (other[0, -3] + 1) % VOCAB
    cache = ImpressCache(store, doc)
    with pytest.raises(CacheUsageError, match="differ from those"):
        run(model, other, cache=cache)


def test_mask_not_given_to_cache(store):
    model = store.model
    a, b = _doc(7, 30)[0], _doc(8, 20)[0]
    ids, mask = left_pad([a, b])
    assert_same_as_uncached(model, store, ids, mask)
    with pytest.raises(CacheUsageError, match="attention_mask"):
        run(model, ids, mask, cache=ImpressCache(store, ids))


def test_cache_implementation_conflict(store):
    doc = _doc(9, 20)
    with pytest.raises(ValueError, match="cache_implementation"):
        store.model.generate(doc, cache_implementation="static", max_new_tokens=2, **{CACHE_KWARG: ImpressCache(store, doc)})
