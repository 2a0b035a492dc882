"""The store touches only what it created, survives write failures and read-only volumes,
creates stores exclusively, installs hooks once, and loses nothing flush() confirmed when
killed. Real file systems, processes and threads; no mocks."""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import shutil
import signal
import stat
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch

from conftest import VOCAB, tiny_model
from helpers import run
from impress_cache import (
    ConfigError,
    ImpressCache,
    ImpressConfig,
    ImpressStore,
    ModelMismatchError,
    ReadOnlyStoreError,
    StoreFormatError,
)
from impress_cache.cli import main as cli_main
from impress_cache.hf.hooks import hooks_installed
from impress_cache.store import CHUNK_DIR, QUARANTINE_DIR

CFG = ImpressConfig(chunk_tokens=16, important_ratio=1.0, reorg_idle_ms=None)
ROOT = Path(__file__).resolve().parents[2]
IS_ROOT = os.geteuid() == 0


def _doc(seed: int, n: int = 64) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (1, n), generator=g)


def _exact(model, store, doc, new_tokens=4):
    cache = ImpressCache(store)
    out, _ = run(model, doc, cache=cache, new_tokens=new_tokens)
    assert torch.equal(out, run(model, doc, new_tokens=new_tokens)[0])
    return cache


def _tree(path: Path) -> dict[str, tuple[int, int]]:
    return {
        str(p.relative_to(path)): (p.lstat().st_mode, p.lstat().st_mtime_ns)
        for p in sorted(path.rglob("*"))
    }


# -- permissions ------------------------------------------------------------------------
def test_directories_0700_and_files_0600_whatever_the_umask(tmp_path):
    model = tiny_model("llama")
    old = os.umask(0o022)
    try:
        with ImpressStore(tmp_path / "s", model, CFG) as store:
            _exact(model, store, _doc(0))
            store.flush()
            store.quarantine(store.index.files()[0].id, "test")  # creates quarantine/
    finally:
        os.umask(old)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in [tmp_path / "s", *(tmp_path / "s").rglob("*")]}
    assert {m for n, m in modes.items() if (tmp_path / "s" / n).is_dir() or n == "s"} <= {0o700}
    assert {m for n, m in modes.items() if n != "s" and not (tmp_path / "s" / n).is_dir()} <= {0o600}
    assert modes["s"] == 0o700 and modes["quarantine"] == 0o700 and modes["index.sqlite"] == 0o600


def test_file_mode_widens_for_a_serving_group(tmp_path):
    model = tiny_model("llama")
    with ImpressStore(tmp_path / "s", model, ImpressConfig(chunk_tokens=16, important_ratio=1.0, file_mode=0o640)) as store:
        _exact(model, store, _doc(0))
    assert stat.S_IMODE((tmp_path / "s").stat().st_mode) == 0o750
    (f,) = (tmp_path / "s" / CHUNK_DIR).iterdir()
    assert stat.S_IMODE(f.stat().st_mode) == 0o640
    for bad in (0o777, 0o400, 0o4600, "0o600", True):
        with pytest.raises(ConfigError, match="file_mode"):
            ImpressConfig(file_mode=bad)


# -- only its own files -------------------------------------------------------------------
def test_a_path_that_is_a_file_is_refused(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(StoreFormatError, match="is a file"):
        ImpressStore(tmp_path / "f", tiny_model("llama"), CFG)


@pytest.mark.parametrize("part", ["chunks", "index.sqlite", "index.sqlite-wal"])
def test_links_inside_the_store_are_refused_and_nothing_outside_is_touched(tmp_path, part):
    user = tmp_path / "user"
    user.mkdir()
    (user / "precious.txt").write_text("mine")
    target = user if part == "chunks" else user / "precious.txt"
    (tmp_path / "s").mkdir()
    (tmp_path / "s" / part).symlink_to(target)
    before = _tree(user)
    with pytest.raises(StoreFormatError, match="symbolic link"):
        ImpressStore(tmp_path / "s", tiny_model("llama"), CFG)
    assert _tree(user) == before and (user / "precious.txt").read_text() == "mine"


def test_a_folder_with_foreign_files_is_refused(tmp_path):
    (tmp_path / CHUNK_DIR).mkdir()
    (tmp_path / CHUNK_DIR / "notes.txt").write_text("mine")
    (tmp_path / CHUNK_DIR / ("0" * 32 + ".safetensors")).mkdir()  # our naming, but not ours
    with pytest.raises(StoreFormatError, match="did not write"):
        ImpressStore(tmp_path, tiny_model("llama"), CFG)
    assert (tmp_path / CHUNK_DIR / "notes.txt").read_text() == "mine"


def test_a_file_named_like_ours_without_our_header_is_moved_aside_not_deleted(tmp_path):
    model = tiny_model("llama")
    with ImpressStore(tmp_path, model, CFG) as store:
        _exact(model, store, _doc(0))
    name = "ab" * 16 + ".safetensors"
    (tmp_path / CHUNK_DIR / name).write_text("the user's data")
    with ImpressStore(tmp_path, model, CFG) as store:
        assert _exact(model, store, _doc(0)).stats.matched_tokens == 63
    assert (tmp_path / QUARANTINE_DIR / name).read_text() == "the user's data"


def test_a_linked_quarantine_is_not_written_through(tmp_path):
    model = tiny_model("llama")
    with ImpressStore(tmp_path / "s", model, CFG) as store:
        _exact(model, store, _doc(0))
    user = tmp_path / "user"
    user.mkdir()
    (tmp_path / "s" / QUARANTINE_DIR).symlink_to(user)
    (f,) = (tmp_path / "s" / CHUNK_DIR).iterdir()
    f.write_bytes(f.read_bytes()[:5000])  # damaged: quarantined on the next read
    with ImpressStore(tmp_path / "s", model, CFG) as store:
        cache = _exact(model, store, _doc(0))
        assert cache.stats.quarantined_files == 1
    assert list(user.iterdir()) == []


class _Alarm(Exception):
    pass


@contextlib.contextmanager
def _no_hang(seconds: int):
    def fire(*_):
        raise _Alarm(f"hung for {seconds} s")

    old = signal.signal(signal.SIGALRM, fire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_a_chunk_file_replaced_by_a_fifo_or_a_directory_is_recomputed(tmp_path, kind):
    model = tiny_model("llama")
    doc = _doc(1)
    with ImpressStore(tmp_path, model, CFG) as store:
        _exact(model, store, doc)
    (f,) = (tmp_path / CHUNK_DIR).iterdir()
    f.unlink()
    os.mkfifo(f) if kind == "fifo" else f.mkdir()
    with _no_hang(120), ImpressStore(tmp_path, model, CFG) as store:
        cache = _exact(model, store, doc)
        assert cache.stats.quarantined_files == 1
    assert (tmp_path / QUARANTINE_DIR / f.name).exists()


# -- read-only ------------------------------------------------------------------------------
@contextlib.contextmanager
def _read_only(path: Path):
    """``path`` made read-only for this process: a read-only bind mount as root, else
    the directories' write bits removed."""
    if IS_ROOT:
        subprocess.run(["mount", "--bind", str(path), str(path)], check=True)
        try:
            subprocess.run(["mount", "-o", "remount,bind,ro", str(path)], check=True)
            yield
        finally:
            subprocess.run(["umount", str(path)], check=True)
    else:
        dirs = [path, *[p for p in path.rglob("*") if p.is_dir()]]
        for d in dirs:
            d.chmod(0o500)
        try:
            yield
        finally:
            for d in dirs:
                d.chmod(0o700)


def test_read_only_store_serves_and_writes_nothing(tmp_path):
    if IS_ROOT and shutil.which("mount") is None:
        pytest.skip("no mount command")
    model = tiny_model("llama")
    doc, other = _doc(2), _doc(3)
    path = tmp_path / "s"
    with ImpressStore(path, model, CFG) as store:
        _exact(model, store, doc)
    before = _tree(path)
    with _read_only(path):
        with pytest.raises(ReadOnlyStoreError, match="read_only=True"):
            ImpressStore(path, model, CFG)
        with ImpressStore(path, model, CFG, read_only=True) as store:
            cache = _exact(model, store, doc)
            assert cache.stats.matched_tokens == doc.shape[1] - 1
            _exact(model, store, other)  # computed, not stored
            assert store.stats()["kv_blocks_accessed"] > 0
            store.flush()
        assert _tree(path) == before


# -- write failures --------------------------------------------------------------------------
def _fill(path: Path, leave: int) -> Path:
    filler = path / "filler"
    free = shutil.disk_usage(path).free
    with open(filler, "wb") as f:
        f.write(b"\0" * max(0, free - leave))
    return filler


@pytest.mark.skipif(not IS_ROOT, reason="mounting a small tmpfs needs root (EFBIG below runs anywhere)")
def test_a_full_disk_never_fails_generation(tmp_path, caplog):
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)], check=True)
    store = None
    try:
        model = tiny_model("llama")
        store = ImpressStore(mnt / "s", model, CFG)
        _exact(model, store, _doc(4))
        store.flush()
        filler = _fill(mnt, 8192)
        with caplog.at_level(logging.WARNING):
            for seed in range(5, 10):
                _exact(model, store, _doc(seed, 200))  # exact, though nothing can be stored
            store.flush()  # reports cleanly: no exception
        assert store.stats()["write_failures"] >= 1
        assert sum("not stored" in r.getMessage() for r in caplog.records) == 1  # warned once
        assert not [p for p in (mnt / "s" / CHUNK_DIR).iterdir() if p.name.endswith(".tmp")]
        filler.unlink()  # space again: the same store stores again
        _exact(model, store, _doc(11, 100))
        store.flush()
        assert store.match(_doc(11, 100)[0].tolist()).length == 100
        assert _exact(model, store, _doc(4)).stats.matched_tokens == 63
        store.close()
        store.close()  # idempotent
    finally:
        if store is not None:
            store.close()  # its files keep the tmpfs busy otherwise (and hide a failure)
        subprocess.run(["umount", str(mnt)], check=True)


_EFBIG = textwrap.dedent(
    """
    import logging, resource, signal, sys, torch
    sys.path.insert(0, {tests!r})
    warnings = []
    class Kept(logging.Handler):
        def emit(self, record):
            warnings.append(record.getMessage())
    logging.getLogger("impress_cache").addHandler(Kept(logging.WARNING))
    from conftest import tiny_model
    from helpers import run
    from impress_cache import ImpressCache, ImpressConfig, ImpressStore
    model = tiny_model("llama")
    store = ImpressStore({path!r}, model, ImpressConfig(chunk_tokens=16, important_ratio=1.0, reorg_idle_ms=None))
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (20000, 20000))  # writes past 20 kB fail with EFBIG
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 256, (1, 300), generator=g)
    out = run(model, ids, cache=ImpressCache(store), new_tokens=3)[0]
    assert torch.equal(out, run(model, ids, new_tokens=3)[0])
    store.flush()
    assert store.stats()["write_failures"] == 1, store.stats()["write_failures"]
    # the warning names the limit that was hit and the way out
    assert any("RLIMIT_FSIZE" in w and "20000 bytes" in w and "read_only=True" in w for w in warnings), warnings
    store.close()
    store.close()
    print("ok")
    """
)


def test_a_file_size_limit_never_fails_generation(tmp_path):
    script = _EFBIG.format(tests=str(ROOT / "tests"), path=str(tmp_path / "s"))
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]
    assert not [p for p in (tmp_path / "s" / CHUNK_DIR).iterdir()]  # the failed write left nothing


# -- exclusive creation ------------------------------------------------------------------------
def _create(path, seed, barrier, results):
    model = tiny_model("llama", seed=seed)
    barrier.wait()
    try:
        ImpressStore(path, model, CFG).close()
        results.put((seed, "ok"))
    except ModelMismatchError:
        results.put((seed, "mismatch"))
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        results.put((seed, repr(exc)))


def test_two_processes_creating_one_store_with_different_models(tmp_path):
    ctx = multiprocessing.get_context("fork")
    barrier, results = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=_create, args=(tmp_path / "s", seed, barrier, results)) for seed in (0, 1)]
    for p in procs:
        p.start()
    got = dict(results.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    assert sorted(got.values()) == ["mismatch", "ok"], got
    winner = next(seed for seed, r in got.items() if r == "ok")
    ImpressStore(tmp_path / "s", tiny_model("llama", seed=winner), CFG).close()
    with pytest.raises(ModelMismatchError):
        ImpressStore(tmp_path / "s", tiny_model("llama", seed=1 - winner), CFG)


# -- hooks ------------------------------------------------------------------------------------
def test_hooks_are_installed_once_by_concurrent_first_caches(tmp_path):
    model = tiny_model("llama")
    store = ImpressStore(tmp_path, model, CFG)
    original_generate = model.generate
    n = 8
    barrier = threading.Barrier(n)
    errors: list[BaseException] = []

    def build():
        barrier.wait()
        try:
            ImpressCache(store)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=build) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and hooks_installed(model)
    assert len(model._forward_pre_hooks) == 1
    assert model.generate.__wrapped__ == original_generate  # wrapped once, not twice
    _exact(model, store, _doc(12))
    _exact(model, store, _doc(12))
    store.close()


# -- kill -9 ------------------------------------------------------------------------------------
_WRITER = textwrap.dedent(
    """
    import sys, torch
    sys.path.insert(0, {tests!r})
    from conftest import tiny_model
    from helpers import run
    from impress_cache import ImpressCache, ImpressConfig, ImpressStore
    model = tiny_model("llama")
    store = ImpressStore({path!r}, model, ImpressConfig(chunk_tokens=16, important_ratio=1.0, reorg_idle_ms=None))
    for seed in range(1000):
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(3, 256, (1, 48 + seed % 32), generator=g)
        run(model, ids, cache=ImpressCache(store), new_tokens=1)
        store.flush()
        print(seed, flush=True)
    """
)


def test_kill_9_loses_nothing_flush_confirmed(tmp_path):
    path = tmp_path / "s"
    model = tiny_model("llama")
    confirmed: set[int] = set()
    for kill_after in (2, 5):  # bounded: two kills at different points
        proc = subprocess.Popen(
            [sys.executable, "-c", _WRITER.format(tests=str(ROOT / "tests"), path=str(path))],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        )
        seen = 0
        for line in proc.stdout:
            confirmed.add(int(line))
            seen += 1
            if seen == kill_after:
                proc.send_signal(signal.SIGKILL)  # mid-way through the next prompt
                break
        proc.wait(timeout=60)
        proc.stdout.close()
    with ImpressStore(path, model, CFG) as store:
        for seed in sorted(confirmed):
            g = torch.Generator().manual_seed(seed)
            ids = torch.randint(3, 256, (1, 48 + seed % 32), generator=g)
            cache = _exact(model, store, ids, new_tokens=1)
            assert cache.stats.matched_tokens == ids.shape[1] - 1
    assert not [p for p in (path / CHUNK_DIR).iterdir() if p.name.endswith(".tmp")]


# -- repair -------------------------------------------------------------------------------------
def test_verify_repair_rebuilds_a_destroyed_index(tmp_path, capsys):
    model = tiny_model("llama")
    a = _doc(20, 80)
    docs = [a, torch.cat([a[:, :40], _doc(21, 30)], 1), torch.cat([a, _doc(22, 20)], 1)]
    with ImpressStore(tmp_path, model, CFG) as store:
        for d in docs:
            _exact(model, store, d)
    idx = tmp_path / "index.sqlite"
    raw = bytearray(idx.read_bytes())
    raw[100:4000] = b"\xff" * 3900
    idx.write_bytes(bytes(raw))
    with pytest.raises(StoreFormatError, match="verify --repair"):
        ImpressStore(tmp_path, model, CFG)
    assert cli_main(["verify", "--repair", str(tmp_path)]) == 0
    assert '"files": 3' in capsys.readouterr().out
    with ImpressStore(tmp_path, model, CFG) as store:
        for d in docs:
            assert _exact(model, store, d).stats.matched_tokens == d.shape[1] - 1


def test_repair_restores_the_permutation_of_a_reordered_file(tmp_path):
    """A file written by importance reordering keeps its rows in its own order; the repair
    takes that order (header key ``perm``) back into the index, and reads stay exact."""
    import numpy as np

    model = tiny_model("llama")
    spec_cfg = ImpressConfig(chunk_tokens=4, fsync=False, reorg_idle_ms=None, device_bytes=0, host_bytes=0)
    toks = list(range(3, 67))
    with ImpressStore(tmp_path, model, spec_cfg) as store:
        s = store.spec
        g = torch.Generator().manual_seed(0)
        keys = [torch.randn(s.num_kv_heads, len(toks), s.head_dim, generator=g) for _ in range(s.num_layers)]
        values = [torch.randn(s.num_kv_heads, len(toks), s.head_dim, generator=g) for _ in range(s.num_layers)]
        store.put(toks, keys, values)
        for _ in range(4):
            m = store.match(toks)
            imp = np.zeros((s.num_layers, m.length), np.float32)
            imp[:, ::4] = 1.0
            store.record_importance(m.segments, imp)
        assert store.reorganize()["rewritten"] == 1
        (node,) = [n for n in store.tree.nodes()]
        assert store._catalog.perm_of(node.file_id) is not None
    (tmp_path / "index.sqlite").unlink()
    assert cli_main(["verify", "--repair", str(tmp_path)]) == 0
    with ImpressStore(tmp_path, model, spec_cfg) as store:
        m = store.match(toks)
        assert m.length == 64 and store._catalog.perm_of(m.segments[0].file_id) is not None
        got = store.load(m.segments)
        assert torch.equal(got.keys, torch.stack(keys)) and torch.equal(got.values, torch.stack(values))
