"""Linked files against the session's SeaweedFS server: what a process knows of a file is
tied to the file itself (a file replaced under its name is looked at afresh), fills mark
their ranges in memory and the sidecar follows in batches, and a fill whose local write
fails marks nothing."""

from __future__ import annotations

import json
import resource
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import tiny_model
from helpers import assert_same_as_uncached, run
from impress_cache import CorruptBlockError, ImpressCache, ImpressConfig, ImpressStore
from impress_cache.storage.base import KV
from impress_cache.store import CHUNK_DIR
from impress_cache.store.remote import lazy
from test_remote_hardening import SPARSE, _load_all
from test_remote_tier import TESTS, _cfg, _doc


def _sidecar(d: Path, name: str) -> list[list[int]] | None:
    p = d / lazy.REMOTE_DIR / (name.split(".")[0] + ".json")
    return json.loads(p.read_text())["present"] if p.exists() else None


def _doc_file(store: ImpressStore, doc: torch.Tensor) -> tuple[int, str]:
    fid = store.match(doc[0].numpy()).segments[0].file_id
    return fid, store._catalog.records[fid].name


def _stored_on_a(bucket, tmp_path, doc):
    server, prefix, _ = bucket
    model = tiny_model()
    with ImpressStore(tmp_path / "a", model, _cfg(server, prefix)) as a:
        assert_same_as_uncached(model, a, doc)
        want = _load_all(a, doc)
    return server, prefix, model, want


def _link_sparse(store: ImpressStore, model, doc) -> tuple[int, str]:
    """A sparse request: the stored document is linked and only the selected blocks
    arrive; returns its file's id and name."""
    cache = ImpressCache(store)
    run(model, torch.cat([doc, _doc(seed=9, n=8)], dim=1), cache=cache)
    assert cache.stats.matched_tokens == doc.shape[1]
    return _doc_file(store, doc)


def _host_a_and_b(bucket, tmp_path, monkeypatch, save_every_s: float):
    """Host a stores a document; returns what host b links it with (sparse, every
    selected block in its own range): ``(doc, model, want, b's directory, b's config)``."""
    monkeypatch.setattr(lazy, "MAX_RANGES", 1000)
    monkeypatch.setattr(lazy, "SAVE_EVERY_S", save_every_s)
    doc = _doc()
    server, prefix, model, want = _stored_on_a(bucket, tmp_path, doc)
    return doc, model, want, tmp_path / "s", _cfg(server, prefix, **SPARSE)


@pytest.mark.parametrize("before", ["whole file", "part of a linked file"])
def test_a_file_replaced_under_its_name_is_looked_at_afresh(bucket, tmp_path, monkeypatch, before):
    """This process knows a file (its own whole file, or a linked one with some blocks
    here); another process of the directory quarantines it and pulls it again: a new file
    of the same name holding only its header. This process reads the new file's blocks
    from the remote instead of taking the old answer (holes read as blocks: a quarantine)."""
    monkeypatch.setattr(lazy, "MAX_RANGES", 1000)
    doc = _doc()
    server, prefix, model, want = _stored_on_a(bucket, tmp_path, doc)
    d = tmp_path / ("a" if before == "whole file" else "s")
    with ImpressStore(d, model, _cfg(server, prefix, **SPARSE)) as p:
        fid, name = _doc_file(p, doc) if before == "whole file" else _link_sparse(p, model, doc)
        assert p._remote.files.linked(name) is (before != "whole file")
        with ImpressStore(d, model, _cfg(server, prefix)) as q:  # another process of the directory
            assert q.quarantine(fid, "test: damaged")
            q._remote._bad.clear()  # the object's cooldown has passed
            assert q._remote.pull(doc[0].numpy(), None) > 0
            new_fid, new_name = _doc_file(q, doc)
        assert new_name == name and new_fid != fid  # the object carries the file's UUID: same name
        assert p._remote.files.linked(name)
        got = _load_all(p, doc)
        assert p.stats()["quarantined_files"] == 0
        assert p.stats()["remote"]["ranges_fetched"] >= 1
    assert got[0] == want[0] and torch.equal(got[1], want[1]) and torch.equal(got[2], want[2])


def test_fills_mark_ranges_in_memory_and_the_sidecar_follows_in_batches(bucket, tmp_path, monkeypatch):
    """Within `SAVE_EVERY_S` a fill writes its blocks and marks them in memory only (no
    fsync, no sidecar rewrite); `flush` writes the sidecar (after flushing the data), and
    a store opened afterwards knows the blocks are here."""
    doc, model, want, d, cfg = _host_a_and_b(bucket, tmp_path, monkeypatch, save_every_s=1e9)
    with ImpressStore(d, model, cfg) as p:
        _, name = _link_sparse(p, model, doc)
        lz = p._remote.files._get(name)
        header = [[0, lz.data_start]]
        assert _sidecar(d, name) == header  # written when linked, not by the fill
        assert lz.unsaved and [list(r) for r in lz.present] != header
        present = [list(r) for r in lz.present]
        p.flush()
        assert _sidecar(d, name) == present and not lz.unsaved
    with ImpressStore(d, model, cfg) as p:
        fetched = p.stats()["remote"]["ranges_fetched"]
        assert [list(r) for r in p._remote.files._get(name).present] == present
        got = _load_all(p, doc)  # the rest arrives
        assert p.stats()["remote"]["ranges_fetched"] > fetched
    assert torch.equal(got[1], want[1]) and torch.equal(got[2], want[2])
    assert _sidecar(d, name) is not None  # probe pieces are not all here: still linked


_KILLED_HOST = textwrap.dedent(
    """
    import json, sys, torch
    sys.path.insert(0, {tests!r})
    from conftest import VOCAB, tiny_model
    from impress_cache import ImpressCache, ImpressConfig, ImpressStore
    from impress_cache.hf.compat import CACHE_KWARG
    from impress_cache.store.remote import lazy
    lazy.MAX_RANGES, lazy.SAVE_EVERY_S = 1000, 1e9
    g = torch.Generator()
    doc = torch.randint(3, VOCAB, (1, 150), generator=g.manual_seed(0))
    ask = torch.cat([doc, torch.randint(3, VOCAB, (1, 8), generator=g.manual_seed(9))], dim=1)
    model = tiny_model()
    store = ImpressStore(sys.argv[1], model, ImpressConfig(**json.loads(sys.argv[2])))
    model.generate(ask, max_new_tokens=1, do_sample=False, **{{CACHE_KWARG: ImpressCache(store)}})
    print(json.dumps(store.stats()["remote"]), flush=True)
    sys.stdin.read()  # killed here: filled, the sidecar not saved since the link
    """
)


def test_a_process_killed_after_its_fills_leaves_a_sidecar_listing_less(bucket, tmp_path):
    """A process links a document, fills the blocks its sparse request selects and is
    killed (SIGKILL) before it saves the sidecar: the sidecar lists the header only; the
    next process fetches the blocks again and reads the K/V of the host that wrote them,
    nothing quarantined."""
    doc = _doc()
    server, prefix, model, want = _stored_on_a(bucket, tmp_path, doc)
    cfg = _cfg(server, prefix, **SPARSE)
    args = {k: getattr(cfg, k) for k in ("chunk_tokens", "fsync", "remote", "remote_options")}
    proc = subprocess.Popen(
        [sys.executable, "-c", _KILLED_HOST.format(tests=str(TESTS)), str(tmp_path / "s"), json.dumps({**args, **SPARSE})],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        line = proc.stdout.readline()
        assert line, proc.stderr.read()[-2000:]
        assert json.loads(line)["ranges_fetched"] >= 1
    finally:
        proc.kill()
        proc.wait(60)
        proc.stdin.close()
        proc.stdout.close()
        proc.stderr.close()
    with ImpressStore(tmp_path / "s", model, _cfg(server, prefix)) as s:
        fid, name = _doc_file(s, doc)
        lz = s._remote.files._get(name)
        assert _sidecar(tmp_path / "s", name) == [[0, lz.data_start]] and lz.present == [(0, lz.data_start)]
        got = _load_all(s, doc)
        assert s.stats()["quarantined_files"] == 0 and s.stats()["remote"]["ranges_fetched"] >= 1
    assert got[0] == want[0] and torch.equal(got[1], want[1]) and torch.equal(got[2], want[2])


def test_a_fill_whose_local_write_fails_marks_nothing(bucket, tmp_path, monkeypatch):
    """A real write failure in the middle of a fill (the process's file size limit, EFBIG,
    after the first range was written): `CorruptBlockError`, no range of the fill marked
    present in memory or in the sidecar; the next fill writes them."""
    doc, model, want, d, cfg = _host_a_and_b(bucket, tmp_path, monkeypatch, save_every_s=0.0)  # sidecar current
    with ImpressStore(d, model, cfg) as p:
        fid, name = _link_sparse(p, model, doc)
        files = p._remote.files
        lz = files._get(name)
        table = p._catalog.open_file(fid).table
        offsets = table.offsets[KV].reshape(-1)
        sizes = np.broadcast_to(table.nbytes(KV, np.arange(table.offsets.shape[2])), table.offsets[KV].shape).reshape(-1)
        miss = lz.missing(offsets, offsets + sizes)
        assert len(miss) >= 2
        (a0, b0), (a1, b1) = miss[0], miss[-1]
        sel = np.isin(offsets, [a0, a1])
        before, side = list(lz.present), _sidecar(d, name)
        limit = (b0 + a1) // 2  # the first range fits under the limit, the last one does not
        assert b0 <= limit < a1
        soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        old = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
        try:
            with pytest.raises(CorruptBlockError, match="cannot be filled"):
                files.fill(fid, name, offsets[sel], sizes[sel])
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
            signal.signal(signal.SIGXFSZ, old)
        assert lz.present == before and _sidecar(d, name) == side
        assert lz.missing(offsets[sel], offsets[sel] + sizes[sel]) == [(a0, b0), (a1, b1)]
        files.fill(fid, name, offsets[sel], sizes[sel])
        assert lz.missing(offsets[sel], offsets[sel] + sizes[sel]) == []
        got = _load_all(p, doc)
        assert p.stats()["quarantined_files"] == 0
    assert torch.equal(got[1], want[1]) and torch.equal(got[2], want[2])


def test_an_object_of_another_header_version_is_refused(tmp_path):
    """Objects are read by the one header reader the repair uses (`store/header.py`), with
    its version check: a chunk file of another header version is not linked."""
    from impress_cache.store.remote.objects import BadObject, namespace, parse_object

    model, doc = tiny_model(), _doc()
    with ImpressStore(tmp_path, model, ImpressConfig(chunk_tokens=16, important_ratio=1.0, fsync=False)) as s:
        assert_same_as_uncached(model, s, doc)
        (f,) = (tmp_path / "chunks").iterdir()
        data = f.read_bytes()
        args = (namespace(s.spec, s.probe), s.spec, s.probe, s._catalog._row_bytes)
    assert parse_object(data, None, *args).new_file.name == f.name
    other = data.replace(b'"impress_cache":"3"', b'"impress_cache":"4"', 1)
    assert other != data
    with pytest.raises(BadObject, match="version"):
        parse_object(other, None, *args)


def _two_views(bucket, tmp_path):
    """Two processes' views (`RemoteFiles`) of one store directory, an object of 64 KiB in
    the session's SeaweedFS bucket, and a linked file name."""
    import os

    _, _, backend = bucket
    data = bytes(range(1, 256)) * 257
    backend.put("obj", data)
    (tmp_path / "chunks").mkdir()
    fd = os.open(tmp_path / "chunks", os.O_RDONLY | os.O_DIRECTORY)
    views = [lazy.RemoteFiles(tmp_path, fd, backend, lambda n, b: None, fsync=False) for _ in range(2)]
    return views, fd, data, "ab" * 16 + ".safetensors"


def test_a_file_linked_again_under_its_name_is_not_taken_for_the_old_one(bucket, tmp_path):
    """Another process evicts a linked file and links the object again under the same
    name: the new file usually gets the same inode number back, and the index id (never
    reused) tells this process that it knows nothing of it."""
    import os

    (a, b), fd, data, local = _two_views(bucket, tmp_path)
    try:
        assert a.create(local, "obj", len(data), data[:100])
        a.fill(1, local, np.array([4096]), np.array([4096]))  # a knows [4096, 8192) is here
        b.drop(local)
        os.unlink(local, dir_fd=fd)  # b evicts it ...
        assert b.create(local, "obj", len(data), data[:100])  # ... and links it again (index id 2)
        a.fill(2, local, np.array([4096]), np.array([4096]))
        assert (tmp_path / "chunks" / local).read_bytes()[4096:8192] == data[4096:8192]  # fetched, not holes
    finally:
        a.close()
        b.close()
        os.close(fd)


def test_a_file_another_process_completed_is_read_when_its_object_is_gone(bucket, tmp_path):
    """This process still thinks a file is linked; another one fetched every range and
    removed the sidecar, then the object left the remote: the fill finds the file
    complete instead of failing (and quarantining a good file)."""
    import os

    (a, b), fd, data, local = _two_views(bucket, tmp_path)
    _, _, backend = bucket
    try:
        assert a.create(local, "obj", len(data), data[:100])
        assert a.linked(local, 1) and b.linked(local, 1)
        b.fill(1, local, np.array([100]), np.array([len(data) - 100]))  # b completes it
        assert not b.linked(local, 1)
        backend.delete(["obj"])
        a.fill(1, local, np.array([4096]), np.array([4096]))  # no CorruptBlockError
        assert not a.linked(local, 1)
        assert (tmp_path / "chunks" / local).read_bytes() == data
    finally:
        a.close()
        b.close()
        os.close(fd)


def test_a_linked_file_read_straight_into_layers_then_past_the_page_cache(bucket, tmp_path):
    """Exact reuse from disk with ``direct_io=True`` (memory tiers off) on a host that
    links the stored document: the linked file's blocks are fetched and read through the
    page cache (no ``O_DIRECT`` descriptor for a linked file); once the file is filled
    (its pages written through the page cache, no fsync), it is read with ``O_DIRECT``
    and still matches generate without a cache."""
    doc = _doc()
    server, prefix, model, _ = _stored_on_a(bucket, tmp_path, doc)
    ids = torch.cat([doc, doc[:, :4]], dim=1)
    cfg = _cfg(server, prefix, device_bytes=0, host_bytes=0, direct_io=True)
    with ImpressStore(tmp_path / "b", model, cfg) as b:
        c = assert_same_as_uncached(model, b, ids)
        assert c.stats.matched_tokens == doc.shape[1] and c.stats.recomputed_layers == 0
        assert b.stats()["remote"]["ranges_fetched"] >= 1
        fid, name = _doc_file(b, doc)
        f = b._catalog.files.get(fid)
        assert b._remote.files.linked(name, fid) and f.dfd is None
        size = (tmp_path / "b" / CHUNK_DIR / name).stat().st_size
        b._remote.files.fill(fid, name, np.array([0]), np.array([size]))  # the rest of the file
        assert not b._remote.files.linked(name, fid)
        before = b.stats()["runs_direct_io"]
        c = assert_same_as_uncached(model, b, ids)
        assert c.stats.matched_tokens >= doc.shape[1] and c.stats.recomputed_layers == 0
        assert b.stats()["quarantined_files"] == 0
        assert f.dfd is not None and f.dfd >= 0 and b.stats()["runs_direct_io"] > before
