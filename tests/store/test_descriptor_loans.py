"""A chunk file's descriptors lent to a read (`OpenFiles.lend`, `Loan`) stay open, and
stay that file's, until the read releases them, whatever `OpenFiles.drop` does meanwhile
(an eviction, a quarantine, a rewrite, the store closing); the last reader closes them.
The descriptor budget (`OpenFiles._fds`, `DESCRIPTORS`) counts them until then, and no
path leaks one."""

from __future__ import annotations

import os
import threading

import hypothesis.strategies as st
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings

from impress_cache import CorruptBlockError, ImpressConfig, ImpressStore
from impress_cache.storage import KV
from impress_cache.storage.reader import BlockReader, FileBlocks
from impress_cache.store import CHUNK_DIR, QUARANTINE_DIR
from impress_cache.store.chunkfiles import DESCRIPTORS
from test_direct_rows import TIERS_OFF, _buffer, _kv
from test_reorder import _model


def _store(path, n_files=1, n=64, direct_io=True):
    """A store (tiers off, one reader thread) holding ``n_files`` prompts of ``n`` tokens,
    each in a file of its own; returns it open and the prompts with their K/V."""
    cfg = ImpressConfig(chunk_tokens=16, fsync=False, direct_io=direct_io, io_threads=1, **TIERS_OFF)
    store = ImpressStore(path, _model(), cfg)
    spec = store.spec
    prompts = []
    for i in range(n_files):
        ks, vs = _kv(spec.num_layers, spec.num_kv_heads, n, spec.head_dim, spec.torch_kv_dtype, 7 + i)
        toks = [200 + i] + [3 + (5 * i + j) % 190 for j in range(n - 1)]
        store.put(toks, ks, vs)
        prompts.append((toks, ks, vs))
    store.flush()
    return store, prompts


def _chunk_fds(path):
    """This process's open descriptors on the store's chunk files (and its quarantine)."""
    roots = tuple(str((path / d).resolve()) + "/" for d in (CHUNK_DIR, QUARANTINE_DIR))
    out = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}").startswith(roots):
                out.add(int(fd))
        except OSError:
            pass
    return out


class _Busy:
    """The store's reader thread busy with a task of its own until `go`: reads started
    meanwhile have their descriptors and wait in the queue."""

    def __init__(self, store):
        self._gate, started = threading.Event(), threading.Event()
        self._task = store._reader._pool.submit(lambda: (started.set(), self._gate.wait(60)))
        assert started.wait(60)

    def go(self):
        self._gate.set()
        self._task.result(60)


def _open_past(numbers, path):
    """Open ``path`` until a descriptor above every number of ``numbers`` is returned:
    the kernel gives the lowest free number, so every one of ``numbers`` that is not
    open now is taken by one of these (another file's bytes behind it)."""
    got = []
    while not got or got[-1] <= max(numbers):
        got.append(os.open(path, os.O_RDONLY))
        assert len(got) < 4096
    return got


def _the_file(store, toks):
    """The store's open-file table, the layout of the stored ``toks`` and its one chunk
    file (id, `OpenFile`)."""
    lay = store.layout(store.match(toks).segments)
    (fid,) = set(lay.unit_files.tolist())
    return store._catalog.files, lay, fid, store._catalog.open_file(fid)


@pytest.mark.parametrize("way", ["pool", "direct"])
@pytest.mark.parametrize("how", ["forget", "quarantine"])
def test_a_file_dropped_while_a_read_waits_to_use_its_descriptors(tmp_path, way, how):
    """A read has its file's descriptors and waits behind the busy reader thread; the file
    is dropped meanwhile (forgotten as an eviction or a rewrite does, or quarantined by
    another request) and another file is opened, which would take the closed numbers. The
    read still reads its own file: the stored rows, no error, nothing quarantined
    because of it; the descriptors are closed once it is done and counted until then."""
    store, [(toks, ks, vs)] = _store(tmp_path / "s")
    junk = tmp_path / "junk"
    junk.write_bytes(os.urandom(1 << 20))  # another file's bytes where the chunk file's were
    spec = store.spec
    base = DESCRIPTORS.used
    with store:
        files, lay, fid, f = _the_file(store, toks)
        busy = _Busy(store)
        others: list[int] = []
        try:
            if way == "pool":
                read = store.start_layout(lay, KV, list(range(spec.num_layers)))
            else:
                buf = _buffer(store, len(toks), 0)
                read = store.start_rows(lay, spec.num_layers - 1, buf[:, 0])
                assert read is not None and f.dfd is not None  # (O_DIRECT tried: kept, or refused: -1)
            lent = {d for d in (f.fd, f.dfd) if d is not None and d >= 0}
            users = getattr(f, "users", None)
            if how == "forget":
                store._catalog.forget({fid})
            else:
                assert store.quarantine(fid, "damaged (as another request found)")
            assert fid not in files.ids() and f.fd is None and f.dfd is None
            counted = (files._fds, DESCRIPTORS.used - base)
            others = _open_past(lent, junk)
        finally:
            busy.go()
        try:
            if way == "pool":
                got, units = read.result(), len(lay.units)  # key ``layer * units + j``: block j of the layer
                for layer in range(spec.num_layers):
                    kv = torch.cat([got.block(layer * units + j) for j in range(units)], dim=2)
                    assert torch.equal(kv[0], ks[layer]) and torch.equal(kv[1], vs[layer])
            else:
                read.result()
                assert torch.equal(buf[0, 0], ks[-1]) and torch.equal(buf[1, 0], vs[-1])
        finally:
            for d in others:
                os.close(d)
        assert lent and users == 1
        assert counted == (len(lent), len(lent))  # counted until closed
        assert not lent & set(others)  # they stayed open: their numbers were not given out again
        assert f.users == 0 and not f.closing
        assert files._fds == 0 and DESCRIPTORS.used == base and not _chunk_fds(tmp_path / "s")
        quarantined = list((tmp_path / "s" / QUARANTINE_DIR).iterdir()) if (tmp_path / "s" / QUARANTINE_DIR).exists() else []
        assert len(quarantined) == (how == "quarantine")  # only the file quarantined on purpose
    assert DESCRIPTORS.used == base


def test_a_loan_outlives_the_store_closing(tmp_path):
    """Closing the store (`Catalog.close` drops every file) while a loan is out: its
    descriptors stay open and the file's until it is released, then are closed and
    given back to the process's budget."""
    base = DESCRIPTORS.used
    store, [(toks, _, _)] = _store(tmp_path)
    files = store._catalog.files
    fid = store.match(toks).segments[0].file_id
    f = files.get(fid)
    ino = os.stat(f.path).st_ino
    loan = files.lend(f, direct=True)
    assert loan is not None
    store.close()
    held = [d for d in (loan.fd, loan.dfd) if d is not None]
    assert all(os.fstat(d).st_ino == ino for d in held)
    assert DESCRIPTORS.used - base == files._fds == len(held)
    loan.release()
    loan.release()  # (again: nothing)
    assert files._fds == 0 and DESCRIPTORS.used == base and not _chunk_fds(tmp_path)


def _group(f, loan, layer=0, before=None):
    t = f.table
    blocks = np.arange(len(t.rows))
    nbytes = t.nbytes(KV, blocks)
    dest = nbytes.cumsum() - nbytes
    return FileBlocks(
        f.record.id, f.path, loan.fd, t.offsets[KV, layer, blocks], nbytes, t.checksums[KV, layer, blocks],
        t.seeds[KV, layer, blocks], dest, before, done=loan.release,
    ), int(nbytes.sum())


@pytest.mark.parametrize("where", ["inline", "pool"])
@pytest.mark.parametrize("error", [CorruptBlockError("failed before the read", 0), KeyboardInterrupt()])
def test_a_read_that_fails_gives_its_descriptors_back(tmp_path, where, error):
    """A read that raises before it reads (here its ``before`` step: a remote tier's fill
    that failed, or was interrupted; such a group runs on a reader thread even in an
    inline read, `tests/storage/test_inline_reads.py` has an interrupt inside one) gives
    its loan back before the error reaches its caller; the file dropped meanwhile has its
    descriptors closed then."""
    if where == "pool" and isinstance(error, KeyboardInterrupt):
        pytest.skip("an interrupt reaches the main thread only: inline reads")
    base = DESCRIPTORS.used
    store, _ = _store(tmp_path)
    with store:
        files = store._catalog.files
        f = files.get(next(iter(store._catalog.records)))
        loan = files.lend(f)
        files.drop([f.record.id])  # (evicted while the read starts)
        assert files._fds == 1

        def before():
            raise error

        g, size = _group(f, loan, before=before)
        with pytest.raises(type(error)):
            store._reader.submit([g], memoryview(bytearray(size)), inline=where == "inline").wait()
        assert f.users == 0 and files._fds == 0 and DESCRIPTORS.used == base and not _chunk_fds(tmp_path)


def test_groups_never_started_give_their_descriptors_back(tmp_path):
    """`BlockReader.submit` raising before it started a group's reads (the reader shut
    down) calls that group's ``done`` as well: no loan stays out."""
    store, _ = _store(tmp_path, n_files=2)
    with store:
        files = store._catalog.files
        fs = [files.get(fid) for fid in store._catalog.records]
        loans = [files.lend(f) for f in fs]
        groups = [_group(f, loan) for f, loan in zip(fs, loans)]
        reader = BlockReader(threads=1)
        reader.close()
        with pytest.raises(RuntimeError):
            reader.submit([g for g, _ in groups], memoryview(bytearray(sum(s for _, s in groups))))
        assert all(f.users == 0 for f in fs)
        kept = files._fds
        files.drop([f.record.id for f in fs])
        assert files._fds == kept - len(fs) * 1 == 0


def test_past_the_cap_a_read_opens_and_closes_its_own_descriptor(tmp_path):
    """No room under `max_fds`: nothing is lent, the read opens its file for itself and
    closes it; nothing is kept or left open, and the rows are the stored ones."""
    store, [(toks, ks, vs)] = _store(tmp_path)
    with store:
        files = store._catalog.files
        files.max_fds = 0
        f = files.get(store.match(toks).segments[0].file_id)
        assert files.lend(f, direct=True) is None
        lay = store.layout(store.match(toks).segments)
        buf = _buffer(store, len(toks), 0)
        store.start_rows(lay, 1, buf[:, 0]).result()
        assert torch.equal(buf[0, 0], ks[1]) and torch.equal(buf[1, 0], vs[1])
        assert files._fds == 0 and not _chunk_fds(tmp_path)


def test_a_refused_o_direct_descriptor_is_lent_as_none(tmp_path, monkeypatch):
    """A platform without ``O_DIRECT``: the refusal is remembered (``dfd`` ``-1``), the
    loan has no ``O_DIRECT`` descriptor, only the buffered one is counted."""
    monkeypatch.delattr(os, "O_DIRECT", raising=False)
    store, [(toks, _, _)] = _store(tmp_path)
    with store:
        files = store._catalog.files
        f = files.get(store.match(toks).segments[0].file_id)
        loan = files.lend(f, direct=True)
        assert loan is not None and loan.dfd is None and f.dfd == -1 and files._fds == 1
        files.drop([f.record.id])
        assert files._fds == 1 and os.fstat(loan.fd)
        loan.release()
        assert files._fds == 0 and not _chunk_fds(tmp_path)


_OPS = st.lists(
    st.one_of(
        st.tuples(st.just("lend"), st.integers(0, 2), st.booleans()),
        st.tuples(st.just("lend_old"), st.integers(0, 7), st.booleans()),
        st.tuples(st.just("release"), st.integers(0, 7)),
        st.tuples(st.just("drop"), st.integers(0, 2)),
        st.tuples(st.just("close")),
    ),
    max_size=40,
)


def test_the_descriptor_count_is_exact_whatever_the_order(tmp_path):
    """Random interleavings of lending, giving back, dropping files and dropping them all
    (what closing the catalog does), under a random cap: after every step each loan's
    descriptors are open and its file's, each file counts its readers, `_fds` and
    `DESCRIPTORS.used` count exactly the descriptors open on chunk files (kept, or
    waiting for their last reader), never more than the cap; at the end nothing is left."""
    store, prompts = _store(tmp_path, n_files=3, n=40)
    root = tmp_path
    with store:
        files = store._catalog.files
        fids = sorted(store._catalog.records)
        ino = {fid: os.stat(root / CHUNK_DIR / store._catalog.records[fid].name).st_ino for fid in fids}
        before = set(os.listdir("/proc/self/fd"))
        base = DESCRIPTORS.used

        @settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
        @given(ops=_OPS, cap=st.integers(0, 6))
        def run(ops, cap):
            files.max_fds = cap
            loans, seen = [], []  # (loan, file, fid); every OpenFile met

            def check():
                for loan, f, fid in loans:
                    for d in (loan.fd, loan.dfd):
                        if d is not None:
                            assert os.fstat(d).st_ino == ino[fid]
                for f in seen:
                    assert f.users == sum(1 for _, g, _ in loans if g is f)
                    assert not f.closing or f.users  # (waiting only for a reader)
                kept = sum(1 for f in files._open.values() for d in (f.fd, f.dfd) if d is not None and d >= 0)
                waiting = sum(len(f.closing) for f in seen)
                open_now = _chunk_fds(root)
                assert files._fds == kept + waiting == len(open_now) == DESCRIPTORS.used - base
                assert files._fds <= max(cap, 0) or waiting  # (the cap lowered below what is kept)

            try:
                for op in ops:
                    step(op, loans, seen)
                    check()
            finally:  # (every example starts from nothing kept, even after one that failed)
                for loan, _, _ in loans:
                    loan.release()
                loans.clear()
                files.drop(files.ids())
            check()
            assert files._fds == 0 and DESCRIPTORS.used == base
            assert set(os.listdir("/proc/self/fd")) == before

        def step(op, loans, seen):
            if op[0] in ("lend", "lend_old"):
                if op[0] == "lend":
                    f = files.get(fids[op[1]])
                elif seen:
                    f = seen[op[1] % len(seen)]  # perhaps dropped since
                else:
                    return
                if not any(g is f for g in seen):
                    seen.append(f)
                dropped = files._open.get(f.record.id) is not f
                loan = files.lend(f, direct=op[2])
                if dropped:
                    assert loan is None
                if loan is not None:
                    loans.append((loan, f, f.record.id))
            elif op[0] == "release" and loans:
                loan, _, _ = loans.pop(op[1] % len(loans))
                loan.release()
            elif op[0] == "drop":
                files.drop([fids[op[1]]])
            elif op[0] == "close":
                files.drop(files.ids())

        run()


def test_reads_never_waited_for_give_their_descriptors_back(tmp_path):
    """Reads started and never waited for (a request that failed between starting a read
    and its result, a read-ahead the request no longer needs) give their loans back when
    the reader threads are done with them: the file dropped meanwhile has its
    descriptors closed then, and nothing stays counted."""
    base = DESCRIPTORS.used
    store, [(toks, _, _)] = _store(tmp_path)
    spec = store.spec
    with store:
        files, lay, fid, f = _the_file(store, toks)
        busy = _Busy(store)
        try:
            store.start_layout(lay, KV, list(range(spec.num_layers)))  # (its `PendingRead` dropped at once)
            assert store.start_rows(lay, 0, _buffer(store, len(toks), 0)[:, 0]) is not None  # (its `RowsRead` too)
            assert f.users == 2
            files.drop([fid])
            assert files._fds == len(f.closing) > 0
        finally:
            busy.go()
        store._reader._pool.submit(lambda: None).result(60)  # (one reader thread: every read before it has ended)
        assert f.users == 0 and not f.closing
        assert files._fds == 0 and DESCRIPTORS.used == base and not _chunk_fds(tmp_path)


def test_closing_the_store_waits_for_queued_reads_and_leaves_nothing_open(tmp_path):
    """`store.close()` while reads wait in the reader's queue with their descriptors: the
    close waits for them (the reader is shut down before the catalog drops its files),
    they read the stored rows, and nothing is left open or counted after."""
    base = DESCRIPTORS.used
    store, [(toks, ks, vs)] = _store(tmp_path)
    spec = store.spec
    lay = store.layout(store.match(toks).segments)
    busy = _Busy(store)
    closer = threading.Thread(target=store.close)
    try:
        read = store.start_layout(lay, KV, list(range(spec.num_layers)))
        closer.start()
    finally:
        busy.go()
    closer.join(60)
    assert not closer.is_alive()
    got, units = read.result(), len(lay.units)
    for layer in range(spec.num_layers):
        kv = torch.cat([got.block(layer * units + j) for j in range(units)], dim=2)
        assert torch.equal(kv[0], ks[layer]) and torch.equal(kv[1], vs[layer])
    assert store._catalog.files._fds == 0 and DESCRIPTORS.used == base and not _chunk_fds(tmp_path)


def test_reads_racing_with_drops_read_their_own_files(tmp_path):
    """Reader threads read stored prompts (the pool path, inline reads and direct rows)
    while another thread drops their files over and over (as evictions, quarantines and
    tree reloads do), changes the cap and opens other files, which take every descriptor
    number freed: every read returns the stored rows (before loans, such reads failed
    their checksums within a few reads), and at the end nothing is left open or counted."""
    import random

    base = DESCRIPTORS.used
    store, prompts = _store(tmp_path / "s", n_files=3, n=48)
    junk = tmp_path / "junk"
    junk.write_bytes(os.urandom(1 << 16))
    spec = store.spec
    files = store._catalog.files
    done, errors = threading.Event(), []

    def read(seed):
        rnd = random.Random(seed)
        try:
            for _ in range(60):
                toks, ks, vs = prompts[rnd.randrange(len(prompts))]
                lay = store.layout(store.match(toks).segments)
                if rnd.random() < 0.6:
                    got = store.start_layout(lay, KV, list(range(spec.num_layers)), inline=rnd.random() < 0.3).result()
                    units = len(lay.units)
                    for layer in range(spec.num_layers):
                        kv = torch.cat([got.block(layer * units + j) for j in range(units)], dim=2)
                        assert torch.equal(kv[0], ks[layer]) and torch.equal(kv[1], vs[layer])
                else:
                    layer = rnd.randrange(spec.num_layers)
                    buf = _buffer(store, len(toks), 0)
                    store.start_rows(lay, layer, buf[:, 0]).result()
                    assert torch.equal(buf[0, 0], ks[layer]) and torch.equal(buf[1, 0], vs[layer])
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    def drop():
        rnd, held = random.Random(7), []
        try:
            while not done.is_set():
                ids = list(store._catalog.records)
                files.drop(rnd.sample(ids, rnd.randint(1, len(ids))))
                files.max_fds = rnd.choice([0, 2, 4, 64])
                for d in held:
                    os.close(d)
                held = [os.open(junk, os.O_RDONLY) for _ in range(rnd.randint(0, 6))]
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
        finally:
            for d in held:
                os.close(d)

    with store:
        dropper = threading.Thread(target=drop)
        readers = [threading.Thread(target=read, args=(i,)) for i in range(3)]
        dropper.start()
        for t in readers:
            t.start()
        for t in readers:
            t.join(300)
        done.set()
        dropper.join(60)
        assert not errors, errors[0]
        assert not any(t.is_alive() for t in (dropper, *readers))
        assert all(f.users == 0 for f in files._open.values())
        files.drop(files.ids())
        assert files._fds == 0 and DESCRIPTORS.used == base and not _chunk_fds(tmp_path / "s")
    assert not (tmp_path / "s" / QUARANTINE_DIR).exists() or not list((tmp_path / "s" / QUARANTINE_DIR).iterdir())
