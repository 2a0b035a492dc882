"""A store with ``kv_codec``: smaller files, the codec fixed per store, repair never mixing
codecs, damaged encoded blocks caught by their checksums, sparse loading, both formats."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from conftest import VOCAB, tiny_model
from helpers import index_value, run
from impress_cache import ImpressCache, ImpressConfig, ImpressStore
from impress_cache.cli import main as cli_main
from impress_cache.errors import ConfigError, CorruptBlockError
from impress_cache.storage import kv_codec
from impress_cache.store import CHUNK_DIR, QUARANTINE_DIR

#: 64-row blocks: a tiny model's encoded block (64 * 80 bytes) still fits one 4 KiB-aligned
#: extent smaller than its float32 block (16 KiB)
CT = 64
N = 150


def _cfg(codec, **kw):
    return ImpressConfig(chunk_tokens=CT, important_ratio=1.0, reorg_idle_ms=None, kv_codec=codec, **kw)


def _tokens(seed: int = 0, n: int = N) -> torch.Tensor:
    return torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))


def _kv(spec, n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    keys = [torch.randn(spec.num_kv_heads, n, spec.head_dim, generator=g) * (1 + layer) for layer in range(spec.num_layers)]
    values = [torch.randn(spec.num_kv_heads, n, spec.head_dim, generator=g) for _ in range(spec.num_layers)]
    return keys, values


def _chunk_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in (path / CHUNK_DIR).iterdir())


def _put(path, model, codec, fmt="safetensors", seed=0):
    t = _tokens(seed)
    with ImpressStore(path, model, _cfg(codec), storage_format=fmt) as store:
        keys, values = _kv(store.spec, len(t), seed)
        store.put(t.tolist(), keys, values)
    return t, keys, values


def _within(got: torch.Tensor, want: torch.Tensor, codec: str) -> bool:
    absmax = want.abs().amax(-1, keepdim=True)
    bound = absmax / 254 if codec == "int8" else want.abs() / 16 + absmax / 448 / 1024
    return bool(((got - want).abs() <= bound * 1.0001 + 1e-7).all())


@pytest.mark.parametrize("fmt", ["safetensors", "hdf5"])
@pytest.mark.parametrize("codec", kv_codec.KV_CODECS)
def test_files_are_smaller_and_a_reopened_store_reads_close_rows(tmp_path, fmt, codec):
    model = tiny_model("llama")
    _put(tmp_path / "dense", model, None, fmt)
    t, keys, values = _put(tmp_path / "coded", model, codec, fmt)
    assert _chunk_bytes(tmp_path / "coded") < 0.8 * _chunk_bytes(tmp_path / "dense")
    with ImpressStore(tmp_path / "dense", model, _cfg(None), storage_format=fmt) as dense:
        exact = dense.load(dense.match(t.tolist(), limit=N - 1).segments)
        assert all(torch.equal(exact.keys[i], keys[i][:, : N - 1]) for i in range(len(keys)))  # no codec: bit-exact
    with ImpressStore(tmp_path / "coded", model, _cfg(codec, host_bytes=1 << 20), storage_format=fmt) as store:
        assert store.spec.kv_codec == codec
        m = store.match(t.tolist(), limit=N - 1)
        assert m.length == N - 1
        first = store.load(m.segments)
        assert first.bytes_read < 0.5 * exact.bytes_read  # the encoded blocks are what is read
        for i in range(len(keys)):
            assert _within(first.keys[i], keys[i][:, : N - 1], codec)
            assert _within(first.values[i], values[i][:, : N - 1], codec)
        assert first.keys.dtype == torch.float32 and not torch.equal(first.keys[0], keys[0][:, : N - 1])
        again = store.load(m.segments)  # from the memory tiers: decoded blocks, the same rows
        assert again.bytes_read == 0
        assert torch.equal(again.keys, first.keys) and torch.equal(again.values, first.values)
        spec = store.spec  # the tiers count the decoded bytes they hold (whole blocks: N rows)
        assert store.tiers.stats()["memory"]["hit_bytes"] == spec.num_layers * N * 2 * spec.num_kv_heads * spec.head_dim * 4


def test_the_model_record_names_the_codec_only_when_set(tmp_path):
    model = tiny_model("llama")
    for codec in (None, "int8"):
        with ImpressStore(tmp_path / str(codec), model, _cfg(codec)) as store:
            rec = store.index.get_json("model")
        assert ("kv_codec" in rec) == (codec is not None) and rec.get("kv_codec") == codec
    # the header of every chunk file carries the same record
    _put(tmp_path / "hdr", model, "fp8")
    (f,) = (tmp_path / "hdr" / CHUNK_DIR).iterdir()
    from impress_cache.storage import SafetensorsFormat

    assert json.loads(SafetensorsFormat().read_metadata(f)["model"])["kv_codec"] == "fp8"


def test_a_codec_store_has_a_schema_version_that_older_versions_refuse(tmp_path, capsys):
    """Versions before the codec read schema 3 only: a codec store records 4 (those
    versions would read its blocks as raw K/V and quarantine every file), a store without
    a codec stays 3; this version opens both, and a repaired codec store stays 4."""
    from impress_cache.index.schema import CODEC_SCHEMA_VERSION, SCHEMA_VERSION

    def version(path: Path) -> str:
        return index_value(path, "SELECT value FROM meta WHERE key='schema_version'")

    model = tiny_model("llama")
    _put(tmp_path / "plain", model, None)
    _put(tmp_path / "int8", model, "int8")
    assert (version(tmp_path / "plain"), version(tmp_path / "int8")) == (SCHEMA_VERSION, CODEC_SCHEMA_VERSION) == ("3", "4")
    with ImpressStore(tmp_path / "int8", model, _cfg("int8")) as store:  # reopened: still matched
        assert store.match(_tokens().tolist()).length == N
    assert version(tmp_path / "int8") == "4"
    (tmp_path / "int8" / "index.sqlite").unlink()
    for side in ("-wal", "-shm"):
        (tmp_path / "int8" / f"index.sqlite{side}").unlink(missing_ok=True)
    assert cli_main(["verify", "--repair", str(tmp_path / "int8")]) == 0
    capsys.readouterr()
    assert version(tmp_path / "int8") == "4"


@pytest.mark.parametrize(("made", "opened"), [(None, "int8"), ("int8", None), ("int8", "fp8"), ("fp8", "int8")])
def test_opening_a_store_with_another_codec_is_refused(tmp_path, made, opened):
    model = tiny_model("llama")
    ImpressStore(tmp_path, model, _cfg(made)).close()
    with pytest.raises(ConfigError, match=rf"kv_codec={made!r}, the config gives kv_codec={opened!r}"):
        ImpressStore(tmp_path, model, _cfg(opened))
    ImpressStore(tmp_path, model, _cfg(made)).close()  # its own codec still opens it
    with ImpressStore(tmp_path, None) as maint:  # maintenance open: the recorded codec
        assert maint.spec.kv_codec == made


@pytest.mark.parametrize("index_lost", [False, True])
def test_repair_keeps_the_stores_codec_and_quarantines_files_of_another(tmp_path, capsys, index_lost):
    """The old index names the store's codec; without it, the codec most files hold wins
    (two int8 files against one fp8 file, whatever their names' order)."""
    model = tiny_model("llama")
    t, keys, _ = _put(tmp_path / "a", model, "int8")
    _put(tmp_path / "a", model, "int8", seed=2)
    _put(tmp_path / "b", model, "fp8", seed=1)
    (foreign,) = (tmp_path / "b" / CHUNK_DIR).iterdir()
    shutil.copy(foreign, tmp_path / "a" / CHUNK_DIR / foreign.name)
    if index_lost:  # only the headers say
        for suffix in ("", "-wal", "-shm"):
            (tmp_path / "a" / f"index.sqlite{suffix}").unlink(missing_ok=True)
    assert cli_main(["verify", "--repair", str(tmp_path / "a")]) == 0
    out = capsys.readouterr().out
    assert foreign.name in out and "written with kv_codec='fp8', the store keeps kv_codec='int8'" in out
    assert (tmp_path / "a" / QUARANTINE_DIR / foreign.name).exists()
    with ImpressStore(tmp_path / "a", model, _cfg("int8")) as store:
        assert len(store.index.files()) == 2
        got = store.load(store.match(t.tolist(), limit=N - 1).segments)
        assert all(_within(got.keys[i], keys[i][:, : N - 1], "int8") for i in range(len(keys)))


@pytest.mark.parametrize("fmt", ["safetensors", "hdf5"])
def test_a_damaged_encoded_block_fails_its_checksum(tmp_path, fmt):
    model = tiny_model("llama")
    t, _, _ = _put(tmp_path, model, "int8", fmt)
    with ImpressStore(tmp_path, model, _cfg("int8"), storage_format=fmt) as store:
        rec = store.index.files()[0]
        offset = int(store.index.block_table(rec.id)[0][0, 0, 0])
    (f,) = (tmp_path / CHUNK_DIR).iterdir()
    raw = bytearray(f.read_bytes())
    raw[offset + 16 + 3] ^= 0x10  # a scale byte of the first row's first head
    f.write_bytes(bytes(raw))
    assert cli_main(["verify", str(tmp_path)]) == 1
    with ImpressStore(tmp_path, model, _cfg("int8", host_bytes=0, device_bytes=0), storage_format=fmt) as store:
        with pytest.raises(CorruptBlockError) as err:
            store.load(store.match(t.tolist(), limit=N - 1).segments)
        assert f.name in str(err.value)


def test_a_request_on_a_damaged_codec_store_quarantines_the_file_and_stays_close(tmp_path):
    model = tiny_model("llama")
    doc = _tokens(3, 96)[None]
    cfg = ImpressConfig(chunk_tokens=16, important_ratio=1.0, reorg_idle_ms=None, kv_codec="int8")
    with ImpressStore(tmp_path, model, cfg) as store:
        run(model, doc, cache=ImpressCache(store))
    (f,) = (tmp_path / CHUNK_DIR).iterdir()
    raw = bytearray(f.read_bytes())
    raw[8 + int.from_bytes(raw[:8], "little") + 100] ^= 0xFF  # inside the first K/V block
    f.write_bytes(bytes(raw))
    ref_seq, ref_logits = run(model, doc)
    with ImpressStore(tmp_path, model, cfg) as store:
        cache = ImpressCache(store)
        seq, logits = run(model, doc, cache=cache)
        assert cache.stats.quarantined_files == 1 and cache.stats.recomputed_layers >= 1
        assert (tmp_path / QUARANTINE_DIR / f.name).exists()
        assert torch.equal(seq, ref_seq) and (logits - ref_logits).abs().max() < 0.05


def test_sparse_loading_reads_encoded_blocks(tmp_path):
    model = tiny_model("llama")
    doc = _tokens(4, 200)[None]
    question = _tokens(5, 6)[None]
    prompt = torch.cat([doc, question], dim=1)
    outs = {}
    for codec in (None, "int8"):
        cfg = ImpressConfig(chunk_tokens=16, important_ratio=1.0, reorg_idle_ms=None, kv_codec=codec)
        with ImpressStore(tmp_path / str(codec), model, cfg) as store:
            run(model, doc, cache=ImpressCache(store))
            store.flush()
            sparse = ImpressConfig(chunk_tokens=16, important_ratio=0.5, decode="keep", reorg_idle_ms=None, kv_codec=codec)
        with ImpressStore(tmp_path / str(codec), model, sparse) as store:
            cache = ImpressCache(store)
            seq, logits = run(model, prompt, cache=cache)
            assert cache.stats.matched_tokens == 200 and cache.stats.bytes_read_probe > 0 and cache.stats.rows_selected > 0
            outs[codec] = (seq, logits, cache.stats.bytes_read_rows)
    # the codec's sparse prefill attends to nearly the same rows as the dense store's
    assert (outs["int8"][1][:, 0] - outs[None][1][:, 0]).abs().max() < 0.05
    assert outs["int8"][2] < outs[None][2]


def test_a_reordered_node_of_a_codec_store_keeps_its_rows(tmp_path):
    """Importance reordering reads the node's decoded rows and writes them encoded again:
    the rows read back are those read before (re-encoding decoded rows keeps their codes)."""
    import numpy as np

    model = tiny_model("llama")
    cfg = ImpressConfig(chunk_tokens=4, important_ratio=0.25, fsync=False, reorg_idle_ms=None, device_bytes=0,
                        host_bytes=0, kv_codec="int8")
    toks = list(range(3, 67))
    with ImpressStore(tmp_path, model, cfg) as store:
        keys, values = _kv(store.spec, len(toks))
        store.put(toks, keys, values)
        m = store.match(toks)
        before = store.load(m.segments)
        imp = np.zeros((store.spec.num_layers, m.length), np.float32)
        imp[:, ::4] = 1.0
        for _ in range(4):
            store.record_importance(store.match(toks).segments, imp)
        assert store.reorganize()["rewritten"] == 1
        (node,) = [n for n in store.tree.nodes() if n.parent is not None]
        assert store._catalog.perm_of(node.file_id) is not None
        after = store.load(store.match(toks).segments)
        assert torch.allclose(after.keys, before.keys, rtol=1e-6, atol=0) and torch.allclose(after.values, before.values, rtol=1e-6, atol=0)
        assert all(_within(after.keys[i], keys[i], "int8") for i in range(len(keys)))
