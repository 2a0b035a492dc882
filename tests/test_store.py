"""Storage guarantees: model binding, checksums and quarantine, crash safety, clear errors."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from conftest import VOCAB, tiny_model
from helpers import assert_same_as_uncached, left_pad, run
from impress_cache import (
    CacheUsageError,
    ConfigError,
    ImpressCache,
    ImpressConfig,
    ImpressStore,
    ModelMismatchError,
    UnsupportedModelError,
)
from impress_cache.store import CHUNK_DIR, QUARANTINE_DIR

CFG = ImpressConfig(chunk_tokens=16, important_ratio=1.0)
ROOT = Path(__file__).resolve().parents[1]


def _doc(seed=0, n=96):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (1, n), generator=g)


def _flip_in_first_kv_block(f: Path) -> None:
    """Flip one byte inside the first K/V block (right after the safetensors header)."""
    raw = bytearray(f.read_bytes())
    data_start = 8 + int.from_bytes(raw[:8], "little")
    raw[data_start + 100] ^= 0xFF
    f.write_bytes(bytes(raw))


def _chunk_files(d: Path) -> list[Path]:
    return sorted((d / CHUNK_DIR).iterdir())


# -- model binding -------------------------------------------------------------------
def test_other_weights_are_refused_naming_the_field(tmp_path):
    ImpressStore(tmp_path, tiny_model("llama", seed=0), CFG).close()
    with pytest.raises(ModelMismatchError, match="weights_sha256"):
        ImpressStore(tmp_path, tiny_model("llama", seed=1), CFG)


def test_other_architecture_is_refused_naming_the_field(tmp_path):
    ImpressStore(tmp_path, tiny_model("llama"), CFG).close()
    with pytest.raises(ModelMismatchError, match="model_type"):
        ImpressStore(tmp_path, tiny_model("qwen2"), CFG)


def test_other_kv_dtype_is_refused(tmp_path):
    model = tiny_model("llama")
    ImpressStore(tmp_path, model, CFG).close()
    with pytest.raises(ModelMismatchError, match="kv_dtype"):
        ImpressStore(tmp_path, model, ImpressConfig(kv_dtype="float16"))


def test_unsupported_architecture_lists_supported(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=64))
    with pytest.raises(UnsupportedModelError, match="llama, mistral, qwen2, qwen3"):
        ImpressStore(tmp_path, model, CFG)


# -- damaged data never yields wrong output -------------------------------------------------
@pytest.mark.parametrize("damage", ["flip", "truncate", "delete"])
def test_damaged_chunk_file_is_quarantined_and_output_stays_exact(tmp_path, damage, caplog):
    model = tiny_model("llama")
    doc = _doc()
    with ImpressStore(tmp_path, model, CFG) as store:
        assert_same_as_uncached(model, store, doc)
    (f,) = _chunk_files(tmp_path)
    if damage == "flip":
        _flip_in_first_kv_block(f)
    elif damage == "truncate":
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    else:
        f.unlink()
    with ImpressStore(tmp_path, model, CFG) as store:
        cache = assert_same_as_uncached(model, store, doc)
        assert cache.stats.quarantined_files == 1
        assert cache.stats.matched_tokens == 0 and cache.stats.computed_tokens == doc.shape[1]
        assert "quarantined" in caplog.text
        if damage != "delete":
            assert (tmp_path / QUARANTINE_DIR / f.name).exists()
        # the request stored a fresh copy, which the next request reuses
        again = assert_same_as_uncached(model, store, doc)
        assert again.stats.matched_tokens == doc.shape[1] - 1


def test_damage_in_a_later_node_keeps_the_earlier_part(tmp_path):
    model = tiny_model("llama")
    doc = _doc(1, 64)
    longer = torch.cat([doc, _doc(2, 40)], dim=1)
    with ImpressStore(tmp_path, model, CFG) as store:
        assert_same_as_uncached(model, store, doc)
        assert_same_as_uncached(model, store, longer)
    newest = max(_chunk_files(tmp_path), key=lambda p: p.stat().st_mtime_ns)
    _flip_in_first_kv_block(newest)
    with ImpressStore(tmp_path, model, CFG) as store:
        cache = assert_same_as_uncached(model, store, longer)
        assert cache.stats.quarantined_files == 1
        assert cache.stats.matched_tokens == 64  # the undamaged first prompt still serves


# -- crashes ----------------------------------------------------------------------------
_CRASH = textwrap.dedent(
    """
    import os, sys, torch
    sys.path.insert(0, {tests!r})
    from conftest import tiny_model
    from impress_cache import ImpressCache, ImpressConfig, ImpressStore
    import impress_cache.store as st
    import impress_cache.index as ix
    where = sys.argv[1]
    if where == "before_rename":
        st.os.replace = lambda *a, **k: os._exit(3)
    elif where == "before_commit":
        ix.Index.add_file = lambda *a, **k: os._exit(3)
    model = tiny_model("llama")
    store = ImpressStore({path!r}, model, ImpressConfig(chunk_tokens=16, important_ratio=1.0))
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(3, 256, (1, 80), generator=g)
    model.generate(ids, past_key_values=ImpressCache(store, ids), max_new_tokens=2, do_sample=False)
    store.close()
    """
)


@pytest.mark.parametrize("where", ["before_rename", "before_commit"])
def test_crash_during_write_loses_nothing_and_leaves_no_garbage(tmp_path, where):
    model = tiny_model("llama")
    doc = _doc(3)
    with ImpressStore(tmp_path, model, CFG) as store:
        assert_same_as_uncached(model, store, doc)
    before = _chunk_files(tmp_path)
    script = _CRASH.format(tests=str(ROOT / "tests"), path=str(tmp_path))
    proc = subprocess.run([sys.executable, "-c", script, where], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 3, proc.stderr[-2000:]
    assert len(list((tmp_path / CHUNK_DIR).iterdir())) == len(before) + 1  # the half-done write
    with ImpressStore(tmp_path, model, CFG) as store:
        assert _chunk_files(tmp_path) == before  # leftovers removed on open
        cache = assert_same_as_uncached(model, store, doc)
        assert cache.stats.matched_tokens == doc.shape[1] - 1


def test_another_process_sees_new_prompts(tmp_path):
    model = tiny_model("llama")
    with ImpressStore(tmp_path, model, CFG) as store:
        assert store.match(list(range(3, 83))).length == 0
        script = _CRASH.format(tests=str(ROOT / "tests"), path=str(tmp_path))
        proc = subprocess.run([sys.executable, "-c", script, "none"], capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
        g = torch.Generator().manual_seed(5)
        ids = torch.randint(3, 256, (1, 80), generator=g)
        cache = assert_same_as_uncached(model, store, ids)
        assert cache.stats.matched_tokens == 79


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
        store.model.generate(doc, past_key_values=ImpressCache(store, doc), cache_implementation="static", max_new_tokens=2)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"chunk_tokens": 0}, "chunk_tokens"),
        ({"chunk_tokens": 2.5}, "chunk_tokens"),
        ({"important_ratio": 0.0}, "important_ratio"),
        ({"important_ratio": 1.5}, "important_ratio"),
        ({"probe_heads": 0}, "probe_heads"),
        ({"selection": "tokens"}, "selection"),
        ({"decode": "partial"}, "decode"),
        ({"kv_dtype": "int8"}, "kv_dtype"),
        ({"device_bytes": -1}, "device_bytes"),
        ({"tier_shares": {"high": 0.5, "medium": 0.5, "low": 0.5}}, "tier_shares"),
        ({"similarity_threshold": 2.0}, "similarity_threshold"),
        ({"similarity_alpha": "0.6"}, "similarity_alpha"),
        ({"important_ratio": True}, "important_ratio"),
        ({"fsync": "yes"}, "fsync"),
        ({"probe_dtype": "int2"}, "probe_dtype"),
        ({"selection": "h20"}, "selection"),
    ],
)
def test_config_out_of_range(kwargs, field):
    with pytest.raises(ConfigError, match=field):
        ImpressConfig(**kwargs)


def test_store_needs_config_object(tmp_path):
    with pytest.raises(TypeError, match="ImpressConfig"):
        ImpressStore(tmp_path, tiny_model("llama"), {"chunk_tokens": 16})
