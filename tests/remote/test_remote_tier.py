"""The remote tier against a real SeaweedFS server: exact reuse across hosts (another
process, restarts, a deleted local directory), faults (server killed mid-request and
mid-write, paused, damaged objects, another model's object under the same name) and the
remote byte budget."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from conftest import BUCKET, VOCAB, tiny_model
from helpers import assert_same_as_uncached
from impress_cache import ConfigError, ImpressConfig, ImpressStore
from impress_cache.storage.s3_remote import S3Backend
from impress_cache.store import CHUNK_DIR

TESTS = Path(__file__).resolve().parents[1]


def _doc(seed=0, n=150):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (1, n), generator=g)


def _cfg(server, prefix, **kw):
    kw = {"chunk_tokens": 16, "important_ratio": 1.0, "fsync": False, "remote_retry_s": 0.5,
          "remote_options": server.options, **kw}
    return ImpressConfig(remote=f"s3://{BUCKET}/{prefix}", **kw)


def _objects(backend, kind):
    return sorted(e.name for e in backend.list("") if f"/{kind}/" in e.name)


def _chunk_files(d: Path) -> list[str]:
    return sorted(p.name for p in (d / CHUNK_DIR).iterdir())


def _store_on_a(tmp_path, model, server, prefix, doc):
    with ImpressStore(tmp_path / "a", model, _cfg(server, prefix)) as a:
        assert_same_as_uncached(model, a, doc)
        assert a.stats()["remote"]["prompts_advertised"] == 1


_HOST_A = textwrap.dedent(
    """
    import json, sys, torch
    sys.path.insert(0, {tests!r})
    from conftest import BUCKET, VOCAB, tiny_model
    from impress_cache import ImpressCache, ImpressConfig, ImpressStore
    from impress_cache.hf.compat import CACHE_KWARG
    cfg = ImpressConfig(**json.loads(sys.argv[2]))
    doc = torch.randint(3, VOCAB, (1, 150), generator=torch.Generator().manual_seed(0))
    model = tiny_model()
    with ImpressStore(sys.argv[1], model, cfg) as store:
        model.generate(doc, max_new_tokens=2, do_sample=False, **{{CACHE_KWARG: ImpressCache(store)}})
        store.flush()
        print(json.dumps(store.stats()["remote"]))
    """
)


def test_another_process_on_another_directory_reuses_exactly(bucket, tmp_path):
    server, prefix, backend = bucket
    cfg = _cfg(server, prefix)
    args = {k: getattr(cfg, k) for k in ("chunk_tokens", "important_ratio", "fsync", "remote", "remote_options")}
    proc = subprocess.run(
        [sys.executable, "-c", _HOST_A.format(tests=str(TESTS)), str(tmp_path / "a"), json.dumps(args)],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1])["prompts_advertised"] == 1
    model, doc = tiny_model(), _doc()
    with ImpressStore(tmp_path / "b", model, cfg) as b:
        cache = assert_same_as_uncached(model, b, doc)
        assert cache.stats.matched_tokens == doc.shape[1] - 1
        remote = b.stats()["remote"]
        assert remote["tokens_imported"] == doc.shape[1] - 1 and remote["bad_objects"] == 0
    # both restart: each reuses from its own directory, nothing is downloaded again
    for host in ("a", "b"):
        with ImpressStore(tmp_path / host, model, cfg) as s:
            cache = assert_same_as_uncached(model, s, doc)
            assert cache.stats.matched_tokens == doc.shape[1] - 1
            assert s.stats()["remote"]["bytes_downloaded"] == 0
    # a host whose local directory was deleted gets it all back from the remote
    shutil.rmtree(tmp_path / "b")
    with ImpressStore(tmp_path / "b", model, cfg) as b:
        cache = assert_same_as_uncached(model, b, doc)
        assert cache.stats.matched_tokens == doc.shape[1] - 1
        assert b.stats()["remote"]["objects_linked"] == 1


def test_a_longer_prompt_reuses_the_shared_part_and_uploads_only_its_own_rows(bucket, tmp_path):
    server, prefix, backend = bucket
    model, doc = tiny_model(), _doc()
    _store_on_a(tmp_path, model, server, prefix, doc)
    longer = torch.cat([doc[:, :100], _doc(seed=7, n=60)], dim=1)  # diverges after 100 tokens
    with ImpressStore(tmp_path / "b", model, _cfg(server, prefix)) as b:
        cache = assert_same_as_uncached(model, b, longer)
        assert cache.stats.matched_tokens == 100
        assert b.stats()["remote"]["objects_uploaded"] == 1  # the 60 new rows only
    with ImpressStore(tmp_path / "c", model, _cfg(server, prefix)) as c:
        cache = assert_same_as_uncached(model, c, longer)
        assert cache.stats.matched_tokens == longer.shape[1] - 1
        assert c.stats()["remote"]["objects_linked"] == 2


def test_a_sparse_request_fetches_only_what_it_reads_and_matches_a_local_one(bucket, tmp_path, monkeypatch):
    from helpers import run
    from impress_cache import ImpressCache
    from impress_cache.store.remote import lazy

    # one GET per run of selected blocks (the default merges a fill into 4 GETs, which on
    # this tiny file covers nearly everything)
    monkeypatch.setattr(lazy, "MAX_RANGES", 1000)

    server, prefix, backend = bucket
    model, doc = tiny_model(), _doc(n=400)
    _store_on_a(tmp_path, model, server, prefix, doc)
    (obj,) = [e for e in backend.list("") if "/obj/" in e.name]
    sparse = dict(important_ratio=0.25, decode="keep", prefetch=False, device_bytes=0, host_bytes=0)
    ask = torch.cat([doc, _doc(seed=9, n=8)], dim=1)  # the stored document plus a question
    with ImpressStore(tmp_path / "a", model, _cfg(server, prefix, **sparse)) as a:
        local, _ = run(model, ask, cache=ImpressCache(a))
    with ImpressStore(tmp_path / "b", model, _cfg(server, prefix, **sparse)) as b:
        cache = ImpressCache(b)
        remote_run, _ = run(model, ask, cache=cache)
        b.flush()
        stats = b.stats()["remote"]
    assert cache.stats.matched_tokens == doc.shape[1]
    assert torch.equal(remote_run, local)  # the same rows selected from the same K/V
    assert stats["ranges_fetched"] >= 1 and 0 < stats["bytes_downloaded"] < 0.6 * obj.size


def _corrupt(backend, name, how):
    raw = bytearray(backend.get(name))
    data_start = 8 + int.from_bytes(raw[:8], "little")
    if how == "block":
        raw[data_start + 100] ^= 0xFF
    else:
        raw = raw[: len(raw) // 2]
    backend.put(name, bytes(raw))


@pytest.mark.parametrize("how", ["block", "truncated"])
def test_a_damaged_object_is_recomputed(bucket, tmp_path, how):
    server, prefix, backend = bucket
    model, doc = tiny_model(), _doc()
    _store_on_a(tmp_path, model, server, prefix, doc)
    (obj,) = _objects(backend, "obj")
    _corrupt(backend, obj, how)
    with ImpressStore(tmp_path / "b", model, _cfg(server, prefix)) as b:
        cache = assert_same_as_uncached(model, b, doc)
        # a damaged block: linked (its header is intact), quarantined when read, recomputed;
        # a truncated object: refused when its header comes back short
        assert cache.stats.quarantined_files == (1 if how == "block" else 0)
        assert b.stats()["remote"]["bad_objects"] == 1
        assert len(_chunk_files(tmp_path / "b")) == 1  # its own prompt only
        # and the object is not linked again: the next request recomputes at once
        cache = assert_same_as_uncached(model, b, torch.cat([doc, doc[:, :5]], dim=1))
        assert cache.stats.quarantined_files == 0
        assert b.stats()["remote"]["objects_linked"] == (1 if how == "block" else 0)


def test_another_models_object_under_the_same_name_is_refused(bucket, tmp_path):
    server, prefix, backend = bucket
    model, other, doc = tiny_model(), tiny_model(seed=1), _doc()
    _store_on_a(tmp_path, model, server, prefix, doc)
    with ImpressStore(tmp_path / "o", other, _cfg(server, prefix)) as o:
        assert_same_as_uncached(other, o, doc)
    (ours,), (theirs,) = _names_of(tmp_path / "a", backend), _names_of(tmp_path / "o", backend)
    assert ours != theirs  # each model has its own namespace
    backend.put(ours, backend.get(theirs))  # the other model's K/V under our name
    with ImpressStore(tmp_path / "b", model, _cfg(server, prefix)) as b:
        cache = assert_same_as_uncached(model, b, doc)
        assert cache.stats.matched_tokens == 0
        assert b.stats()["remote"]["bad_objects"] == 1


def _names_of(store_dir: Path, backend) -> set[str]:
    """Remote object names of the stores whose namespace a store directory's model has."""
    from impress_cache.store.remote import namespace

    with ImpressStore(store_dir, None) as s:
        ns = namespace(s.spec, s.probe)
    return {n for n in _objects(backend, "obj") if n.startswith(f"m-{ns}/")}


@pytest.mark.parametrize("when", ["header", "blocks"])
def test_server_killed_mid_request(own_seaweed, tmp_path, when):
    server = own_seaweed
    S3Backend(BUCKET, "", server.options).ensure_bucket()
    model, doc = tiny_model(), _doc()
    _store_on_a(tmp_path, model, server, "k", doc)
    with ImpressStore(tmp_path / "b", model, _cfg(server, "k")) as b:
        tier = b._remote
        real = tier.backend.get_ranges
        calls = []

        def get_ranges(name, ranges):  # the server dies before the object's header, or its blocks
            calls.append(name)
            if len(calls) == (1 if when == "header" else 2):
                server.stop()
            return real(name, ranges)

        tier.backend.get_ranges = get_ranges
        cache = assert_same_as_uncached(model, b, doc)
        remote = b.stats()["remote"]
        if when == "header":
            assert cache.stats.matched_tokens == 0 and remote["tokens_imported"] == 0
            assert remote["remote_errors"] >= 1
        else:  # linked, then the blocks could not come: quarantined and recomputed
            assert cache.stats.quarantined_files == 1 and remote["tokens_imported"] == doc.shape[1] - 1
        assert remote["uploads_dropped"] == 1  # its own prompt could not be uploaded: dropped
        assert _chunk_files(tmp_path / "b") and all(n.endswith(".safetensors") for n in _chunk_files(tmp_path / "b"))
    # the local store is consistent: it reuses its own prompt exactly, server or not
    with ImpressStore(tmp_path / "b", model, _cfg(server, "k")) as b:
        cache = assert_same_as_uncached(model, b, doc)
        assert cache.stats.matched_tokens == doc.shape[1] - 1


def test_server_killed_mid_write_never_advertises(own_seaweed, tmp_path):
    server = own_seaweed
    S3Backend(BUCKET, "", server.options).ensure_bucket()
    model, doc = tiny_model(), _doc()
    with ImpressStore(tmp_path / "a", model, _cfg(server, "w")) as a:
        tier = a._remote
        real_put = tier.backend.put

        def put(name, data):  # the data object is up; the server dies before the manifest
            if "/man/" in name:
                server.stop()
            return real_put(name, data)

        tier.backend.put = put
        assert_same_as_uncached(model, a, doc)  # flushes: the upload is retried, then dropped
        remote = a.stats()["remote"]
        assert remote["uploads_dropped"] == 1 and remote["prompts_advertised"] == 0
    server.start()  # same data directory, new ports
    backend = S3Backend(BUCKET, "w", server.options)
    assert len(_objects(backend, "obj")) == 1 and _objects(backend, "key") == []
    with ImpressStore(tmp_path / "b", model, _cfg(server, "w")) as b:
        cache = assert_same_as_uncached(model, b, doc)
        assert cache.stats.matched_tokens == 0  # a prompt without its keys is not found


def test_a_paused_server_costs_a_timeout_not_the_request(own_seaweed, tmp_path, monkeypatch):
    from impress_cache.store.remote import tier

    monkeypatch.setattr(tier, "DOWN_BACKOFF_S", 3600.0)
    server = own_seaweed
    S3Backend(BUCKET, "", server.options).ensure_bucket()
    model, doc = tiny_model(), _doc()
    _store_on_a(tmp_path, model, server, "p", doc)
    opts = {**server.options, "read_timeout": 1, "connect_timeout": 1, "retries": 1}
    cfg = _cfg(server, "p", remote_options=opts)
    os.killpg(server.proc.pid, signal.SIGSTOP)
    try:
        with ImpressStore(tmp_path / "b", model, cfg) as b:
            cache = assert_same_as_uncached(model, b, doc)
            assert cache.stats.matched_tokens == 0
            assert b.stats()["remote"]["remote_errors"] >= 1
            # the next request does not ask the failed server again (until the backoff ends)
            assert_same_as_uncached(model, b, _doc(seed=3))
            assert b.stats()["remote"]["lookups"] == 1
    finally:
        os.killpg(server.proc.pid, signal.SIGCONT)


def test_remote_budget_evicts_only_past_the_grace_period(bucket, tmp_path):
    server, prefix, backend = bucket
    model = tiny_model()
    docs = [_doc(seed=s) for s in (1, 2, 3)]
    with ImpressStore(tmp_path / "a", model, _cfg(server, prefix)) as a:
        for d in docs:
            assert_same_as_uncached(model, a, d)
    sizes = {e.name: e.size for e in backend.list("") if "/obj/" in e.name}
    assert len(sizes) == 3
    budget = 2 * max(sizes.values()) + 1  # room for two objects
    with ImpressStore(tmp_path / "b", model, _cfg(server, prefix, remote_bytes=budget)) as b:
        out = b._remote.enforce_budget()  # everything is younger than the 600 s grace period
        assert out["evicted_objects"] == 0 and out["remote_bytes"] > budget
    with ImpressStore(tmp_path / "b", model, _cfg(server, prefix, remote_bytes=budget, remote_grace_s=0)) as b:
        out = b._remote.enforce_budget()
        assert out["evicted_objects"] == 1 and out["remote_bytes"] <= budget
    assert len(_objects(backend, "obj")) == 2
    with ImpressStore(tmp_path / "c", model, _cfg(server, prefix)) as c:
        matched = [assert_same_as_uncached(model, c, d).stats.matched_tokens for d in docs]
    # two prompts come from the remote, the evicted one is recomputed (exactly, like all three)
    assert sorted(matched) == [0, 149, 149]


def test_remote_settings_are_validated():
    for bad in ({"remote": "bucket"}, {"remote": 3}, {"remote_options": []}, {"remote_bytes": 0},
                {"remote_retry_s": -1}, {"remote_key_tokens": 8}):
        with pytest.raises(ConfigError):
            ImpressConfig(**bad)


def test_fills_merge_neighbours_then_the_smallest_gaps():
    from impress_cache.store.remote.lazy import _coalesce, _merge

    assert _merge([(0, 10), (4000, 4200), (9000, 9100)]) == [(0, 4200), (9000, 9100)]  # < 4 KiB apart
    k = 10_000  # gaps well above 4 KiB
    ranges = [(0, 10), (10 * k, 10 * k + 10), (100 * k, 100 * k + 10), (102 * k, 102 * k + 10), (500 * k, 500 * k + 10)]
    assert _coalesce(ranges, 3) == [(0, 10 * k + 10), (100 * k, 102 * k + 10), (500 * k, 500 * k + 10)]
    assert _coalesce(ranges, 1) == [(0, 500 * k + 10)]


def test_only_the_default_namespace_travels(bucket, tmp_path):
    """Namespaces' ids are handed out per store: a namespace's prompts are neither
    uploaded nor looked up in the remote (another host's id may name another tenant)."""
    from impress_cache import ImpressCache
    from helpers import run

    server, prefix, backend = bucket
    model, doc = tiny_model(), _doc()
    with ImpressStore(tmp_path / "a", model, _cfg(server, prefix)) as a:
        run(model, doc, cache=ImpressCache(a, namespace="t"), new_tokens=2)
        a.flush()
        assert a.stats()["remote"]["prompts_advertised"] == 0
        assert _objects(backend, "obj") == []
    _store_on_a(tmp_path, model, server, prefix, doc)  # the default namespace's copy travels
    with ImpressStore(tmp_path / "b", model, _cfg(server, prefix)) as b:
        assert b.match(doc[0].numpy(), namespace="t").length == 0
        assert b.stats()["remote"]["lookups"] == 0
        assert b.match(doc[0].numpy()).length == doc.shape[1]
