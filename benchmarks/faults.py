"""Fault injection: every way issue 10 found to get a wrong answer, a raw traceback, a
hang or a file outside the store touched, tried many times.

    python benchmarks/faults.py --quick --out /tmp/faults-quick.json    # ~2 min on 2 cores
    python benchmarks/faults.py --out results/faults.json               # ~15 min

A tiny random Llama (2 layers, 64 hidden, exact reuse ``important_ratio=1.0``) keeps
each try cheap; what is tested is the store, not the model. Per category the table
gives tries, exact (the right K/V or output), clear errors (an `ImpressError`, by
design), wrong (K/V or output other than the uncached one), raw (any other exception),
hangs (a try that did not finish in 60 s) and outside (tries after which a file outside
the store directory had changed: a "user" directory next to every store is compared
before and after each try). Done when wrong, raw, hangs and outside are all 0.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import hashlib
import json
import logging
import multiprocessing
import os
import platform
import random
import resource
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from impress_cache import CacheUsageError, ImpressCache, ImpressConfig, ImpressError, ImpressStore
from impress_cache.cli import repair_store
from impress_cache.errors import CorruptBlockError, ModelMismatchError, StoreFormatError, StoreIOError
from impress_cache.index.schema import INVARIANT_NAMES
from impress_cache.storage.base import KV, PROBE

CFG = ImpressConfig(chunk_tokens=16, important_ratio=1.0, reorg_idle_ms=None)
VOCAB = 256


def tiny(seed: int = 0) -> torch.nn.Module:
    cfg = LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=1024, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def tokens(seed: int, n: int) -> torch.Tensor:
    return torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))


def generate(model, ids: torch.Tensor, store: ImpressStore | None = None, new: int = 2) -> torch.Tensor:
    kw: dict[str, Any] = {"max_new_tokens": new, "do_sample": False}
    if store is not None:
        kw["past_key_values"] = ImpressCache(store)
    with torch.no_grad(), _quiet():
        return model.generate(ids[None] if ids.dim() == 1 else ids, **kw)


@contextlib.contextmanager
def _quiet():
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def synthetic_kv(store: ImpressStore, toks: torch.Tensor):
    """K/V that are a function of the token ids and positions: other tokens' rows differ."""
    s, n = store.spec, len(toks)
    base = toks.float()[None, :, None] + torch.arange(n).float()[None, :, None] / 1000
    keys = [base.expand(s.num_kv_heads, n, s.head_dim) + layer for layer in range(s.num_layers)]
    return keys, [-k for k in keys]


def kv_exact(store: ImpressStore, toks: torch.Tensor, match) -> bool:
    got = store.load(match.segments)
    want = torch.stack(synthetic_kv(store, toks[: match.length])[0])
    return torch.equal(got.keys, want)


# -- bookkeeping ------------------------------------------------------------------------
class Tally:
    def __init__(self) -> None:
        self.rows: dict[str, dict[str, int]] = {}
        self.examples: dict[str, list[str]] = {}

    def add(self, category: str, outcome: str, note: str = "") -> None:
        row = self.rows.setdefault(
            category, {"tries": 0, "exact": 0, "clear_errors": 0, "wrong": 0, "raw": 0, "hangs": 0, "outside": 0}
        )
        row["tries"] += 1
        row[outcome] += 1
        if outcome in ("wrong", "raw", "hangs", "outside") and note:
            self.examples.setdefault(category, []).append(note[:300])


class _Hang(Exception):
    pass


def _snapshot(d: Path) -> dict[str, str]:
    out = {}
    for p in sorted(d.rglob("*")):
        st = p.lstat()
        out[str(p)] = f"{st.st_mode}:{st.st_size}:{hashlib.sha1(p.read_bytes()).hexdigest() if p.is_file() else ''}"
    return out


def attempt(tally: Tally, category: str, work: Path, fn: Callable[[Path, Path], bool]) -> None:
    """Run one try in a fresh directory with a "user" directory beside the store."""
    d = Path(tempfile.mkdtemp(dir=work))
    user = d / "user"
    user.mkdir()
    (user / "precious.txt").write_text("the user's file")
    (user / "notes").mkdir()
    (user / "notes" / "a.txt").write_text("more")
    before = _snapshot(user)

    def fire(*_: Any) -> None:
        raise _Hang()

    old = signal.signal(signal.SIGALRM, fire)
    signal.alarm(60)
    try:
        outcome, note = ("exact" if fn(d / "store", user) else "wrong"), "K/V or output differ"
    except _Hang:
        outcome, note = "hangs", "no result in 60 s"
    except ImpressError:
        outcome, note = "clear_errors", ""
    except Exception as exc:  # noqa: BLE001 - what the table counts
        outcome, note = "raw", f"{type(exc).__name__}: {exc}"
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    if _snapshot(user) != before:
        outcome, note = "outside", "a file outside the store changed"
    tally.add(category, outcome, note)
    shutil.rmtree(d, ignore_errors=True)


# -- categories -----------------------------------------------------------------------------
def split_race(path: Path, user: Path, rng: random.Random) -> bool:
    """Readers load matched prefixes while the writer splits their nodes."""
    model = MODEL
    a = tokens(rng.randrange(10**6), 96)
    with ImpressStore(path, model, CFG) as store:
        store.put(a.tolist(), *synthetic_kv(store, a))
        ok, stop = [True], threading.Event()

        def reader() -> None:
            while not stop.is_set():
                m = store.match(a.tolist(), limit=95)
                with store.lease([m]):
                    try:
                        ok[0] &= kv_exact(store, a, m)
                    except CorruptBlockError:
                        pass

        t = threading.Thread(target=reader)
        t.start()
        try:
            for cut in rng.sample(range(1, 95), 12):
                b = torch.cat([a[:cut], tokens(rng.randrange(10**6), 20)])
                store.put(b.tolist(), *synthetic_kv(store, b))
        finally:
            stop.set()
            t.join()
        return ok[0]


def file_id_reuse(path: Path, user: Path, rng: random.Random) -> bool:
    a, b = tokens(rng.randrange(10**6), 64), tokens(rng.randrange(10**6), 64)
    with ImpressStore(path, MODEL, CFG) as mine, ImpressStore(path, MODEL, CFG) as other:
        mine.put(a.tolist(), *synthetic_kv(mine, a))
        m = mine.match(a.tolist(), limit=63)
        other.match(a.tolist())
        other.quarantine(m.segments[0].file_id, "fault injection")
        other.put(b.tolist(), *synthetic_kv(other, b))
        try:
            return kv_exact(mine, a, m)
        except CorruptBlockError:
            return True  # verification refused the old match: the request recomputes


def failed_commit(path: Path, user: Path, rng: random.Random) -> bool:
    a, b, c = (tokens(rng.randrange(10**6), 64) for _ in range(3))
    a[0], b[0], c[0] = 3, 4, 5  # no common prefix: b's match must be empty
    with ImpressStore(path, MODEL, CFG) as store:
        store.put(a.tolist(), *synthetic_kv(store, a))
        conn = sqlite3.connect(path / "index.sqlite")
        conn.execute("CREATE TRIGGER fail BEFORE INSERT ON nodes BEGIN SELECT RAISE(ABORT, 'injected'); END")
        conn.commit()
        store.put(b.tolist(), *synthetic_kv(store, b))
        conn.execute("DROP TRIGGER fail")
        conn.commit()
        conn.close()
        store.put(c.tolist(), *synthetic_kv(store, c))
        return all(
            kv_exact(store, t, store.match(t.tolist(), limit=63)) for t in (a, c)
        ) and store.match(b.tolist()).length == 0


def _create(path: Path, seed: int, barrier: Any, results: Any) -> None:
    model = tiny(seed)
    barrier.wait()
    try:
        ImpressStore(path, model, CFG).close()
        results.put((seed, "ok"))
    except ImpressError as exc:
        results.put((seed, type(exc).__name__))
    except BaseException as exc:  # noqa: BLE001
        results.put((seed, "raw " + repr(exc)))


def create_race(path: Path, user: Path, rng: random.Random) -> bool:
    ctx = multiprocessing.get_context("fork")
    barrier, results = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=_create, args=(path, seed, barrier, results)) for seed in (0, 1)]
    for p in procs:
        p.start()
    got = dict(results.get(timeout=50) for _ in procs)
    for p in procs:
        p.join(timeout=30)
    if any(v.startswith("raw") for v in got.values()):
        raise RuntimeError(str(got))
    return sorted(got.values()) == ["ModelMismatchError", "ok"]


_INDEX_COLUMNS = [
    ("files", "tokens"), ("files", "offsets"), ("files", "checksums"), ("files", "context"), ("files", "first_pos"),
    ("files", "n_tokens"), ("files", "name"), ("files", "chunk_tokens"), ("files", "layers"), ("files", "perm"),
    ("nodes", "file_row"), ("nodes", "length"), ("nodes", "parent"), ("nodes", "file_id"), ("meta", "value"),
]


def _mutate(value: Any, rng: random.Random) -> Any:
    if isinstance(value, bytes) and value:
        raw = bytearray(value)
        raw[rng.randrange(len(raw))] ^= 1 << rng.randrange(8)
        return bytes(raw)
    if isinstance(value, int):
        return value + rng.choice([-2, -1, 1, 2, 16])
    if isinstance(value, str) and value:
        i = rng.randrange(len(value))
        return value[:i] + rng.choice(["/", ".", "x", "0", '"', "../"]) + value[i + 1 :]
    return rng.choice([b"\x01", 1, "x"])


def _two_prompts(path: Path, rng_seed: int) -> list[torch.Tensor]:
    a = tokens(rng_seed, 64)
    docs = [a, torch.cat([a[:40], tokens(rng_seed + 1, 30)])]
    with ImpressStore(path, MODEL, CFG) as store:
        for d in docs:
            generate(MODEL, d, store)
    return docs


def _serve_exact(path: Path, docs: list[torch.Tensor]) -> bool:
    with ImpressStore(path, MODEL, CFG) as store:
        return all(torch.equal(generate(MODEL, d, store), generate(MODEL, d)) for d in docs)


def index_damage(path: Path, user: Path, rng: random.Random) -> bool:
    docs = _two_prompts(path, rng.randrange(10**6))
    if rng.random() < 0.3:  # raw bit flips anywhere in the database file
        f = path / "index.sqlite"
        raw = bytearray(f.read_bytes())
        for _ in range(rng.choice([1, 4, 16])):
            raw[rng.randrange(len(raw))] ^= 1 << rng.randrange(8)
        f.write_bytes(bytes(raw))
    else:
        table, column = rng.choice(_INDEX_COLUMNS)
        conn = sqlite3.connect(path / "index.sqlite")
        for name in INVARIANT_NAMES:  # damage on disk never goes through the invariant triggers
            conn.execute(f"DROP TRIGGER IF EXISTS {name}")
        rows = conn.execute(f"SELECT rowid, {column} FROM {table}").fetchall()
        rowid, value = rng.choice(rows)
        if column == "name" and rng.random() < 0.5:
            value = "../../user/precious.txt"
        else:
            value = _mutate(value, rng)
        with contextlib.suppress(sqlite3.IntegrityError):
            conn.execute(f"UPDATE {table} SET {column}=? WHERE rowid=?", (value, rowid))
            conn.commit()
        conn.close()
    return _serve_exact(path, docs)


def chunk_damage(path: Path, user: Path, rng: random.Random) -> bool:
    docs = _two_prompts(path, rng.randrange(10**6))
    f = rng.choice(sorted((path / "chunks").iterdir()))
    how = rng.choice(["flip", "flip", "truncate", "delete", "directory", "fifo", "symlink", "zero"])
    if how in ("flip", "zero"):
        raw = bytearray(f.read_bytes())
        for _ in range(rng.choice([1, 8])):
            i = rng.randrange(len(raw))
            raw[i] = 0 if how == "zero" else raw[i] ^ (1 << rng.randrange(8))
        f.write_bytes(bytes(raw))
    elif how == "truncate":
        f.write_bytes(f.read_bytes()[: rng.randrange(f.stat().st_size)])
    else:
        f.unlink()
        if how == "directory":
            f.mkdir()
        elif how == "fifo":
            os.mkfifo(f)
        elif how == "symlink":
            f.symlink_to(user / "precious.txt")
    return _serve_exact(path, docs)


def other_model(path: Path, user: Path, rng: random.Random) -> bool:
    other = OTHER
    d = tokens(rng.randrange(10**6), 48)
    with ImpressStore(path, MODEL, CFG) as store, ImpressStore(path.with_name("other"), other, CFG) as mine:
        generate(MODEL, d, store)
        ImpressCache(mine)  # the other model has hooks too
        try:
            if rng.random() < 0.5:
                generate(other, d, store)
            else:  # a model no ImpressCache was built for (no hooks), the cache bound up front
                with torch.no_grad(), _quiet():
                    tiny(2).generate(d[None], max_new_tokens=2, past_key_values=ImpressCache(store, d[None]))
        except CacheUsageError:
            return True
        return False


def outside(path: Path, user: Path, rng: random.Random) -> bool:
    """Links and foreign files where the store keeps its own."""
    how = rng.choice(["chunks_link", "foreign_files", "index_link", "quarantine_link", "path_is_file", "wal_link"])
    if how == "path_is_file":
        path.write_text("x")
        ImpressStore(path, MODEL, CFG)
        return False
    if how == "quarantine_link":
        docs = _two_prompts(path, rng.randrange(10**6))
        (path / "quarantine").symlink_to(user)
        for f in (path / "chunks").iterdir():
            f.write_bytes(f.read_bytes()[:5000])
        return _serve_exact(path, docs)
    path.mkdir()
    if how == "chunks_link":
        (path / "chunks").symlink_to(user)
    elif how == "foreign_files":
        shutil.copytree(user, path / "chunks")
    elif how == "index_link":
        (path / "index.sqlite").symlink_to(user / "precious.txt")
    else:
        (path / "index.sqlite-wal").symlink_to(user / "precious.txt")
    ImpressStore(path, MODEL, CFG).close()
    return False  # opening must have been refused


_EFBIG = textwrap.dedent(
    """
    import resource, signal, sys, torch
    sys.path.insert(0, {here!r})
    from faults import MODEL_FACTORY, generate, tokens, CFG
    from impress_cache import ImpressStore
    model = MODEL_FACTORY(0)
    store = ImpressStore({path!r}, model, CFG)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, {limit}))
    ok = True
    for seed in range(4):
        ids = tokens(seed, 300)
        ok &= bool(torch.equal(generate(model, ids, store), generate(model, ids)))
    store.flush()
    store.close()
    store.close()
    print("exact" if ok else "wrong")
    """
)


def write_failure(path: Path, user: Path, rng: random.Random) -> bool:
    """EFBIG (a file-size limit) in a child process; ENOSPC on a small tmpfs when root."""
    if os.geteuid() == 0 and rng.random() < 0.5:
        mnt = path.with_name("mnt")
        mnt.mkdir()
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)], check=True)
        try:
            store = ImpressStore(mnt / "s", MODEL, CFG)
            generate(MODEL, tokens(0, 64), store)
            store.flush()
            free = shutil.disk_usage(mnt).free
            (mnt / "filler").write_bytes(b"\0" * max(0, free - rng.choice([4096, 16384, 65536])))
            ok = all(torch.equal(generate(MODEL, tokens(s, 200), store), generate(MODEL, tokens(s, 200))) for s in range(1, 4))
            store.flush()
            store.close()
            store.close()
            return ok
        finally:
            subprocess.run(["umount", str(mnt)], check=True)
    script = _EFBIG.format(here=str(Path(__file__).parent), path=str(path), limit=rng.choice([5000, 20000, 60000]))
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=55)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else "child failed")
    return proc.stdout.strip().endswith("exact")


def read_only(path: Path, user: Path, rng: random.Random) -> bool:
    docs = _two_prompts(path, rng.randrange(10**6))
    if os.geteuid() != 0:
        raise ImpressError("read-only volume needs root to mount; counted as not tried")
    subprocess.run(["mount", "--bind", str(path), str(path)], check=True)
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", str(path)], check=True)
        with ImpressStore(path, MODEL, CFG, read_only=True) as store:
            return all(torch.equal(generate(MODEL, d, store), generate(MODEL, d)) for d in docs)
    finally:
        subprocess.run(["umount", str(path)], check=True)


def hooks_threads(path: Path, user: Path, rng: random.Random) -> bool:
    model = tiny(rng.randrange(100))
    store = ImpressStore(path, model, CFG)
    barrier = threading.Barrier(8)

    def build() -> None:
        barrier.wait()
        ImpressCache(store)

    threads = [threading.Thread(target=build) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    d = tokens(rng.randrange(10**6), 48)
    ok = len(model._forward_pre_hooks) == 1 and all(
        torch.equal(generate(model, d, store), generate(model, d)) for _ in range(2)
    )
    store.close()
    return ok


_WRITER = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, {here!r})
    from faults import MODEL_FACTORY, generate, tokens, CFG
    from impress_cache import ImpressStore
    model = MODEL_FACTORY(0)
    store = ImpressStore({path!r}, model, CFG)
    for seed in range(1000):
        generate(model, tokens(seed, 48 + seed % 32), store, new=1)
        store.flush()
        print(seed, flush=True)
    """
)


def kill9(path: Path, user: Path, rng: random.Random) -> bool:
    confirmed: set[int] = set()
    for _ in range(2):
        proc = subprocess.Popen(
            [sys.executable, "-c", _WRITER.format(here=str(Path(__file__).parent), path=str(path))],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        )
        stop = rng.randrange(1, 6)
        assert proc.stdout is not None
        for i, line in enumerate(proc.stdout, 1):
            confirmed.add(int(line))
            if i == stop:
                proc.kill()
                break
        proc.wait(timeout=30)
        proc.stdout.close()
    with ImpressStore(path, MODEL, CFG) as store:
        for seed in sorted(confirmed):
            ids = tokens(seed, 48 + seed % 32)
            if store.match(ids.tolist()).length != len(ids) or not torch.equal(generate(MODEL, ids, store), generate(MODEL, ids)):
                return False
    return True


def repair(path: Path, user: Path, rng: random.Random) -> bool:
    docs = _two_prompts(path, rng.randrange(10**6))
    f = path / "index.sqlite"
    raw = bytearray(f.read_bytes())
    start, n = rng.randrange(100, len(raw) - 100), rng.choice([100, 1000, 4000])
    raw[start : start + n] = b"\xff" * len(raw[start : start + n])
    f.write_bytes(bytes(raw))
    with _quiet(), contextlib.redirect_stderr(open(os.devnull, "w")):
        repair_store(path)
    return _serve_exact(path, docs)


# -- issue 25 ---------------------------------------------------------------------------------
def _evict_all(path: str) -> None:
    """Another process with a disk budget of one byte: it removes every prefix it may."""
    torch.set_num_threads(1)
    logging.disable(logging.CRITICAL)
    with ImpressStore(path, tiny(0), ImpressConfig(chunk_tokens=16, important_ratio=1.0, reorg_idle_ms=None, disk_bytes=1)) as store:
        store.enforce_disk_budget()


class _BeforeBegin:
    """The store's real SQLite connection; its next ``BEGIN IMMEDIATE`` first runs
    ``before`` (another process evicting between the writer's plan and its transaction)."""

    def __init__(self, conn: Any, before: Callable[[], None]) -> None:
        self._conn, self._before, self.armed = conn, before, True

    def execute(self, sql: str, *args: Any) -> Any:
        if sql == "BEGIN IMMEDIATE" and self.armed:
            self.armed = False
            self._before()
        return self._conn.execute(sql, *args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._conn, name)


def _in_process(target: Callable[..., None], *args: Any, timeout: float = 50) -> None:
    ctx = multiprocessing.get_context("spawn")  # (the parent holds its store's locks meanwhile)
    proc = ctx.Process(target=target, args=args)
    proc.start()
    proc.join(timeout)
    if proc.exitcode != 0:
        proc.kill()
        raise RuntimeError(f"{target.__name__} ended with {proc.exitcode}")


def budget_race(path: Path, user: Path, rng: random.Random) -> bool:
    """Issue 25, item 1: a prompt evicted by another process between the writer's plan
    and its transaction (the prompt asked again whole, or with a tail); a fresh open of
    the store then serves exactly."""
    doc = tokens(rng.randrange(10**6), 48)
    asked = doc if rng.random() < 0.5 else torch.cat([doc, tokens(rng.randrange(10**6), 8)])
    with ImpressStore(path, MODEL, CFG) as store:
        generate(MODEL, doc, store)
        store.flush()
        hook = _BeforeBegin(store.index._conn, lambda: _in_process(_evict_all, str(path)))
        store.index._conn = hook
        generate(MODEL, asked, store)
        store.flush()
        if hook.armed:  # nothing was committed (a prompt stored already): it goes all the same
            _in_process(_evict_all, str(path))
        store.index._conn = hook._conn
        if store.stats()["write_failures"]:
            return False
    return _serves_after(path, [doc, asked])


def _serves_after(path: Path, docs: list[torch.Tensor]) -> bool:
    """A fresh open serves exactly (a store that cannot be opened again is wrong here:
    the damaged index of issue 25)."""
    try:
        return _serve_exact(path, docs)
    except ImpressError:
        return False


def _budget_worker(path: str, seed: int, seconds: float, budget: int, out: Any) -> None:
    torch.set_num_threads(1)
    logging.disable(logging.CRITICAL)
    model = tiny(0)
    pool = [torch.cat([tokens(7, 24), tokens(100 + i, 16 + 8 * (i % 3))]) for i in range(8)]
    reused = 0
    try:
        with ImpressStore(path, model, ImpressConfig(chunk_tokens=16, important_ratio=1.0, reorg_idle_ms=None, disk_bytes=budget)) as store:
            deadline, i = time.monotonic() + seconds, seed
            while time.monotonic() < deadline:
                toks = pool[i % len(pool)]
                i += 1
                cache = ImpressCache(store)
                with torch.no_grad(), _quiet():
                    model.generate(toks[None], max_new_tokens=1, do_sample=False, past_key_values=cache)
                reused += cache.stats.matched_tokens
            store.flush()
            out.put((seed, reused, store.stats()["write_failures"], None))
    except BaseException as exc:  # noqa: BLE001 - reported by the parent
        out.put((seed, reused, -1, f"{type(exc).__name__}: {exc}"))


def budget_processes(path: Path, user: Path, rng: random.Random) -> bool:
    """Issue 25, item 1: three processes with a disk budget of about three prompts ask
    for and store prompts of one pool; every process keeps reusing, no write fails and a
    fresh process opens the store and serves exactly."""
    pool = [torch.cat([tokens(7, 24), tokens(100 + i, 16 + 8 * (i % 3))]) for i in range(8)]
    with ImpressStore(path, MODEL, CFG) as store:
        generate(MODEL, pool[0], store)
        store.flush()
        budget = store.disk_bytes() + 2 * store._catalog.chunk_bytes
    ctx = multiprocessing.get_context("fork")  # (no store is open in this process meanwhile)
    out = ctx.Queue()
    procs = [ctx.Process(target=_budget_worker, args=(str(path), s + rng.randrange(8), 4.0, budget, out)) for s in range(3)]
    for p in procs:
        p.start()
    got = [out.get(timeout=55) for _ in procs]
    for p in procs:
        p.join(timeout=10)
    errors = [g[3] for g in got if g[3] is not None]
    if errors:
        raise RuntimeError("; ".join(errors))
    if any(g[2] for g in got) or not all(g[1] > 0 for g in got):
        return False
    return _serves_after(path, pool)


def _closed_port() -> int:
    """A local port nothing listens on (bound, then let go)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def remote_unreachable(path: Path, user: Path, rng: random.Random) -> bool:
    """Issue 25, item 5: a remote tier whose server cannot be reached. The store opens,
    ``stats()["remote"]["state"]`` names the endpoint and the failure, every prompt is
    stored and served exactly from the local disk, and its upload is dropped at once
    (before, each cost ``remote_retry_s`` of retries)."""
    endpoint = f"http://127.0.0.1:{_closed_port()}"
    cfg = dataclasses.replace(
        CFG, remote="s3://kvbucket/team", remote_retry_s=30.0,
        remote_options={"key": "k", "secret": "s", "client_kwargs": {"endpoint_url": endpoint}},
    )
    docs = [tokens(rng.randrange(10**6), rng.choice([24, 48, 80])) for _ in range(rng.choice([1, 2, 3]))]
    t0 = time.monotonic()
    with ImpressStore(path, MODEL, cfg) as store:
        for d in docs:
            generate(MODEL, d, store)
            store.flush()
            if not torch.equal(generate(MODEL, d, store), generate(MODEL, d)):
                return False
        state, dropped = store.stats()["remote"]["state"], store.stats()["remote"]["uploads_dropped"]
        matched = store.match(docs[-1].tolist()).length
    told = "cannot be reached" in state and endpoint in state
    return told and dropped == len(docs) and matched > 0 and time.monotonic() - t0 < 20


def small_budget(path: Path, user: Path, rng: random.Random) -> bool:
    """Issue 25, item 6: a disk budget below one prompt keeps at most the prompt just
    written (none when it extends a prefix stored in an older file: here a shared
    system prompt, half the tries), its files gone when the write returns; what is kept
    is served exactly, and a fresh open serves exactly."""
    system = tokens(rng.randrange(10**6), 16) if rng.random() < 0.5 else None
    docs = [tokens(rng.randrange(10**6), rng.choice([24, 40, 64])) for _ in range(rng.choice([2, 3, 4]))]
    if system is not None:
        docs = [torch.cat([system, d]) for d in docs]
    cfg = dataclasses.replace(CFG, disk_bytes=rng.choice([1, 4096, 20_000]))
    with ImpressStore(path, MODEL, cfg) as store:
        for d in docs:
            before = store.stats()["bytes_written"]
            generate(MODEL, d, store)
            store.flush()
            written = store.stats()["bytes_written"] - before
            kept = sum(n.terminal for n in store.tree.nodes())
            files = sum(1 for _ in (path / "chunks").iterdir())
            if kept > 1 or files > 1 or store._catalog.chunk_bytes > max(written, 0):
                return False
            if kept and store.match(d.tolist()).length < len(d) - 1:  # (the one kept is the one just written)
                return False
    return _serves_after(path, docs)


def _flip(f: Path, offsets: Any) -> None:
    raw = bytearray(f.read_bytes())
    for off in offsets:
        raw[int(off) + 1] ^= 0xFF
    f.write_bytes(bytes(raw))


def _logits(model, ids: torch.Tensor, store: ImpressStore | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    kw: dict[str, Any] = {"max_new_tokens": 4, "do_sample": False, "output_logits": True, "return_dict_in_generate": True}
    if store is not None:
        kw["past_key_values"] = ImpressCache(store)
    with torch.no_grad(), _quiet():
        out = model.generate(ids[None], **kw)
    return out.sequences, torch.stack(out.logits, 1)


def sparse_recovery(path: Path, user: Path, rng: random.Random) -> bool:
    """Issue 25, item 2: a sparse request (decode="full") meets a damaged probe piece,
    damaged or missing K/V blocks, or a block only its background read of the whole
    prefix reads; its tokens and logits equal the undamaged store's and plain generate's."""
    doc = tokens(rng.randrange(10**6), 96)
    ids = torch.cat([doc, tokens(rng.randrange(10**6), 10)])
    generate(MODEL, doc, None)
    with ImpressStore(path, MODEL, CFG) as store:
        generate(MODEL, doc, store)
        store.flush()
        offsets, _ = store.index.block_table(store.match(doc.tolist()).segments[0].file_id)
    sparse = ImpressConfig(
        chunk_tokens=16, important_ratio=0.25, decode="full", reorg_idle_ms=None, device_bytes=0, host_bytes=0
    )
    clean = path.with_name("clean")
    shutil.copytree(path, clean)
    with ImpressStore(clean, MODEL, sparse) as store:
        ref_seq, ref_logits = _logits(MODEL, ids, store)
    (f,) = (path / "chunks").iterdir()
    layer = rng.randrange(offsets.shape[1])
    how = rng.choice(["probe", "kv", "truncate", "one_kv"])
    if how == "probe":
        _flip(f, [offsets[PROBE, layer, rng.randrange(offsets.shape[2])]])
    elif how == "kv":
        _flip(f, offsets[KV, layer])
    elif how == "truncate":
        os.truncate(f, int(offsets[PROBE, -1, rng.randrange(offsets.shape[2])]))
    else:  # any one K/V block: read during the prefill or only by the background read
        _flip(f, [offsets[KV, layer, rng.randrange(offsets.shape[2])]])
    with ImpressStore(path, MODEL, sparse) as store:
        seq, logits = _logits(MODEL, ids, store)
    plain_seq, plain_logits = _logits(MODEL, ids)
    return (
        torch.equal(seq, ref_seq) and torch.equal(seq, plain_seq)
        and (logits - ref_logits).abs().max().item() <= 1e-4 and (logits - plain_logits).abs().max().item() <= 1e-4
    )


def metadata_damage(path: Path, user: Path, rng: random.Random) -> bool:
    """Issue 25, items 3 and 4: a block table or permutation one entry short (the file is
    quarantined, the answer exact), a damaged model record (index damage with the repair
    command, never "another model"; repaired, then exact) or no file descriptors left
    (the read recomputes, nothing is removed)."""
    docs = _two_prompts(path, rng.randrange(10**6))
    how = rng.choice(["offsets", "checksums", "model", "descriptors"])
    conn = sqlite3.connect(path / "index.sqlite")
    if how in ("offsets", "checksums"):
        conn.execute(f"UPDATE files SET {how} = substr({how}, 9) WHERE id = (SELECT MAX(id) FROM files)")
    elif how == "model":
        (value,) = conn.execute("SELECT value FROM meta WHERE key = 'model'").fetchone()
        i = rng.randrange(len(value))
        damaged = value[:i] + ("7" if value[i] != "7" else "8") + value[i + 1 :]
        conn.execute("UPDATE meta SET value = ? WHERE key = 'model'", (damaged,))
    conn.commit()
    conn.close()
    if how == "model":
        try:
            ImpressStore(path, MODEL, CFG).close()
            return False  # the damage went unnoticed
        except ModelMismatchError:
            return False  # reported as another model
        except StoreFormatError as exc:
            if "verify --repair" not in str(exc):
                return False
        with _quiet(), contextlib.redirect_stderr(open(os.devnull, "w")):
            repair_store(path)
    elif how == "descriptors":
        names = sorted(os.listdir(path / "chunks"))
        with ImpressStore(path, MODEL, CFG) as store:
            store.flush()  # (the crash-leftover scan has run)
            m = store.match(docs[0].tolist())
            soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
            filler: list[int] = []
            gc.collect()  # (no descriptor is freed by a collection meanwhile)
            gc.disable()
            resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 8, hard))
            try:
                with contextlib.suppress(OSError):
                    while True:
                        filler.append(os.open(os.devnull, os.O_RDONLY))
                try:
                    store.load(m.segments)
                    return False  # (no descriptor was left: the read cannot have opened the file)
                except StoreIOError as exc:
                    if isinstance(exc, CorruptBlockError):
                        return False
            finally:
                for fd in filler:
                    os.close(fd)
                resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
                gc.enable()
            if store.stats()["quarantined_files"]:
                return False
        if sorted(os.listdir(path / "chunks")) != names:
            return False
    elif how in ("offsets", "checksums"):  # the file is quarantined (once), the answers exact
        with ImpressStore(path, MODEL, CFG) as store:
            exact = all(torch.equal(generate(MODEL, d, store), generate(MODEL, d)) for d in docs)
            return exact and store.stats()["quarantined_files"] == 1
    return _serve_exact(path, docs)


CATEGORIES: dict[str, tuple[Callable[[Path, Path, random.Random], bool], int, int]] = {
    # name: (try, quick tries, full tries)
    "split_race": (split_race, 5, 50),
    "file_id_reuse": (file_id_reuse, 5, 50),
    "failed_commit": (failed_commit, 5, 30),
    "create_race": (create_race, 2, 10),
    "index_damage": (index_damage, 20, 300),
    "chunk_damage": (chunk_damage, 16, 200),
    "other_model": (other_model, 2, 10),
    "outside_store": (outside, 12, 60),
    "write_failure": (write_failure, 2, 10),
    "read_only": (read_only, 1, 5),
    "hooks_threads": (hooks_threads, 2, 20),
    "kill_9": (kill9, 1, 5),
    "repair": (repair, 3, 20),
    "budget_race": (budget_race, 2, 10),
    "budget_processes": (budget_processes, 1, 3),
    "sparse_recovery": (sparse_recovery, 8, 40),
    "metadata_damage": (metadata_damage, 8, 40),
    "remote_unreachable": (remote_unreachable, 1, 5),
    "small_budget": (small_budget, 3, 20),
}

MODEL_FACTORY = tiny
MODEL: Any = None
OTHER: Any = None


def main(argv: list[str] | None = None) -> int:
    global MODEL, OTHER
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--quick", action="store_true", help="a few tries per category (CI-sized)")
    p.add_argument("--only", nargs="*", default=None, help="categories to run")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    logging.disable(logging.CRITICAL)  # quarantines and refused writes log warnings by design
    torch.set_num_threads(1)
    resource.setrlimit(resource.RLIMIT_NOFILE, (4096, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    MODEL, OTHER = tiny(0), tiny(1)
    rng = random.Random(args.seed)
    tally = Tally()
    t0 = time.time()
    # a try that hung may leave a store's threads writing into its directory while the
    # folder is removed: the cleanup must not lose the run's result
    with tempfile.TemporaryDirectory(prefix="faults-", ignore_cleanup_errors=True) as work:
        for name, (fn, quick, full) in CATEGORIES.items():
            if args.only and name not in args.only:
                continue
            t = time.time()
            for _ in range(quick if args.quick else full):
                attempt(tally, name, Path(work), lambda s, u: fn(s, u, rng))
            print(f"{name:14s} {tally.rows[name]}  {time.time() - t:.0f} s", flush=True)
    totals = {k: sum(r[k] for r in tally.rows.values()) for k in ("tries", "exact", "clear_errors", "wrong", "raw", "hangs", "outside")}
    result = {
        "command": " ".join(["python", "benchmarks/faults.py", *(argv if argv is not None else sys.argv[1:])]),
        "machine": f"{platform.node()} {platform.machine()}, {os.cpu_count()} cores, shared with other jobs",
        "root": os.geteuid() == 0,
        "seconds": round(time.time() - t0, 1),
        "categories": tally.rows,
        "totals": totals,
        "failures": tally.examples,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(json.dumps(totals))
    return 0 if totals["wrong"] == totals["raw"] == totals["hangs"] == totals["outside"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
