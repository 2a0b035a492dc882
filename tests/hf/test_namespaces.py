"""Namespaces: ``ImpressCache(store, namespace=...)`` matches only prefixes stored under
its own namespace and stores under it; the default namespace (None) is as before."""

from __future__ import annotations

import sqlite3

import pytest
import torch

from families import family_model
from helpers import run, tokens
from impress_cache import ImpressCache, ImpressConfig, ImpressStore
from impress_cache.hf.compat import CACHE_KWARG
from impress_cache.store.repair import repair

EXACT = ImpressConfig(important_ratio=1.0, chunk_tokens=16)


def _ask(model, store, ids, namespace=None, new_tokens=6, store_answer=False):
    """generate through a cache of ``namespace``; the answer must equal plain generate's."""
    ref, ref_logits = run(model, ids, new_tokens=new_tokens)
    cache = ImpressCache(store, namespace=namespace, store_answer=store_answer)
    seq, logits = run(model, ids, cache=cache, new_tokens=new_tokens)
    assert torch.equal(seq, ref)
    assert (logits - ref_logits).abs().max().item() <= 1e-4
    store.flush()
    return cache, seq


def test_two_namespaces_never_match_each_others_prefixes(tmp_path, tiny_llama):
    prompt = tokens(1, 60).unsqueeze(0)
    with ImpressStore(tmp_path, tiny_llama, EXACT) as store:
        first, _ = _ask(tiny_llama, store, prompt, "team-a")
        assert first.stats.matched_tokens == 0 and first.stats.stored_prompts == 1
        for other in ("team-b", None):  # the same tokens: nothing of team-a shows
            c, _ = _ask(tiny_llama, store, prompt, other)
            assert c.stats.matched_tokens == 0, other
        for ns in ("team-a", "team-b", None):  # each now finds its own copy
            c, _ = _ask(tiny_llama, store, prompt, ns)
            assert c.stats.matched_tokens == 59, ns
        assert store.match(prompt[0].numpy(), namespace="team-c").length == 0
        assert store.match(prompt[0].numpy(), namespace="team-a").length == 60
        # three disjoint subtrees under the root, one per namespace
        assert len(store.tree.root.children) == 3


def test_the_default_namespace_is_unchanged(tmp_path, tiny_llama):
    """No namespace: the keys are the tokens themselves, as before namespaces."""
    prompt = tokens(2, 40).unsqueeze(0)
    with ImpressStore(tmp_path, tiny_llama, EXACT) as store:
        _ask(tiny_llama, store, prompt)
        (f,) = store.index.files()
        assert f.tokens.tolist() == prompt[0].tolist()
        _ask(tiny_llama, store, prompt, "x")
        keys = sorted(int(r.tokens[0]) for r in store.index.files())
        assert keys[0] < 0 and keys[1] == int(prompt[0, 0])  # the namespace's first row is keyed apart
        c, _ = _ask(tiny_llama, store, prompt)
        assert c.stats.matched_tokens == 39


def test_a_namespace_persists_across_reopen(tmp_path, tiny_llama):
    prompt = tokens(3, 50).unsqueeze(0)
    with ImpressStore(tmp_path, tiny_llama, EXACT) as store:
        _ask(tiny_llama, store, prompt, "alice", store_answer=True)
    with ImpressStore(tmp_path, tiny_llama, EXACT) as store:
        c, out = _ask(tiny_llama, store, prompt, "alice")
        assert c.stats.matched_tokens == 49
        c, _ = _ask(tiny_llama, store, prompt, "bob")
        assert c.stats.matched_tokens == 0
        # the next turn matches through alice's answer, only for alice
        nxt = torch.cat([out, tokens(4, 5).unsqueeze(0)], dim=1)
        assert _ask(tiny_llama, store, nxt, "alice")[0].stats.matched_tokens == 50 + 6 - 1
        assert _ask(tiny_llama, store, nxt, "carol")[0].stats.matched_tokens == 0
    with ImpressStore(tmp_path, tiny_llama, EXACT, read_only=True) as store:
        assert store.match(prompt[0].numpy(), namespace="alice").length == 50
        assert store.match(prompt[0].numpy(), namespace="dave").length == 0


def test_a_store_made_before_namespaces_opens_and_takes_them(tmp_path, tiny_llama):
    prompt = tokens(5, 30).unsqueeze(0)
    with ImpressStore(tmp_path, tiny_llama, EXACT) as store:
        _ask(tiny_llama, store, prompt)
    conn = sqlite3.connect(tmp_path / "index.sqlite")
    conn.execute("DROP TABLE namespaces")  # as a store of the version before
    conn.commit()
    conn.close()
    with ImpressStore(tmp_path, tiny_llama, EXACT, read_only=True) as store:  # (no table: nothing under any namespace)
        assert store.match(prompt[0].numpy(), namespace="a").length == 0
        assert store.match(prompt[0].numpy()).length == 30
    with ImpressStore(tmp_path, tiny_llama, EXACT) as store:
        assert _ask(tiny_llama, store, prompt)[0].stats.matched_tokens == 29
        assert _ask(tiny_llama, store, prompt, "a")[0].stats.matched_tokens == 0
        assert _ask(tiny_llama, store, prompt, "a")[0].stats.matched_tokens == 29


def test_a_repair_keeps_the_namespaces_and_sets_aside_what_it_cannot_name(tmp_path, tiny_llama):
    prompt = tokens(6, 40).unsqueeze(0)
    with ImpressStore(tmp_path, tiny_llama, EXACT) as store:
        for ns in ("a", None):
            _ask(tiny_llama, store, prompt, ns)
    out = repair(tmp_path)
    assert out["files"] == 2 and not out["quarantined"]
    with ImpressStore(tmp_path, tiny_llama, EXACT) as store:
        assert store.match(prompt[0].numpy(), namespace="a").length == 40
        assert store.match(prompt[0].numpy(), namespace="b").length == 0  # a new namespace: a new id
        _ask(tiny_llama, store, prompt, "b")
    (tmp_path / "index.sqlite").unlink()  # the index is lost: nothing names the namespaces' ids any more
    out = repair(tmp_path)
    assert out["files"] == 1 and len(out["quarantined"]) == 2
    with ImpressStore(tmp_path, tiny_llama, EXACT) as store:
        assert store.match(prompt[0].numpy()).length == 40
        for ns in ("c", "a", "b"):  # ids handed out again never reach the set-aside prefixes
            assert store.match(prompt[0].numpy(), namespace=ns).length == 0
            _ask(tiny_llama, store, prompt, ns)
            assert store.match(prompt[0].numpy(), namespace=ns).length == 40


def test_a_hybrid_models_states_are_kept_per_namespace(tmp_path):
    model = family_model("qwen3_5_text")
    prompt = tokens(7, 40).unsqueeze(0)
    with ImpressStore(tmp_path, model, EXACT) as store:
        ref = _ask(model, store, prompt, "a")[0]
        assert ref.stats.matched_tokens == 0
        assert _ask(model, store, prompt, "b")[0].stats.matched_tokens == 0
        assert _ask(model, store, prompt)[0].stats.matched_tokens == 0
        for ns in ("a", "b", None):
            c = _ask(model, store, torch.cat([prompt, tokens(8, 4).unsqueeze(0)], dim=1), ns)[0]
            assert c.stats.matched_tokens == 40, ns


@pytest.mark.parametrize(
    "bad, error", [("", ValueError), ("x" * 1025, ValueError), (7, TypeError), (b"a", TypeError)]
)
def test_a_bad_namespace_is_refused_clearly(tmp_path, tiny_llama, bad, error):
    with ImpressStore(tmp_path, tiny_llama, EXACT) as store:
        with pytest.raises(error, match="namespace"):
            ImpressCache(store, namespace=bad)
        with pytest.raises(error, match="namespace"):
            store.match([1, 2, 3], namespace=bad)
        ImpressCache(store, namespace="x" * 1024)  # the longest accepted


def test_generate_with_a_namespaced_cache_kwarg(tmp_path, tiny_llama):
    """The cache of a namespace bound by generate itself, a batch of two rows."""
    rows = torch.stack([tokens(9, 24), tokens(10, 24)])
    with ImpressStore(tmp_path, tiny_llama, EXACT) as store:
        for expect in (0, 2 * 23):
            cache = ImpressCache(store, namespace="batch")
            with torch.no_grad():
                tiny_llama.generate(rows, max_new_tokens=3, do_sample=False, **{CACHE_KWARG: cache})
            store.flush()
            assert cache.stats.matched_tokens == expect
        assert store.match(rows[0].numpy()).length == 0
