"""The family matrix: every served decoder-only family reuses stored prefixes exactly
(tokens and logits against plain ``generate``), and its sparse path runs and answers.

Per family: a prompt stored and then met diverging inside it, a left-padded batch of 2
with different stored-prefix lengths, and a store reopened (restart). Sliding-window and
chunked layers read only the rows their window still sees; shared-K/V layers store
nothing; K and V of different widths (DeepSeek-V3 as transformers caches it) and per-layer
head dims (Gemma 4) are padded at rest and sliced back.
"""

from __future__ import annotations

import pytest
import torch

from families import FAMILIES, REFUSED_FAMILIES, STATE_FAMILIES, family_model
from helpers import assert_same_as_uncached, left_pad, run, tokens
from impress_cache import CacheUsageError, ImpressCache, ImpressConfig, ImpressStore, UnsupportedModelError
from impress_cache.hf.compat import CACHE_KWARG
from impress_cache.store.states import StateCheckpoints

EXACT = ImpressConfig(important_ratio=1.0, chunk_tokens=16)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_exact_reuse(tmp_path, family):
    model = family_model(family)
    doc = tokens(1, 90)
    with ImpressStore(tmp_path, model, EXACT) as store:
        kinds = [i.kind for i in store.spec.model_layers]
        assert len(kinds) == model.config.get_text_config(decoder=True).num_hidden_layers
        assert_same_as_uncached(model, store, doc.unsqueeze(0))
        c = assert_same_as_uncached(model, store, torch.cat([doc[:61], tokens(2, 20)]).unsqueeze(0))
        assert c.stats.matched_tokens == 61 and c.stats.computed_tokens == 20
        a, b = tokens(3, 80), tokens(4, 50)
        assert_same_as_uncached(model, store, *left_pad([a, b]))
        c = assert_same_as_uncached(model, store, *left_pad([torch.cat([a[:70], tokens(5, 15)]), torch.cat([b[:40], tokens(6, 10)])]))
        assert c.stats.reused_columns == 70
    if "window" in kinds:  # only the rows a window still sees were read: less than every row
        with ImpressStore(tmp_path, model, EXACT) as store:
            c = assert_same_as_uncached(model, store, torch.cat([doc, tokens(9, 5)]).unsqueeze(0))
            assert c.stats.matched_tokens == 90
            full = store.spec.kv_bytes_per_token * 90
            assert 0 < c.stats.bytes_read_disk < full
    else:
        with ImpressStore(tmp_path, model, EXACT) as store:  # restart
            c = assert_same_as_uncached(model, store, torch.cat([doc, tokens(9, 5)]).unsqueeze(0))
            assert c.stats.matched_tokens == 90


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_sparse_path_answers(tmp_path, family):
    """Stored exactly, then read with ``important_ratio=0.25``: full-attention layers load
    a quarter of the rows; with the defaults (``decode="full"``, refresh) the answer equals
    plain generate, and every step after the first (whose logits come from the sparse
    prefill unless the guard fires) has its logits."""
    model = family_model(family)
    doc = tokens(1, 200)
    with ImpressStore(tmp_path, model, EXACT) as store:
        run(model, doc.unsqueeze(0), cache=ImpressCache(store))
    prompt = torch.cat([doc, tokens(7, 12)]).unsqueeze(0)
    ref, ref_logits = run(model, prompt, new_tokens=6)
    with ImpressStore(tmp_path, model, ImpressConfig(important_ratio=0.25, chunk_tokens=16)) as store:
        cache = ImpressCache(store)
        seq, logits = run(model, prompt, cache=cache, new_tokens=6)
        has_full = any(i.kind == "full" for i in store.spec.model_layers)
        assert cache.stats.reused_columns == 200
        if has_full:
            assert cache.stats.loaded_tokens == 64  # 0.25 of 200, whole 16-row blocks
        assert torch.equal(seq, ref)
        assert (logits[:, 1:] - ref_logits[:, 1:]).abs().max() < 1e-4
        keep = ImpressCache(store)
        out, _ = run(model, *left_pad([prompt[0], torch.cat([doc[:150], tokens(8, 9)])]), cache=keep, new_tokens=4)
        assert out.shape == (2, 216)


def test_shared_kv_layers_store_nothing(tmp_path):
    model = family_model("gemma4_text-shared")
    with ImpressStore(tmp_path, model, EXACT) as store:
        kinds = [i.kind for i in store.spec.model_layers]
        assert kinds.count("shared") == 2 and store.spec.num_layers == 4


@pytest.mark.parametrize("family", sorted(STATE_FAMILIES))
def test_hybrid_models_reuse_from_state_checkpoints(tmp_path, family):
    """A hybrid model stores a checkpoint of its state layers after each stored prompt;
    a request that extends the prompt restores it and computes only its own tokens,
    exactly. A request that diverges inside a stored prompt has no checkpoint there and
    is cut back to the last one (here none: everything computed, still exact)."""
    model = family_model(family)
    doc = tokens(1, 60)
    with ImpressStore(tmp_path, model, EXACT) as store:
        assert store.spec.state_layers
        first = assert_same_as_uncached(model, store, doc.unsqueeze(0), new_tokens=3)
        assert first.stats.matched_tokens == 0
        assert store.stats()["state_checkpoints"] == 1 and store.stats()["state_bytes"] > 0
        c = assert_same_as_uncached(model, store, torch.cat([doc, tokens(2, 10)]).unsqueeze(0), new_tokens=3)
        assert c.stats.matched_tokens == 60 and c.stats.computed_tokens == 10
        c = assert_same_as_uncached(model, store, torch.cat([doc[:40], tokens(3, 10)]).unsqueeze(0), new_tokens=3)
        assert c.stats.matched_tokens == 0
        assert_same_as_uncached(model, store, *left_pad([doc, tokens(4, 30)]), new_tokens=3)  # a batch: no reuse, exact
        # beams and repeated rows after a restored state: the states follow the rows
        ext = torch.cat([doc, tokens(7, 6)]).unsqueeze(0)
        for kw in (dict(num_beams=2), dict(num_beams=2, num_return_sequences=2)):
            ref = model.generate(ext, max_new_tokens=3, do_sample=False, **kw)
            with torch.no_grad():
                out = model.generate(ext, max_new_tokens=3, do_sample=False, **kw, **{CACHE_KWARG: ImpressCache(store)})
            assert torch.equal(out, ref)
    with ImpressStore(tmp_path, model, EXACT) as store:  # restart; damage is not served
        c = assert_same_as_uncached(model, store, torch.cat([doc, tokens(5, 8)]).unsqueeze(0), new_tokens=3)
        assert c.stats.matched_tokens == 60
        ckpt = tmp_path / "states" / StateCheckpoints.name(doc.tolist())
        raw = bytearray(ckpt.read_bytes())
        raw[-1] ^= 0xFF
        ckpt.write_bytes(bytes(raw))
        c = assert_same_as_uncached(model, store, torch.cat([doc, tokens(6, 8)]).unsqueeze(0), new_tokens=3)
        assert c.stats.matched_tokens == 0


@pytest.mark.parametrize("family", sorted(REFUSED_FAMILIES))
def test_layers_it_cannot_serve_are_refused_naming_them(tmp_path, family):
    model = family_model(family)
    why = {"glm_moe_dsa": r"layer 0 of glm_moe_dsa .*indexed_attention.*DynamicIndexedLayer",
           "minimax": r"minimax .* of 2 layers for its 4 layers"}[family]
    with pytest.raises(UnsupportedModelError, match=why):
        ImpressStore(tmp_path, model, EXACT)


def test_non_text_inputs_are_refused(tmp_path):
    """K/V of a prompt with an image depend on more than its token ids: never served or
    stored by a store keyed on ids."""
    model = family_model("llama")
    with ImpressStore(tmp_path, model, EXACT) as store:
        cache = ImpressCache(store)  # (the hooks' generate wrapper is there before generate is looked up)
        with pytest.raises(CacheUsageError, match=r"non-text inputs \(pixel_values=\)"):
            model.generate(tokens(1, 20).unsqueeze(0), pixel_values=torch.zeros(1, 3, 8, 8), max_new_tokens=2,
                           **{CACHE_KWARG: cache})
        store.flush()
        assert store.stats()["prompts_written"] == 0


@pytest.mark.parametrize("family", ["gemma3_text", "cohere2", "llama"])
def test_decode_full_reads_only_what_the_sparse_layers_lack(tmp_path, family):
    """With ``decode="full"`` the rest of the prefix is read for the sparse (full-attention)
    layers only: the other layers hold their rows already (a window layer the ones it
    still sees), so reading theirs again would only cost bytes."""
    types = ["sliding_attention", "full_attention"] * 2 if family == "gemma3_text" else None
    model = family_model(family, **({"layer_types": types} if types else {}))
    doc = tokens(1, 200)
    with ImpressStore(tmp_path, model, EXACT) as store:
        run(model, doc.unsqueeze(0), cache=ImpressCache(store))
    prompt = torch.cat([doc, tokens(7, 12)]).unsqueeze(0)
    ref, ref_logits = run(model, prompt, new_tokens=4)
    cfg = ImpressConfig(important_ratio=0.25, chunk_tokens=16)  # decode="full", refresh, guard
    with ImpressStore(tmp_path, model, cfg) as store:
        cache = ImpressCache(store)
        seq, logits = run(model, prompt, cache=cache, new_tokens=4)
        spec = store.spec
        row_bytes = spec.kv_bytes_per_token // spec.num_layers
        full = sum(info.kind == "full" for info in spec.model_layers)
    assert torch.equal(seq, ref) and (logits - ref_logits).abs().max() < 1e-4
    s = cache.stats
    rest = s.bytes_read_decode + s.bytes_read_guard
    assert rest > 0
    # the sparse layers' rows not read for the prefill, nothing of the other layers
    assert rest <= row_bytes * full * (200 - s.loaded_tokens)


def test_probes_are_read_only_for_the_layers_that_choose(tmp_path):
    """A layer that holds its rows without choosing them (a window layer) never scores
    probes: the probe loader reads the choosing layers' probe copies and nothing else."""
    from impress_cache.hf.loaders import ProbeLoader
    from impress_cache.stats import RequestStats

    model = family_model("llama")
    doc = tokens(1, 200)
    with ImpressStore(tmp_path, model, EXACT) as store:
        run(model, doc.unsqueeze(0), cache=ImpressCache(store))
    with ImpressStore(tmp_path, model, ImpressConfig(important_ratio=0.25, chunk_tokens=16, host_bytes=0, device_bytes=0)) as store:
        layouts = [store.layout(store.match(doc.tolist()).segments)]
        read = {}
        for name, layers in (("all", None), ("two", {1, 3})):
            loader = ProbeLoader(store, layouts, RequestStats(), layers=layers)
            got = [loader.layer(i)[0] for i in range(4)]
            read[name] = loader.read.disk_bytes
            assert all(g is not None for g in got) if layers is None else [g is not None for g in got] == [False, True, False, True]
    assert read["two"] * 2 == read["all"] > 0
