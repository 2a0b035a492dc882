"""The hooks a cache installs on its model: once per model, inert without an ImpressCache,
removable."""

from __future__ import annotations

import inspect
import math
import threading

import pytest
import torch

from conftest import VOCAB, tiny_model
from helpers import run, store_dense
from impress_cache import ImpressCache, ImpressConfig, ImpressStore, remove_hooks
from impress_cache.hf.compat import CACHE_KWARG
from impress_cache.hf.hooks import hooks_installed

SPELLINGS = ["cache", "past_key_values"] if CACHE_KWARG == "cache" else ["past_key_values"]


def _ids(seed: int, n: int) -> torch.Tensor:
    return torch.randint(3, VOCAB, (1, n), generator=torch.Generator().manual_seed(seed))


def _hook_count(model: torch.nn.Module) -> int:
    return sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())


@torch.no_grad()
def _plain_generations(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What generate gives without an ImpressCache: ids, inputs_embeds, another cache."""
    from transformers import DynamicCache

    ids = _ids(1, 20)
    embeds = model.get_input_embeddings()(ids)
    return {
        "ids": model.generate(ids, max_new_tokens=5, do_sample=False),
        "embeds": model.generate(inputs_embeds=embeds, max_new_tokens=5, do_sample=False),
        "dynamic": model.generate(ids, max_new_tokens=5, do_sample=False, **{CACHE_KWARG: DynamicCache()}),
        "dynamic, old spelling": model.generate(ids, past_key_values=DynamicCache(), max_new_tokens=5, do_sample=False),
        "assisted": model.generate(ids, prompt_lookup_num_tokens=3, max_new_tokens=5, do_sample=False),
    }


def test_hooks_change_nothing_without_an_impress_cache_and_can_be_removed(tmp_path):
    model = tiny_model("llama")
    before = _plain_generations(model)
    hooks_before = _hook_count(model)
    with ImpressStore(tmp_path, model, ImpressConfig(important_ratio=0.5)) as store:
        ids = _ids(2, 40)
        run(model, ids, cache=ImpressCache(store, ids))  # installs the hooks
        assert hooks_installed(model) and _hook_count(model) > hooks_before
        # the wrappers keep the signatures generate's feature checks read
        assert inspect.signature(model.generate) == inspect.signature(type(model).generate.__get__(model))
        assert inspect.signature(model.prepare_inputs_for_generation) == inspect.signature(
            type(model).prepare_inputs_for_generation.__get__(model)
        )
        after = _plain_generations(model)
        for name in before:
            assert torch.equal(before[name], after[name]), name
        assert remove_hooks(model) and not hooks_installed(model)
        assert _hook_count(model) == hooks_before
        assert "prepare_inputs_for_generation" not in vars(model) and "generate" not in vars(model)
        assert remove_hooks(model) is False  # removing twice is harmless
        # the next cache installs them again and works
        q = torch.cat([ids, _ids(3, 5)], dim=1)
        ref, _ = run(model, q)
        out, _ = run(model, q, cache=ImpressCache(store, q))
        assert hooks_installed(model) and out.shape == ref.shape


def test_threads_building_their_first_caches_install_the_hooks_once(tmp_path):
    model = tiny_model("llama")
    hooks_before = _hook_count(model)
    with ImpressStore(tmp_path, model, ImpressConfig(important_ratio=1.0)) as store:
        barrier = threading.Barrier(8)
        errors: list[BaseException] = []

        def build(seed: int) -> None:
            try:
                barrier.wait()
                ImpressCache(store, _ids(seed, 10))
            except BaseException as exc:  # pragma: no cover - reported below
                errors.append(exc)

        threads = [threading.Thread(target=build, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors
        installed = _hook_count(model) - hooks_before
        remove_hooks(model)
        ImpressCache(store, _ids(99, 10))
        assert _hook_count(model) - hooks_before == installed  # one set, not eight
        ids = _ids(4, 30)
        ref, _ = run(model, ids)
        out, _ = run(model, ids, cache=ImpressCache(store, ids))
        assert torch.equal(out, ref)


@pytest.mark.parametrize("spelling", SPELLINGS)
def test_query_capture_sees_the_cache_under_either_spelling(tmp_path, spelling):
    """A sparse prefill needs every layer's queries: the hooks find the cache whether generate
    got it as ``cache=`` (5.24; the decoder layers pass it on under that name) or as
    ``past_key_values=``."""
    model = tiny_model("qwen3")
    doc = _ids(5, 128)
    store_dense(tmp_path, model, doc)
    q = torch.cat([doc, _ids(6, 8)], dim=1)
    cfg = ImpressConfig(chunk_tokens=16, important_ratio=0.25, similarity_threshold=0.0, decode="keep")
    with ImpressStore(tmp_path, model, cfg) as store:
        cache = ImpressCache(store)
        run(model, q, cache=cache, new_tokens=3, cache_kwarg=spelling)
        assert sorted(cache.selections) == [0, 1]
        assert all(sel[0].numel() == 32 for sel in cache.selections.values())


def _queries_seen_and_used(tmp_path, monkeypatch, model, new):
    """One sparse prefill of ``new`` tokens after a stored 128-token document: per layer,
    the queries the capture handed to the cache and the ones the eager attention used."""
    import sys

    modeling = sys.modules[type(model.model.layers[0].self_attn).__module__]
    own: dict[int, torch.Tensor] = {}
    seen: dict[int, torch.Tensor] = {}
    attend, capture = modeling.eager_attention_forward, ImpressCache.capture_queries

    def recording_attend(module, query, *args, **kwargs):  # the queries the attention uses
        own.setdefault(module.layer_idx, query[..., -new:, :].detach().clone())
        return attend(module, query, *args, **kwargs)

    def recording_capture(self, layer_idx, queries):
        seen.setdefault(layer_idx, queries.detach().clone())
        return capture(self, layer_idx, queries)

    doc = _ids(5, 128)
    store_dense(tmp_path, model, doc)
    cfg = ImpressConfig(chunk_tokens=16, important_ratio=0.25, similarity_threshold=0.0, decode="keep")
    with ImpressStore(tmp_path, model, cfg) as store:
        monkeypatch.setattr(modeling, "eager_attention_forward", recording_attend)
        monkeypatch.setattr(ImpressCache, "capture_queries", recording_capture)
        run(model, torch.cat([doc, _ids(6, new)], dim=1), cache=ImpressCache(store), new_tokens=1)  # the prefill only
    monkeypatch.undo()
    return seen, own


@pytest.mark.parametrize("family", ["qwen3", "gemma3_text", "llama", "exaone4", "smollm3", "cohere2"])
@pytest.mark.parametrize("new", [4, 12])
def test_captured_queries_are_the_models_own(tmp_path, monkeypatch, caplog, family, new):
    """The queries a sparse prefill sees are the ones the attention computes with: normed
    before the transpose (Qwen 3) or after it (Gemma 3, EXAONE 4: the norm's output is
    already heads-first), also when the new tokens are as many as the heads (4: the shape
    alone cannot tell the two layouts apart), rotated where the attention rotates them
    and not in layers without position embeddings (EXAONE 4's and Cohere 2's global
    layers, SmolLM3's every fourth)."""
    from families import family_model

    layer_types = ["sliding_attention", "full_attention"] * 2  # full layers: where the queries are used
    model = family_model(family, attn="eager", **({"layer_types": layer_types} if family in ("gemma3_text", "exaone4", "cohere2") else {}))
    attns = [layer.self_attn for layer in model.model.layers]
    with caplog.at_level("WARNING"):
        seen, own = _queries_seen_and_used(tmp_path, monkeypatch, model, new)
    assert "cannot be captured" not in caplog.text
    full = [i for i, t in enumerate(getattr(model.config, "layer_types", None) or ["full_attention"] * len(attns)) if t == "full_attention"]
    assert full and set(full) <= set(seen)
    if family == "exaone4":  # the case the capture must not rotate is there
        assert not any(attns[i].sliding_window is None or attns[i].is_sliding for i in full)
    if family == "smollm3":
        assert not all(a.use_rope for a in attns)
    if family == "cohere2":  # (rotates only in its sliding layers)
        assert all(attns[i].sliding_window is None for i in full)
    for i in full:
        assert seen[i].shape == own[i].shape == (1, 4, new, 16)
        torch.testing.assert_close(seen[i], own[i])


#: families whose attention rotates its queries in some layers only, each with what its tiny
#: model needs besides `families._BASE` (layers alternate sliding and full attention)
_SOME_LAYERS_ROTATE = {
    "exaone4": {}, "exaone_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
    "kolibri1": {}, "cohere2": {}, "flint": {},
    "cohere2_moe": dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        mlp_layer_types=["dense", "dense", "sparse", "sparse"], prefix_dense_sliding_window_pattern=1,
    ),
    "afmoe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
    "smollm3": {}, "gemma3_text": {},  # (Gemma 3 rotates in every layer)
}


@pytest.mark.parametrize("family", sorted(_SOME_LAYERS_ROTATE))
def test_the_capture_rotates_the_queries_of_the_layers_whose_attention_rotates_them(family):
    """`hooks._rotates` says of every attention layer what its forward does: rotate the
    queries with the family's ``apply_rotary_pos_emb`` or leave them as they are (the
    global layers of EXAONE 4, Cohere 2 and their kin, SmolLM3's NoPE layers)."""
    import sys

    from transformers import AutoConfig, AutoModelForCausalLM

    from families import _BASE
    from impress_cache.hf.hooks import _rotates

    try:
        config = AutoConfig.for_model(
            family, **{**_BASE, "sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"] * 2, **_SOME_LAYERS_ROTATE[family]}
        )
    except ValueError:  # a family this transformers does not have
        pytest.skip(f"transformers has no {family}")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    attns = [layer.self_attn for layer in model.model.layers]
    modeling = sys.modules[type(attns[0]).__module__]
    rotate = modeling.apply_rotary_pos_emb
    current: list[int] = []
    rotated: set[int] = set()

    def recording_rotate(*args, **kwargs):
        rotated.add(current[-1])
        return rotate(*args, **kwargs)

    handles = [a.register_forward_pre_hook(lambda m, args: current.append(m.layer_idx)) for a in attns]
    try:
        with pytest.MonkeyPatch.context() as mp, torch.no_grad():
            mp.setattr(modeling, "apply_rotary_pos_emb", recording_rotate)
            model(_ids(1, 12))
    finally:
        for h in handles:
            h.remove()
    assert {a.layer_idx for a in attns if _rotates(a)} == rotated
    if family != "gemma3_text":
        assert rotated != {a.layer_idx for a in attns}  # a layer that does not rotate is there


def test_llama4_queries_of_layers_without_rope_are_captured_with_their_temperature(tmp_path, monkeypatch):
    """Llama 4 scales the queries of its layers without RoPE by a temperature that grows
    with the position (``attn_temperature_tuning``); the capture scales them the same, so
    sparse selection there scores with the queries the attention uses (a small
    ``floor_scale`` makes the factor differ from 1 at these positions)."""
    from families import family_model

    model = family_model("llama4_text", attn="eager", floor_scale=8, attn_scale=0.5)
    attns = [layer.self_attn for layer in model.model.layers]
    nope = [i for i, a in enumerate(attns) if not a.use_rope]
    assert nope and all(a.attn_temperature_tuning for a in attns)
    seen, own = _queries_seen_and_used(tmp_path, monkeypatch, model, 12)
    factor = math.log1p((128 + 1) // 8) * 0.5 + 1.0  # at the first new token, after the 128-token document
    assert factor > 2
    for i in nope:
        torch.testing.assert_close(seen[i], own[i])
