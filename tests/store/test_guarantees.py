"""Storage guarantees: model binding, checksums and quarantine, crash safety, other processes."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from conftest import VOCAB, tiny_model
from helpers import assert_same_as_uncached
from impress_cache import (
    ImpressConfig,
    ImpressStore,
    ModelMismatchError,
    UnsupportedModelError,
)
from impress_cache.store import CHUNK_DIR, QUARANTINE_DIR

CFG = ImpressConfig(chunk_tokens=16, important_ratio=1.0)
ROOT = Path(__file__).resolve().parents[2]


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


def test_a_model_without_a_layered_cache_is_refused_naming_it(tmp_path):
    from torch import nn

    class NotAnLM(nn.Module):
        config = None

    with pytest.raises(UnsupportedModelError, match="expected a Hugging Face causal LM"):
        ImpressStore(tmp_path, NotAnLM(), CFG)


def test_gpt2_absolute_positions_reuse_exactly(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=16, vocab_size=64)).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    doc = torch.randint(3, 64, (1, 40), generator=torch.Generator().manual_seed(1))
    with ImpressStore(tmp_path, model, CFG) as store:
        assert_same_as_uncached(model, store, doc)
        c = assert_same_as_uncached(model, store, torch.cat([doc, doc[:, :5]], dim=1))
        assert c.stats.matched_tokens == 40


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
        cache = assert_same_as_uncached(model, store, doc)  # exact: the prefix was recomputed on the side
        assert cache.stats.quarantined_files == 1
        assert cache.stats.recomputed_layers >= 1  # from the layer where the damage was found
        assert "quarantined" in caplog.text
        assert store.match(doc[0].tolist()).length == doc.shape[1]  # stored again by that request
        if damage != "delete":
            assert (tmp_path / QUARANTINE_DIR / f.name).exists()
        # the fresh copy serves the next request
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
    first = min(_chunk_files(tmp_path), key=lambda p: p.stat().st_mtime_ns)
    with ImpressStore(tmp_path, model, CFG) as store:
        cache = assert_same_as_uncached(model, store, longer)
        assert cache.stats.quarantined_files == 1 and cache.stats.recomputed_layers == 2
        assert first.exists() and not newest.exists()  # only the damaged file went
        assert (tmp_path / QUARANTINE_DIR / newest.name).exists()
        # the undamaged first prompt still serves
        assert store.match(torch.cat([doc, _doc(3, 5)], dim=1)[0].tolist()).length == 64


# -- crashes ----------------------------------------------------------------------------
_CRASH = textwrap.dedent(
    """
    import os, sys, torch
    sys.path.insert(0, {tests!r})
    from conftest import tiny_model
    from impress_cache import ImpressCache, ImpressConfig, ImpressStore
    from impress_cache.hf.compat import CACHE_KWARG
    import impress_cache.store.writer as st
    import impress_cache.index.sqlite as ix
    where = sys.argv[1]
    if where == "before_rename":
        st.os.replace = lambda *a, **k: os._exit(3)
    elif where == "before_commit":
        ix.Index.add_file = lambda *a, **k: os._exit(3)
    model = tiny_model("llama")
    store = ImpressStore({path!r}, model, ImpressConfig(chunk_tokens=16, important_ratio=1.0))
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(3, 256, (1, 80), generator=g)
    model.generate(ids, max_new_tokens=2, do_sample=False, **{{CACHE_KWARG: ImpressCache(store)}})
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
        store.flush()  # the writer thread's first job: the crash-leftover scan
        assert _chunk_files(tmp_path) == before  # leftovers removed
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
