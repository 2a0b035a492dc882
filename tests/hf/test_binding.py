"""``ImpressCache(store)`` without ids: it binds to the prompt ``generate`` (or a first
forward) sees, under either spelling of the cache argument, and reuses and stores exactly
like a cache built with the ids up front."""

from __future__ import annotations

import pytest
import torch

from conftest import ARCHS, VOCAB, tiny_model
from helpers import assert_same_as_uncached, left_pad, run
from impress_cache import CacheUsageError, ImpressCache, ImpressConfig, ImpressStore, remove_hooks
from impress_cache.hf.compat import CACHE_KWARG

CFG = ImpressConfig(important_ratio=1.0, chunk_tokens=16)
#: the spellings the installed transformers accepts: ``cache=`` (5.24) and ``past_key_values=``
SPELLINGS = ["cache", "past_key_values"] if CACHE_KWARG == "cache" else ["past_key_values"]


def _tokens(seed: int, n: int) -> torch.Tensor:
    return torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))


def _batches():
    a, b = _tokens(1, 80), _tokens(2, 50)
    first = left_pad([a, b])
    second = left_pad([torch.cat([a[:70], _tokens(3, 15)]), torch.cat([b[:40], _tokens(4, 10)])])
    return first, second


@pytest.mark.parametrize("spelling", SPELLINGS)
@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_bound_by_generate_reuses_and_stores_like_ids_up_front(tmp_path, arch, spelling):
    model = tiny_model(arch)
    (ids1, mask1), (ids2, mask2) = _batches()
    stats = {}
    for bind in ("generate", "ids"):
        with ImpressStore(tmp_path / bind, model, CFG) as store:
            c1 = assert_same_as_uncached(model, store, ids1, mask1, bind=bind, cache_kwarg=spelling)
            c2 = assert_same_as_uncached(model, store, ids2, mask2, bind=bind, cache_kwarg=spelling)
            assert c1.is_bound and c2.is_bound
            stats[bind] = [(r.stored_match, r.matched_tokens, r.computed_tokens) for r in c2.stats.rows]
            assert c1.stats.stored_prompts == 2 and c2.stats.reused_columns == 70
    assert stats["generate"] == stats["ids"] == [(70, 70, 15), (40, 35, 15)]


def test_unbound_cache_reports_nothing_until_generate_binds_it(tmp_path):
    model = tiny_model("llama")
    doc = _tokens(5, 64).unsqueeze(0)
    with ImpressStore(tmp_path, model, CFG) as store:
        assert_same_as_uncached(model, store, doc)
        cache = ImpressCache(store)
        assert not cache.is_bound and cache.get_seq_length() == 0 and cache.reused_tokens == 0
        assert cache.stats.matched_tokens == 0 and cache.selections == {}
        run(model, doc, cache=cache)
        assert cache.is_bound and cache.stats.matched_tokens == 63 and cache.reused_tokens == 63


def test_first_generate_of_a_fresh_model_binds_in_the_prefill(tmp_path):
    """``fresh.generate(..., cache=ImpressCache(store))`` looks up ``fresh.generate`` before
    it builds the cache (the first one of this model, which installs the hooks): the
    prefill binds the cache and runs only the tokens after the reused prefix."""
    (ids1, mask1), (ids2, mask2) = _batches()
    with ImpressStore(tmp_path, tiny_model("llama"), CFG) as store:
        assert_same_as_uncached(store.model, store, ids1, mask1)
    fresh = tiny_model("llama")  # same weights, no hooks yet
    ref, _ = run(tiny_model("llama"), ids2, mask2)
    with ImpressStore(tmp_path, fresh, CFG) as store, torch.no_grad():
        out = fresh.generate(
            ids2, attention_mask=mask2, max_new_tokens=8, do_sample=False, **{CACHE_KWARG: (cache := ImpressCache(store))}
        )
    assert torch.equal(out, ref)
    assert cache.stats.reused_columns == 70 and cache.stats.computed_tokens == 30


def test_generate_looked_up_before_the_hooks_still_binds_with_num_return_sequences(tmp_path):
    model = tiny_model("llama")
    doc = _tokens(9, 64).unsqueeze(0)
    generate = model.generate  # the class's generate, bound before any ImpressCache exists
    with ImpressStore(tmp_path, model, CFG) as store:
        assert_same_as_uncached(model, store, doc)
        q = torch.cat([doc, _tokens(10, 5).unsqueeze(0)], dim=1)
        torch.manual_seed(0)
        ref = generate(q, do_sample=True, num_return_sequences=3, max_new_tokens=6)
        cache = ImpressCache(store)
        torch.manual_seed(0)
        out = generate(q, do_sample=True, num_return_sequences=3, max_new_tokens=6, **{CACHE_KWARG: cache})
        assert torch.equal(out, ref)
        assert cache.reused_tokens == 64
        # bound in the prefill, to the batch generate expanded: each copy was matched and read
        assert len(cache.stats.rows) == 3
        # through the wrapper, the cache binds to the prompt as given, and reads it once
        cache = ImpressCache(store)
        torch.manual_seed(0)
        out = model.generate(q, do_sample=True, num_return_sequences=3, max_new_tokens=6, **{CACHE_KWARG: cache})
        assert torch.equal(out, ref)
        assert len(cache.stats.rows) == 1 and cache.layers[0].keys.shape[0] == 3


def test_attention_mask_is_derived_like_generate_does(tmp_path):
    """A padded batch without attention_mask: generate derives it from the pad token, and so
    does the binding (pad_token_id 0 occurs in the ids and is no end-of-sequence token)."""
    model = tiny_model("llama")
    (ids1, mask1), (ids2, _) = _batches()
    with ImpressStore(tmp_path, model, CFG) as store:
        assert_same_as_uncached(model, store, ids1, mask1)
        cache = assert_same_as_uncached(model, store, ids2, None)
        assert torch.equal(cache._request.mask, ids2.ne(0))
        assert cache.stats.reused_columns == 70


def test_a_plain_forward_binds_to_its_input_computes_it_and_stores_it(tmp_path):
    model = tiny_model("llama")
    doc = _tokens(11, 64).unsqueeze(0)
    with ImpressStore(tmp_path, model, CFG) as store:
        assert_same_as_uncached(model, store, doc[:, :40])  # stored: the first 40 tokens
        cache = ImpressCache(store)
        with torch.no_grad():
            ref = model(doc).logits
            out = model(doc, use_cache=True, **{CACHE_KWARG: cache})
            # a decode step on the bound cache continues as usual
            nxt = out.logits[:, -1:].argmax(-1)
            step = model(nxt, use_cache=True, **{CACHE_KWARG: cache}).logits
            full = model(torch.cat([doc, nxt], dim=1)).logits[:, -1:]
        assert torch.allclose(out.logits, ref, atol=1e-5)
        assert torch.allclose(step, full, atol=1e-4)
        # the forward computed every token it got: nothing reused, the prompt stored
        assert cache.stats.matched_tokens == 0 and cache.stats.computed_tokens == 64
        assert cache.stats.stored_prompts == 1
        store.flush()
        assert store.match(doc[0].tolist()).length == 64


def test_binding_errors(tmp_path):
    model = tiny_model("llama")
    doc = _tokens(12, 30).unsqueeze(0)
    with ImpressStore(tmp_path, model, CFG) as store:
        with pytest.raises(CacheUsageError, match="attention_mask without input_ids"):
            ImpressCache(store, attention_mask=torch.ones_like(doc))
        cache = ImpressCache(store, doc)
        with pytest.raises(CacheUsageError, match="bound to a prompt already"):
            cache.bind(doc)
        # one cache, one request: a second generate is refused before it runs
        unbound = ImpressCache(store)
        run(model, doc, cache=unbound)
        with pytest.raises(CacheUsageError, match="already served a request"):
            run(model, doc, cache=unbound)
        # the hooks were removed after the cache was built: nothing binds it, and it says so
        orphan = ImpressCache(store)
        remove_hooks(model)
        with pytest.raises(CacheUsageError, match="has no prompt"):
            run(model, doc, cache=orphan)
        with pytest.raises(CacheUsageError, match="inputs_embeds"):
            model.generate(inputs_embeds=model.get_input_embeddings()(doc), max_new_tokens=2, **{CACHE_KWARG: ImpressCache(store)})


@pytest.mark.parametrize(
    "kwargs, feature",
    [
        ({"prompt_lookup_num_tokens": 3}, "prompt_lookup_num_tokens"),
        ({"assistant_model": "assistant"}, "assistant_model"),
        ({"prefill_chunk_size": 16}, "prefill_chunk_size"),
    ],
)
def test_generation_features_a_stored_prefix_cannot_serve_are_named(tmp_path, kwargs, feature):
    model = tiny_model("llama")
    doc = _tokens(13, 40).unsqueeze(0)
    if kwargs.get("assistant_model") == "assistant":
        kwargs = {"assistant_model": tiny_model("llama", seed=1)}
    with ImpressStore(tmp_path, model, CFG) as store:
        assert_same_as_uncached(model, store, doc)
        for cache in (ImpressCache(store), ImpressCache(store, doc)):
            with pytest.raises(CacheUsageError, match=feature):
                model.generate(doc, max_new_tokens=3, do_sample=False, **kwargs, **{CACHE_KWARG: cache})


def test_prompt_lookup_through_a_generate_looked_up_before_the_hooks_is_refused(tmp_path):
    """Without the generate wrapper, the prefill hook sees the prompt and draft tokens."""
    doc = _tokens(14, 40).unsqueeze(0)
    with ImpressStore(tmp_path, tiny_model("llama"), CFG) as store:
        assert_same_as_uncached(store.model, store, doc)
    for bound in (False, True):
        fresh = tiny_model("llama")
        generate = fresh.generate
        with ImpressStore(tmp_path, fresh, CFG) as store:
            cache = ImpressCache(store, doc) if bound else ImpressCache(store)
            with pytest.raises(CacheUsageError, match="prompt-lookup|assisted"):
                generate(doc, max_new_tokens=4, prompt_lookup_num_tokens=2, do_sample=False, **{CACHE_KWARG: cache})


def test_a_model_whose_nested_rope_parameters_come_back_in_another_key_order_is_the_same_model(tmp_path):
    """Gemma 3 keeps its rope parameters per layer type; a config saved and read back (a
    converted GGUF model, a ``save_pretrained`` copy) may list each one's keys in another
    order. The spec records them in sorted order at every level (so a remote tier's
    namespace, a digest of the spec, is the same too), and the store compares them by
    value (a store written before recorded nested keys in the config's order): the same
    model opens its store, another rope theta is still refused."""
    from families import family_model

    from impress_cache import ModelMismatchError
    from impress_cache.model_info import model_spec
    from impress_cache.store.binding import ProbeSpec
    from impress_cache.store.remote.objects import namespace

    model = family_model("gemma3_text")
    ImpressStore(tmp_path, model, CFG).close()
    spec, probe = model_spec(model), ProbeSpec(query_heads=(0,), kv_heads=(0,), encoding="int4", head_dim=8)
    rope = model.config.rope_parameters
    model.config.rope_parameters = {kind: dict(reversed(list(p.items()))) for kind, p in rope.items()}
    assert [list(p) for p in model.config.rope_parameters.values()] != [list(p) for p in rope.values()]
    assert model_spec(model).rope == spec.rope
    assert namespace(model_spec(model), probe) == namespace(spec, probe)
    ImpressStore(tmp_path, model, CFG).close()
    # a store written before the spec sorted nested keys recorded them in the config's order
    unsorted = repr(sorted(rope.items()))  # (the config's own order: rope_type before rope_theta)
    assert unsorted != spec.rope
    spec.check_same({**spec.to_dict(), "rope": unsorted}, "an older store")
    model.config.rope_parameters = {kind: {**p, "rope_theta": p["rope_theta"] * 2} for kind, p in rope.items()}
    with pytest.raises(ModelMismatchError, match="rope"):
        ImpressStore(tmp_path, model, CFG)


def test_files_written_before_and_after_nested_rope_keys_were_sorted_are_one_models(tmp_path, monkeypatch):
    """A store made before the spec sorted nested rope keys (Gemma 3's per layer type)
    recorded them in the config's order, in its index and in its files' headers; the files
    it writes since record them sorted. Both are the same model's: a rebuilt index
    (`repair`) keeps every file (none quarantined as another model's), and the remote
    tier's check of a local file before it uploads it (`parse_object`) accepts both."""
    from families import family_model

    from impress_cache import model_info
    from impress_cache.store import CHUNK_DIR
    from impress_cache.store.remote.objects import namespace, parse_object
    from impress_cache.store.repair import repair

    model = family_model("gemma3_text")
    vocab = model.config.vocab_size
    docs = [torch.randint(3, vocab, (1, 40), generator=torch.Generator().manual_seed(s)) for s in (1, 2)]
    with monkeypatch.context() as m:
        m.setattr(model_info, "_sorted_dicts", lambda value: value)  # the spec as stores made before recorded it
        with ImpressStore(tmp_path, model, CFG) as store:
            old_rope = store.spec.rope
            assert_same_as_uncached(model, store, docs[0], new_tokens=2)
    with ImpressStore(tmp_path, model, CFG) as store:  # the same model, compared by value
        assert store.spec.rope != old_rope
        assert_same_as_uncached(model, store, docs[1], new_tokens=2)
        spec, probe = store.spec, store.probe
        row_bytes = (spec.kv_row_bytes, probe.record_bytes)
    files = sorted((tmp_path / CHUNK_DIR).iterdir())
    assert len(files) == 2
    ns = namespace(spec, probe)
    for path in files:  # as the remote tier checks a local file before uploading it
        parse_object(path.read_bytes(), None, ns, spec, probe, row_bytes)
    out = repair(tmp_path)
    assert out["files"] == 2 and not out["quarantined"]
    with ImpressStore(tmp_path, model, CFG) as store:
        for doc in docs:
            assert store.match(doc[0].numpy()).length >= 32
