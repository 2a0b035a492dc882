"""The remote tier when hosts and processes interleave, against the session's SeaweedFS
server: object names that two files never share (a rewritten node, one prompt stored by
two hosts), objects another host evicted, two processes on one store directory, and the
sidecars of linked files (removed with their file, counted in the disk budget)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import torch

from conftest import tiny_model
from helpers import assert_same_as_uncached, run
from impress_cache import ImpressCache, ImpressStore
from impress_cache.store.remote import lazy
from test_remote_tier import TESTS, _cfg, _doc, _objects

SPARSE = dict(important_ratio=0.25, decode="keep", prefetch=False, device_bytes=0, host_bytes=0)


def _sidecars(d: Path) -> list[str]:
    return sorted(p.name for p in (d / lazy.REMOTE_DIR).iterdir()) if (d / lazy.REMOTE_DIR).exists() else []


def _link_part(d: Path, model, server, prefix, doc) -> None:
    """A sparse request on host ``d``: the stored document is linked and only the blocks
    it selects arrive (its sidecar stays)."""
    ask = torch.cat([doc, _doc(seed=9, n=8)], dim=1)
    with ImpressStore(d, model, _cfg(server, prefix, **SPARSE)) as s:
        cache = ImpressCache(s)
        run(model, ask, cache=cache)
        assert cache.stats.matched_tokens == doc.shape[1]
        assert s.stats()["remote"]["objects_linked"] == 1
    assert len(_sidecars(d)) == 1


def _part_linked_on_b(bucket, tmp_path, monkeypatch):
    """Host a stores a document; host b links it and has only part of its blocks."""
    monkeypatch.setattr(lazy, "MAX_RANGES", 1000)
    server, prefix, backend = bucket
    model, doc = tiny_model(), _doc()
    with ImpressStore(tmp_path / "a", model, _cfg(server, prefix)) as a:
        assert_same_as_uncached(model, a, doc)
    _link_part(tmp_path / "b", model, server, prefix, doc)
    return server, prefix, backend, model, doc


def _load_all(store: ImpressStore, tokens: torch.Tensor):
    m = store.match(tokens[0].numpy())
    loaded = store.load(m.segments)
    return m.length, loaded.keys, loaded.values


def test_a_rewritten_node_gets_its_own_object_and_round_trips_through_the_bucket(bucket, tmp_path, monkeypatch):
    """A node rewritten by the reorganiser is a new file: uploaded under a new name, it
    never replaces the object other hosts linked; a fresh host reads the rewritten file
    (permutation and all) and gets the K/V of a store that never reordered."""
    monkeypatch.setattr(lazy, "MAX_RANGES", 1000)  # a sparse fill fetches only the selected blocks
    server, prefix, backend = bucket
    model, doc = tiny_model(), _doc()
    longer = torch.cat([doc, _doc(seed=5, n=40)], dim=1)
    with ImpressStore(tmp_path / "a", model, _cfg(server, prefix)) as a:
        assert_same_as_uncached(model, a, doc)
    (original,) = _objects(backend, "obj")
    _link_part(tmp_path / "b", model, server, prefix, doc)  # host b holds part of the original
    # host a reorders the node (importance scattered over every block), then stores a
    # longer prompt on top of it: the rewritten file travels with it
    with ImpressStore(tmp_path / "a", model, _cfg(server, prefix, important_ratio=0.25, reorg_idle_ms=None)) as a:
        m = a.match(doc[0].numpy())
        imp = np.zeros((model.config.num_hidden_layers, m.length), np.float32)
        imp[:, ::4] = 1.0
        a.record_importance(m.segments, imp)
        assert a.reorganize(force=True)["rewritten"] == 1
    with ImpressStore(tmp_path / "a", model, _cfg(server, prefix)) as a:
        assert_same_as_uncached(model, a, longer)
        assert a.stats()["remote"]["objects_uploaded"] == 2  # the rewritten file and the new rows
    names = _objects(backend, "obj")
    assert len(names) == 3 and original in names
    # the original object is untouched: host b fills the rest of its linked file from it
    with ImpressStore(tmp_path / "b", model, _cfg(server, prefix)) as b:
        cache = assert_same_as_uncached(model, b, doc)
        assert cache.stats.matched_tokens == doc.shape[1] - 1 and cache.stats.quarantined_files == 0
        assert b.stats()["remote"]["bad_objects"] == 0
    # a fresh host links the rewritten file and reads what a never-reordered store holds
    with ImpressStore(tmp_path / "c", model, _cfg(server, prefix)) as c:
        cache = assert_same_as_uncached(model, c, longer)
        assert cache.stats.matched_tokens == longer.shape[1] - 1
        m = c.match(longer[0].numpy())
        assert c._catalog.perm_of(m.segments[0].file_id) is not None  # the permutation came along
        got = _load_all(c, longer)
    with ImpressStore(tmp_path / "n", model, _cfg(server, "never-shared")) as n:  # the same prompts, in order
        assert_same_as_uncached(model, n, doc)
        assert_same_as_uncached(model, n, longer)
        want = _load_all(n, longer)
    assert got[0] == want[0] and torch.equal(got[1], want[1]) and torch.equal(got[2], want[2])


def test_one_prompt_stored_by_two_hosts_makes_two_objects(bucket, tmp_path):
    """Each host's object is named after its own file: neither overwrites the other."""
    server, prefix, backend = bucket
    model, doc = tiny_model(), _doc()
    longer = torch.cat([doc, _doc(seed=5, n=40)], dim=1)
    with ImpressStore(tmp_path / "a", model, _cfg(server, prefix)) as a:
        assert_same_as_uncached(model, a, doc)
    with ImpressStore(tmp_path / "b", model, _cfg(server, "elsewhere")) as b:  # b computes doc itself
        assert_same_as_uncached(model, b, doc)
    with ImpressStore(tmp_path / "b", model, _cfg(server, prefix)) as b:
        assert_same_as_uncached(model, b, longer)
        assert b.stats()["remote"]["objects_uploaded"] == 2
        b_file = next(r.name for r in b._catalog.records.values() if r.first_pos == 0)
    names = _objects(backend, "obj")
    assert len(names) == 3
    assert sum(n.endswith("." + b_file.split(".")[0]) for n in names) == 1  # b's own file, by its UUID


def test_objects_another_host_evicted_are_uploaded_again(bucket, tmp_path):
    """A host that uploaded an object checks it is still there before it advertises a
    prompt that needs it (another host's remote budget may have deleted it)."""
    server, prefix, backend = bucket
    model, doc = tiny_model(), _doc()
    longer = torch.cat([doc, _doc(seed=5, n=40)], dim=1)
    with ImpressStore(tmp_path / "a", model, _cfg(server, prefix)) as a:
        assert_same_as_uncached(model, a, doc)
        with ImpressStore(tmp_path / "e", model, _cfg(server, prefix, remote_bytes=1, remote_grace_s=0)) as e:
            assert e._remote.enforce_budget()["evicted_objects"] == 1
        assert _objects(backend, "obj") == []
        assert_same_as_uncached(model, a, longer)  # its prompt extends the evicted object's rows
        assert a.stats()["remote"]["objects_uploaded"] == 3  # doc's file again, and the new rows
    with ImpressStore(tmp_path / "b", model, _cfg(server, prefix)) as b:
        cache = assert_same_as_uncached(model, b, longer)
        assert cache.stats.matched_tokens == longer.shape[1] - 1


def test_a_linked_file_whose_object_was_evicted_is_recomputed(bucket, tmp_path, monkeypatch):
    server, prefix, backend, model, doc = _part_linked_on_b(bucket, tmp_path, monkeypatch)
    backend.delete(_objects(backend, "obj"))  # another host's budget took it
    with ImpressStore(tmp_path / "b", model, _cfg(server, prefix)) as b:
        assert_same_as_uncached(model, b, doc)  # the missing blocks cannot come: recomputed
        cache = assert_same_as_uncached(model, b, doc)  # and stored again, locally
        assert cache.stats.matched_tokens == doc.shape[1] - 1


_SPARSE_HOST = textwrap.dedent(
    """
    import json, sys, torch
    sys.path.insert(0, {tests!r})
    from conftest import VOCAB, tiny_model
    from impress_cache import ImpressCache, ImpressConfig, ImpressStore
    from impress_cache.hf.compat import CACHE_KWARG
    from impress_cache.store.remote import lazy
    lazy.MAX_RANGES = 1000
    cfg = ImpressConfig(**json.loads(sys.argv[2]))
    g = torch.Generator()
    doc = torch.randint(3, VOCAB, (1, 150), generator=g.manual_seed(0))
    ask = torch.cat([doc, torch.randint(3, VOCAB, (1, 8), generator=g.manual_seed(9))], dim=1)
    model = tiny_model()
    with ImpressStore(sys.argv[1], model, cfg) as store:
        cache = ImpressCache(store)
        model.generate(ask, max_new_tokens=2, do_sample=False, **{{CACHE_KWARG: cache}})
        store.flush()
        print(json.dumps({{"matched": cache.stats.matched_tokens, **store.stats()["remote"]}}))
    """
)


def test_two_processes_on_one_directory_share_linked_files(bucket, tmp_path):
    """Another process links a stored prompt into the directory this process has open and
    fetches part of it; this process reuses the link and fetches the rest (the other
    process's sidecar tells it which)."""
    server, prefix, backend = bucket
    model, doc = tiny_model(), _doc()
    with ImpressStore(tmp_path / "a", model, _cfg(server, prefix)) as a:
        assert_same_as_uncached(model, a, doc)
    cfg = _cfg(server, prefix)
    with ImpressStore(tmp_path / "s", model, cfg) as s:
        args = {k: getattr(cfg, k) for k in ("chunk_tokens", "fsync", "remote", "remote_options")}
        proc = subprocess.run(
            [sys.executable, "-c", _SPARSE_HOST.format(tests=str(TESTS)), str(tmp_path / "s"),
             json.dumps({**args, **SPARSE})],
            capture_output=True, text=True, timeout=300,
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        other = json.loads(proc.stdout.strip().splitlines()[-1])
        assert other["matched"] == doc.shape[1] and other["objects_linked"] == 1
        assert len(_sidecars(tmp_path / "s")) == 1
        cache = assert_same_as_uncached(model, s, doc)
        assert cache.stats.matched_tokens == doc.shape[1] - 1 and cache.stats.quarantined_files == 0
        remote = s.stats()["remote"]
        assert remote["objects_linked"] == 0 and remote["ranges_fetched"] >= 1
        assert 0 < remote["bytes_downloaded"] < backend.head(_objects(backend, "obj")[0])


def test_a_sidecar_counts_in_the_disk_budget_and_goes_with_its_file(bucket, tmp_path, monkeypatch):
    server, prefix, backend, model, doc = _part_linked_on_b(bucket, tmp_path, monkeypatch)
    with ImpressStore(tmp_path / "b", model, _cfg(server, prefix, disk_bytes=1 << 30)) as b:
        side = b._remote.files.disk_bytes()
        assert side > 0
        with_side = b.disk_bytes()
        b._catalog.companions = None
        assert with_side - b.disk_bytes() == side
        b._catalog.companions = b._remote.files
        b.config.disk_bytes = 1  # evict everything
        assert b.enforce_disk_budget()["removed_files"] >= 1
        b._leases.unlinker.drain()
        assert _sidecars(tmp_path / "b") == [] and b._remote.files.disk_bytes() == 0


def test_crash_leftovers_of_linking_are_removed_and_a_link_in_progress_is_left_alone(bucket, tmp_path):
    import os
    import time

    server, prefix, backend = bucket
    model = tiny_model()
    with ImpressStore(tmp_path / "b", model, _cfg(server, prefix)):
        pass
    side_dir = tmp_path / "b" / lazy.REMOTE_DIR
    old, fresh = side_dir / ("a" * 32 + ".json.1.tmp"), side_dir / ("b" * 32 + ".json.2.tmp")
    old.write_text("{")  # torn: a crash during a sidecar's write
    fresh.write_text("{")  # another process writing now
    past = time.time() - 2 * lazy.STALE_TMP_S
    os.utime(old, (past, past))
    with ImpressStore(tmp_path / "b", model, _cfg(server, prefix)) as b:
        assert not old.exists() and fresh.exists()
        files = b._remote.files
        name = "c" * 32 + ".safetensors"
        (tmp_path / "b" / "chunks" / (name + ".tmp")).write_bytes(b"")  # another process links it now
        assert files.create(name, "m-x/obj/y", 100, b"head") is False
        os.unlink(tmp_path / "b" / "chunks" / (name + ".tmp"))
        assert files.create(name, "m-x/obj/y", 100, b"head") is True
        assert files.create(name, "m-x/obj/y", 100, b"head") is False  # linked already: never replaced
        assert os.path.getsize(tmp_path / "b" / "chunks" / name) == 100
        assert sorted(os.listdir(side_dir)) == sorted([fresh.name, "c" * 32 + ".json"])
        b._catalog.unlink(name)
        assert sorted(os.listdir(side_dir)) == [fresh.name]



def _header_bytes(path: Path) -> int:
    from impress_cache.store.remote.objects import header_length

    with open(path, "rb") as f:
        return header_length(f.read(8))


def test_an_upload_reads_only_the_headers_of_files_already_uploaded(bucket, tmp_path):
    """The header names the object: a prompt uploaded again (its objects there) reads one
    header per file, a longer prompt on top reads the old file's header and the new file."""
    from impress_cache.store import CHUNK_DIR

    server, prefix, backend = bucket
    model, doc = tiny_model(), _doc()
    longer = torch.cat([doc, _doc(seed=5, n=40)], dim=1)
    with ImpressStore(tmp_path / "a", model, _cfg(server, prefix)) as a:
        assert_same_as_uncached(model, a, doc)
        (old,) = a._catalog.records.values()
        remote = a.stats()["remote"]
        assert remote["local_bytes_read"] == (tmp_path / "a" / CHUNK_DIR / old.name).stat().st_size
        head = _header_bytes(tmp_path / "a" / CHUNK_DIR / old.name)
        # the same prompt uploaded again: its object is there, only its header is read
        a._remote.push(a.match(doc[0].numpy()).segments[-1].node)
        a.flush()
        again = a.stats()["remote"]
        assert again["local_bytes_read"] - remote["local_bytes_read"] == head
        assert again["objects_uploaded"] == 1 and again["prompts_advertised"] == 2
        assert_same_as_uncached(model, a, longer)
        new = next(r for r in a._catalog.records.values() if r.id != old.id)
        after = a.stats()["remote"]
        assert after["local_bytes_read"] - again["local_bytes_read"] == head + (
            tmp_path / "a" / CHUNK_DIR / new.name
        ).stat().st_size
        assert after["objects_uploaded"] == 2
    with ImpressStore(tmp_path / "b", model, _cfg(server, prefix)) as b:  # what was advertised is whole
        cache = assert_same_as_uncached(model, b, longer)
        assert cache.stats.matched_tokens == longer.shape[1] - 1 and cache.stats.quarantined_files == 0


def test_a_damaged_local_file_is_not_uploaded(bucket, tmp_path):
    """A local chunk file with a damaged block is read whole before its upload and refused:
    no object, no manifest, no key; the upload is dropped."""
    from impress_cache.store import CHUNK_DIR

    server, prefix, backend = bucket
    model, doc = tiny_model(), _doc()
    with ImpressStore(tmp_path / "a", model, _cfg(server, "elsewhere-" + prefix)) as a:
        assert_same_as_uncached(model, a, doc)
        (rec,) = a._catalog.records.values()
    path = tmp_path / "a" / CHUNK_DIR / rec.name
    raw = bytearray(path.read_bytes())
    raw[_header_bytes(path) + 5] ^= 0xFF  # a byte of the first block, the header intact
    path.write_bytes(bytes(raw))
    with ImpressStore(tmp_path / "a", model, _cfg(server, prefix, remote_retry_s=0.2)) as a:
        a._remote.push(a.match(doc[0].numpy()).segments[-1].node)
        a.flush()
        remote = a.stats()["remote"]
        assert remote["objects_uploaded"] == 0 and remote["uploads_dropped"] == 1
        assert remote["local_bytes_read"] >= path.stat().st_size  # read whole to be checked
    assert _objects(backend, "obj") == [] and _objects(backend, "man") == [] and _objects(backend, "key") == []
