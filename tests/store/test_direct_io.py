"""Exact reuse's direct reads with ``O_DIRECT`` (`ImpressConfig.direct_io`): what each
setting reads past the page cache, exactness (float32, bfloat16, both chunk formats,
through generate), damage caught and recomputed, a file system without ``O_DIRECT``,
the second descriptor closed with the first."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

from conftest import VOCAB, tiny_model
from helpers import assert_same_as_uncached
from impress_cache import ConfigError, CorruptBlockError, ImpressConfig, ImpressStore
from impress_cache.storage.pagecache import cached_bytes
from impress_cache.store import CHUNK_DIR, QUARANTINE_DIR
from impress_cache.tools import drop_page_cache
from test_direct_rows import TIERS_OFF, _buffer, _flip_first_kv_block_byte, _kv
from test_reorder import _model

pytestmark = pytest.mark.skipif(not hasattr(os, "O_DIRECT"), reason="no O_DIRECT on this platform")
RUNS = ("runs_direct_io", "runs_buffered", "runs_direct_io_refused")


def _runs(store):
    s = store.stats()
    return tuple(s[k] for k in RUNS)


def _stored(path, direct_io, fmt="safetensors", dtype="float32", n=300):
    """A store (tiers off) holding one prompt of ``n`` tokens; returns it open, with its K/V."""
    cfg = ImpressConfig(chunk_tokens=16, fsync=False, kv_dtype=dtype, direct_io=direct_io, **TIERS_OFF)
    store = ImpressStore(path, _model(), cfg, storage_format=fmt)
    spec = store.spec
    ks, vs = _kv(spec.num_layers, spec.num_kv_heads, n, spec.head_dim, spec.torch_kv_dtype, n)
    toks = [3 + i % 200 for i in range(n)]
    store.put(toks, ks, vs)
    return store, toks, ks, vs


def _can_tell(path):
    """Whether this kernel reports what of a file is in the page cache (``cachestat``)."""
    f = next((path / CHUNK_DIR).iterdir())
    fd = os.open(f, os.O_RDONLY)
    try:
        return cached_bytes(fd, 0, 4096) is not None
    finally:
        os.close(fd)


def _read_all(store, toks):
    """Every layer of the stored prefix read straight into a buffer of its own."""
    lay = store.layout(store.match(toks).segments)
    bufs = []
    for layer in range(store.spec.num_layers):
        buf = _buffer(store, len(toks), 0)
        store.start_rows(lay, layer, buf[:, 0]).result()
        bufs.append(buf[:, 0])
    return bufs


@pytest.mark.parametrize(("fmt", "dtype"), [("safetensors", "float32"), ("safetensors", "bfloat16"), ("hdf5", "float32")])
@pytest.mark.parametrize("direct_io", [True, False, "auto"])
def test_each_setting_reads_the_stored_rows_the_way_it_says(tmp_path, fmt, dtype, direct_io):
    """Just written (the file in the page cache), then guest-cold: every row is the stored
    one; ``True`` reads every run with ``O_DIRECT``, ``False`` none, ``"auto"`` only
    the cold ones; what the store counts as read does not depend on the setting."""
    store, toks, ks, vs = _stored(tmp_path, direct_io, fmt, dtype)
    with store:
        counted = []
        for cold in (False, True):
            if cold:
                drop_page_cache(tmp_path)
            store.reset_stats()
            for layer, buf in enumerate(_read_all(store, toks)):
                assert torch.equal(buf[0], ks[layer]) and torch.equal(buf[1], vs[layer])
            direct, buffered, refused = _runs(store)
            assert direct + buffered > 0 and refused == 0
            uses_direct = direct_io is True or (direct_io == "auto" and (cold or not _can_tell(tmp_path)))
            assert (direct > 0, buffered > 0) == (uses_direct, not uses_direct)
            s = store.stats()
            counted.append((s["bytes_read_disk"], s["blocks_read"], s["kv_bytes_read_disk"]))
        assert counted[0] == counted[1]


def test_a_damaged_byte_is_caught_when_read_past_the_page_cache(tmp_path):
    """A flipped byte, the file then dropped from the page cache: the ``O_DIRECT`` read
    raises `CorruptBlockError` naming the file and places none of the block's rows."""
    store, toks, ks, vs = _stored(tmp_path, True)
    with store:
        _flip_first_kv_block_byte(store, tmp_path)
        drop_page_cache(tmp_path)
        lay = store.layout(store.match(toks).segments)
        buf = _buffer(store, len(toks), 0)
        with pytest.raises(CorruptBlockError) as err:
            store.start_rows(lay, 0, buf[:, 0]).result()
        assert err.value.file_id == next(iter(store._catalog.records))
        assert bool(buf[:, 0, :, :16].isnan().all())
        store.start_rows(lay, 1, buf[:, 0]).result()  # the next layer: intact, read past the page cache
        assert torch.equal(buf[0, 0], ks[1]) and torch.equal(buf[1, 0], vs[1])
        assert _runs(store)[0] > 0


@pytest.mark.parametrize("direct_io", [True, "auto"])
def test_generate_reuses_exactly_and_recomputes_a_damaged_file(tmp_path, direct_io):
    """generate, guest-cold, reads every layer with ``O_DIRECT`` and matches generate
    without a cache; a damaged file is quarantined and the output stays exact."""
    model = tiny_model("llama")
    doc = torch.randint(3, VOCAB, (1, 150), generator=torch.Generator().manual_seed(8))
    ids = torch.cat([doc, doc[:, :4]], dim=1)
    cfg = ImpressConfig(chunk_tokens=16, important_ratio=1.0, direct_io=direct_io, **TIERS_OFF)
    with ImpressStore(tmp_path, model, cfg) as store:
        assert_same_as_uncached(model, store, doc)
    with ImpressStore(tmp_path, model, cfg) as store:
        drop_page_cache(tmp_path)
        c = assert_same_as_uncached(model, store, ids)
        assert c.stats.matched_tokens == 150 and c.stats.recomputed_layers == 0
        direct, buffered, refused = _runs(store)
        assert direct > 0 and buffered == refused == 0
    with ImpressStore(tmp_path, model, cfg) as store:
        f = next((tmp_path / CHUNK_DIR).iterdir())
        _flip_first_kv_block_byte(store, tmp_path, layer=1)
        drop_page_cache(tmp_path)
        c = assert_same_as_uncached(model, store, ids)
        assert c.stats.recomputed_layers >= 1
        assert not f.exists() and any((tmp_path / QUARANTINE_DIR).iterdir())


def test_a_store_in_shared_memory_reads_exactly():
    """A store on tmpfs (``/dev/shm``): tmpfs takes ``O_DIRECT`` since Linux 6.6 and
    refuses it at open before; either way every row is right and no run is refused."""
    if not Path("/dev/shm").is_dir():
        pytest.skip("no /dev/shm")
    d = Path(tempfile.mkdtemp(prefix="impress-odirect-", dir="/dev/shm"))
    try:
        store, toks, ks, vs = _stored(d / "s", True)
        with store:
            for layer, buf in enumerate(_read_all(store, toks)):
                assert torch.equal(buf[0], ks[layer]) and torch.equal(buf[1], vs[layer])
            direct, buffered, refused = _runs(store)
            assert direct + buffered > 0 and refused == 0
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_without_o_direct_every_run_is_read_through_the_page_cache(tmp_path, monkeypatch):
    """A platform without ``O_DIRECT`` (the flag removed from ``os``): no second
    descriptor is opened, every run is read through the page cache, the rows are exact."""
    monkeypatch.delattr(os, "O_DIRECT")
    store, toks, ks, vs = _stored(tmp_path, True)
    with store:
        drop_page_cache(tmp_path)
        for layer, buf in enumerate(_read_all(store, toks)):
            assert torch.equal(buf[0], ks[layer]) and torch.equal(buf[1], vs[layer])
        direct, buffered, refused = _runs(store)
        assert direct == refused == 0 and buffered > 0
        assert all(f.dfd == -1 for f in store._catalog.files._open.values())


def test_both_descriptors_are_closed_with_the_store(tmp_path):
    """Reading opens a buffered and an ``O_DIRECT`` descriptor per chunk file; closing
    the store closes both."""
    before = set(os.listdir("/proc/self/fd"))
    store, toks, _, _ = _stored(tmp_path, True)
    with store:
        drop_page_cache(tmp_path)
        _read_all(store, toks)
        files = list(store._catalog.files._open.values())
        assert files and all(f.fd is not None and f.dfd is not None and f.dfd >= 0 for f in files)
        during = set(os.listdir("/proc/self/fd"))
        assert len(during - before) >= 2 * len(files)
    leaked = [os.readlink(f"/proc/self/fd/{fd}") for fd in set(os.listdir("/proc/self/fd")) - before if os.path.exists(f"/proc/self/fd/{fd}")]
    assert not [p for p in leaked if CHUNK_DIR in p]


def test_direct_io_takes_only_its_three_values():
    for bad in (1, "yes", None):
        with pytest.raises(ConfigError, match="direct_io"):
            ImpressConfig(direct_io=bad)


def test_a_file_dropped_while_its_o_direct_descriptor_is_looked_up(tmp_path):
    """`OpenFiles.drop` (another thread evicting or quarantining the file) runs between
    `lend`'s first look at the kept ``O_DIRECT`` descriptor and its lending: nothing is
    lent (the reader opens the file for itself), both descriptors are closed at once (no
    reader holds them) and counted out. The drop is made to land there by a file record
    that drops itself when first asked."""
    store, toks, _, _ = _stored(tmp_path, True)
    with store:
        files = store._catalog.files
        f = files.get(next(iter(store._catalog.records)))
        loan = files.lend(f, direct=True)
        assert loan is not None and loan.dfd is not None  # opened and kept
        loan.release()
        kept = files._fds
        seen = []

        class DroppedMeanwhile(type(f)):
            def __getattribute__(self, name):
                value = object.__getattribute__(self, name)
                if name == "dfd" and not seen:
                    seen.append(value)
                    files.drop([self.record.id])  # (closes both descriptors, clears them)
                return value

        g = DroppedMeanwhile(**{k: getattr(f, k) for k in ("record", "path", "table", "fd", "dfd", "perm", "ident")})
        files._open[g.record.id] = g
        with files._use:  # (``f`` gives its descriptors to ``g``)
            f.fd = f.dfd = None
        assert files.lend(g, direct=True) is None
        assert seen and g.fd is None and g.dfd is None and g.users == 0
        assert files._fds == kept - 2 and _chunk_descriptors(tmp_path) == 0


def test_out_of_descriptors_is_not_taken_for_a_refusal(tmp_path):
    """No descriptor left for the ``O_DIRECT`` one (``EMFILE``, a passing condition):
    that read goes through the page cache, and a later one opens it (not remembered as
    the file system refusing ``O_DIRECT``)."""
    import resource

    store, toks, _, _ = _stored(tmp_path, True)
    with store:
        files = store._catalog.files
        f = files.get(next(iter(store._catalog.records)))
        loan = files.lend(f)
        assert loan is not None and loan.dfd is None and f.dfd is None
        loan.release()
        store.flush()  # (no write of the store's own in the window below)
        probe = os.open(os.devnull, os.O_RDONLY)  # the lowest free descriptor number: a limit there leaves none
        os.close(probe)
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (probe, hard))
        try:
            loan = files.lend(f, direct=True)
        finally:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        assert loan is not None and loan.fd == f.fd and loan.dfd is None and f.dfd is None
        loan.release()
        loan = files.lend(f, direct=True)
        assert loan is not None and loan.dfd is not None and loan.dfd >= 0 and f.dfd == loan.dfd
        loan.release()


def test_an_o_direct_descriptor_of_another_file_is_not_kept(tmp_path):
    """`open_direct` compares the new ``O_DIRECT`` descriptor's file with the one the
    buffered descriptor has open (its ``(st_dev, st_ino)``): the name led to another file
    (replaced meanwhile): no descriptor is opened for good (none left open), no error
    escapes, the answer is "none"."""
    from impress_cache.store.chunkfiles import open_direct

    store, toks, _, _ = _stored(tmp_path, True)
    with store:
        files = store._catalog.files
        f = files.get(next(iter(store._catalog.records)))
        before = set(os.listdir("/proc/self/fd"))
        assert open_direct(f, (0, 0), store._catalog.chunks_fd) < 0
        assert set(os.listdir("/proc/self/fd")) == before


def _chunk_descriptors(path: Path) -> int:
    """This process's open descriptors on the store's chunk files."""
    chunks = str((path / CHUNK_DIR).resolve())
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += os.readlink(f"/proc/self/fd/{fd}").startswith(chunks + "/")
        except OSError:
            pass
    return n


@pytest.mark.parametrize("direct_io", [True, False])
def test_a_store_with_more_files_than_its_descriptor_cap_keeps_at_most_the_cap_open(tmp_path, direct_io):
    """Past `OpenFiles.max_fds` kept descriptors, a read opens its file for itself and
    closes it after (through the page cache): a process reading more files than its
    descriptor limit allows never runs out, and every row is still the stored one."""
    store, toks, ks, vs = _stored(tmp_path, direct_io, n=40)
    with store:
        files = store._catalog.files
        files.max_fds = 3
        stored = [(toks, ks, vs)]
        spec = store.spec
        for i in range(1, 8):  # seven more prompts, each in a file of its own
            t = [200 + i] + [3 + (7 * i + j) % 190 for j in range(39)]
            k, v = _kv(spec.num_layers, spec.num_kv_heads, 40, spec.head_dim, spec.torch_kv_dtype, 40 + i)
            store.put(t, k, v)
            stored.append((t, k, v))
        assert len(list((tmp_path / CHUNK_DIR).iterdir())) == 8
        drop_page_cache(tmp_path)
        for _ in range(2):
            for t, k, v in stored:
                for layer, buf in enumerate(_read_all(store, t)):
                    assert torch.equal(buf[0], k[layer]) and torch.equal(buf[1], v[layer])
                assert files._fds <= 3 and _chunk_descriptors(tmp_path) <= 3
        kept = [d for f in files._open.values() for d in (f.fd, f.dfd) if d is not None and d >= 0]
        assert len(kept) == files._fds == 3
        files.drop(list(files._open))
        assert files._fds == 0 and _chunk_descriptors(tmp_path) == 0


def test_two_stores_share_one_descriptor_budget(tmp_path, monkeypatch):
    """The cap is the process's (`DESCRIPTORS`), not each store's: two open stores (a
    server's tenants) keep at most that many descriptors between them, every row still
    the stored one, and closing a store gives its share back."""
    from impress_cache.store import chunkfiles

    budget = chunkfiles.DESCRIPTORS
    monkeypatch.setattr(budget, "cap", budget.used + 3)  # two files would keep 4
    a, ta, ka, va = _stored(tmp_path / "a", True, n=40)
    b, tb, kb, vb = _stored(tmp_path / "b", True, n=48)
    with a, b:
        for store, t, k, v in ((a, ta, ka, va), (b, tb, kb, vb)) * 2:
            for layer, buf in enumerate(_read_all(store, t)):
                assert torch.equal(buf[0], k[layer]) and torch.equal(buf[1], v[layer])
        kept = a._catalog.files._fds + b._catalog.files._fds
        assert kept == 3 and budget.used == budget.cap
        assert _chunk_descriptors(tmp_path / "a") + _chunk_descriptors(tmp_path / "b") == kept
    assert budget.used == budget.cap - 3
