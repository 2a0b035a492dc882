"""A full store stays fast: writes, eviction and requests at the disk budget, and what a
large store costs to open and to hold in memory.

    python benchmarks/scale.py --out results/scale.json --plot docs/img/scale.png  # 4-15 min
    python benchmarks/scale.py --quick --out /tmp/scale-quick.json                 # ~1 min

One store grows through ``--sizes`` prompts (default 1,000, 10,000 and 50,000; quick:
300, 1,000 and 3,000). Every prompt is one of 50 system prompts (120 tokens) followed by
a distinct user part (64-100 tokens), so the system prompts are stored once and every
prompt adds one chunk file of its user part. The model is a tiny random Llama (2 layers,
2 KV heads of 16, 1 torch thread); this benchmark is about the store's metadata, not
about attention. K/V written by the growth phase are random tensors of the right shape
(what a request reads back is checked against its checksums, its values do not matter).

At each size:

* **below and at the budget**: ``--writes`` writes (default 400) of ``put_async`` in the
  background while requests run on the main thread, in ``--windows`` pairs of windows
  (default 8: 50 writes each, flushed at the end) that alternate below, at, at, below,
  below, at, ...: a below-budget window lifts ``disk_bytes``; an at-budget window sets
  it to what the store counts at its start (its bytes on disk with the WAL's room,
  `StoreGC._used`; a WAL the window before left past the WAL's room is checkpointed
  first, as a store living at its budget would have done), so every write in it removes
  about one stored prompt. Reported per
  phase: the median window's write rate (prompts/s until flushed) and every window's,
  ImpressCache construction p50/p99 and ``generate`` (4 new tokens) p50 of requests that
  reuse a stored prompt and add 8 tokens; at the budget also eviction seconds per write
  (mean and p99): the removals inside the write's own index transaction
  (`StoreGC.evict_within`; their commit is the write's) plus
  `ImpressStore.enforce_disk_budget` after it. ``throughput_ratio`` is the median over
  the pairs of at / below (interleaving puts a slow spell of the shared disk or CPU on
  both phases; a window's rate varies by +-30% on a busy machine), and
  ``throughput_ratio_total`` all writes at the budget over their time against all below;
  ``cpu_ratio`` is the CPU time per write below over at of the writer thread (the
  writes, the removals in their transactions, the statistics saves it runs between
  them) and of the thread that deletes evicted files (``/proc/self/task/*/schedstat``):
  what a write at the budget costs more, without the other jobs of a shared machine.
  Then the budget is
  lifted and the store grows on;
* **open**: in a fresh process, `ImpressStore(path, None)` seconds (``open_s``: until
  the constructor returns; ``ready_s``: until the work it leaves to the writer thread,
  the node statistics and the crash-leftover scan, is done, `flush`) and the growth of
  its resident set (VmRSS, measured after that work) per stored token (distinct tokens
  in the index), without memory tiers (the run with the best ``open_s``, and the median
  of the three: ``rss_bytes_per_token_median``; ``rss_parts``: the bytes of the token
  buffer, the file table's other columns and the saved node statistics, read after the
  measurement); and the RSS with the default tiers, which also
  hold the saved block statistics of the requests that ran (how many depends on how
  long the phases took);
* **match**: `ImpressStore.match` of stored prompts plus 8 new tokens, p50/p99;
* **footprint**: `store.disk_bytes()` (what the budget counts) and ``du`` of the store
  over the raw K/V bytes of the stored tokens.

With ``--writer-processes K``, each size also gets ``other_writers``: ImpressCache
construction p50/p99 of ``--requests`` requests (stored prompts + 8 new tokens, no
``generate``) alone, then again while K other processes commit new prompts to the same
store (each opens it without a model and ``put``s prompts of its own one after another);
``construct_p99_ratio`` is p99 with the writers / p99 alone (each of this process's
matches then sees other processes' commits). ``--skip-phases`` leaves out the budget
phases and the open measurement (the growth and ``other_writers`` only):

    python benchmarks/scale.py --sizes 10000 --writer-processes 3 --skip-phases --out /tmp/w.json

The machine is shared with other jobs: timings are noisy; the ratios compare runs of the
same process at the same size. ``--keep DIR`` keeps the built store (``DIR/store``);
``--keep DIR --reuse --sizes N`` measures that store again without growing it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))
from disk_usage import du  # noqa: E402

from impress_cache import ImpressCache, ImpressConfig, ImpressStore  # noqa: E402
from impress_cache.hf.compat import CACHE_KWARG  # noqa: E402
from impress_cache.store.gc import wal_bound  # noqa: E402

VOCAB = 4096
SYSTEMS, SYSTEM_LEN, USER_LEN = 50, 120, (64, 100)
WINDOW = 200


def tiny_llama() -> torch.nn.Module:
    cfg = LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=1024, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).eval()


class Prompts:
    """Prompt ``i``: system prompt ``i % 50`` and a user part drawn from seed ``i``."""

    def __init__(self) -> None:
        rng = np.random.default_rng(12345)
        self.systems = [rng.integers(3, VOCAB, SYSTEM_LEN).tolist() for _ in range(SYSTEMS)]

    def __call__(self, i: int) -> list[int]:
        rng = np.random.default_rng(1_000_003 + i)
        return self.systems[i % SYSTEMS] + rng.integers(3, VOCAB, int(rng.integers(*USER_LEN))).tolist()


def _kv(n: int, cache: dict[int, tuple[list, list]]) -> tuple[list, list]:
    if n not in cache:
        g = torch.Generator().manual_seed(n)
        cache[n] = (
            [torch.randn(2, n, 16, generator=g, dtype=torch.float32) for _ in range(2)],
            [torch.randn(2, n, 16, generator=g, dtype=torch.float32) for _ in range(2)],
        )
    return cache[n]


class Writer(threading.Thread):
    """Writes prompts ``start .. stop`` in windows of `WINDOW` (each window flushed)."""

    def __init__(self, store: ImpressStore, prompts: Prompts, start: int, stop: int) -> None:
        super().__init__(daemon=True)
        self.store, self.prompts, self.range = store, prompts, (start, stop)
        self.kv: dict[int, tuple[list, list]] = {}
        self.seconds = 0.0
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            t0 = time.perf_counter()
            lo, hi = self.range
            for w in range(lo, hi, WINDOW):
                for i in range(w, min(hi, w + WINDOW)):
                    toks = self.prompts(i)
                    ks, vs = _kv(len(toks), self.kv)
                    self.store.put_async(toks, ks, vs)
                self.store.flush()
            self.seconds = time.perf_counter() - t0
        except BaseException as exc:  # reported by the caller
            self.error = exc

    @property
    def prompts_per_s(self) -> float:
        return (self.range[1] - self.range[0]) / self.seconds if self.seconds else 0.0


def _pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs), q)) if xs else float("nan")


def requests(model, store: ImpressStore, prompts: Prompts, stored: int, writer: Writer | None, n: int) -> dict:
    """Requests on stored prompts + 8 new tokens until ``writer`` is done (at least ``n``)."""
    rng = np.random.default_rng(stored)
    build, gen = [], []
    while len(build) < n or (writer is not None and writer.is_alive()):
        i = int(rng.integers(0, stored))
        ids = torch.tensor([prompts(i) + rng.integers(3, VOCAB, 8).tolist()])
        mask = torch.ones_like(ids)
        t0 = time.perf_counter()
        cache = ImpressCache(store, ids, attention_mask=mask, store_prompt=False)
        t1 = time.perf_counter()
        model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, **{CACHE_KWARG: cache})
        t2 = time.perf_counter()
        build.append(t1 - t0)
        gen.append(t2 - t1)
        if len(build) > 50 * n:
            break
    return {
        "requests": len(build),
        "construct_ms_p50": 1e3 * _pct(build, 50), "construct_ms_p99": 1e3 * _pct(build, 99),
        "generate_ms_p50": 1e3 * _pct(gen, 50), "raw": {"build": build, "gen": gen},
    }


def window(model, store: ImpressStore, prompts: Prompts, start: int, count: int, stored: int, n_req: int) -> dict:
    """``count`` writes in the background while requests run; returns both sides (the
    requests' and evictions' single times under ``"raw"``)."""
    evictions: list[float] = []
    enforce, evictor = store._gc.enforce, store._catalog.evictor
    within = [0.0]  # seconds of the removals inside the current write's transaction

    def timed_within(*args):
        t0 = time.perf_counter()
        out = evictor(*args)
        within[0] += time.perf_counter() - t0
        return out

    def timed(budget, protect=(), **kw):
        t0 = time.perf_counter()
        out = enforce(budget, protect, **kw)
        evictions.append(within[0] + time.perf_counter() - t0)
        within[0] = 0.0
        return out

    store._gc.enforce, store._catalog.evictor = timed, timed_within
    before = store.stats()["prefixes_evicted"]
    cpu0 = store_cpu_s(store)
    writer = Writer(store, prompts, start, start + count)
    writer.start()
    req = requests(model, store, prompts, stored, writer, n_req)
    writer.join()
    cpu = {k: v - cpu0.get(k, 0.0) for k, v in store_cpu_s(store).items()}  # (a thread started meanwhile: from 0)
    store._gc.enforce, store._catalog.evictor = enforce, evictor
    if writer.error is not None:
        raise writer.error
    return {
        "writes": count, "write_prompts_per_s": writer.prompts_per_s, "cpu_s": sum(cpu.values()), **req,
        "evicted_prefixes": store.stats()["prefixes_evicted"] - before, "raw": {**req.pop("raw"), "evict": evictions},
    }


def _thread_cpu_s(native_id: int) -> float:
    """CPU seconds a thread of this process has run (``/proc``; 0 where there is none)."""
    try:
        with open(f"/proc/self/task/{native_id}/schedstat") as f:
            return int(f.read().split()[0]) / 1e9
    except (OSError, ValueError, IndexError):
        return 0.0


def store_cpu_s(store: ImpressStore) -> dict[int, float]:
    """CPU seconds so far of the threads that write and evict, by thread id: the writer
    thread (each write and the removals in its transaction, and the statistics saves it
    runs between writes) and the thread that deletes evicted files. What the writes cost
    in CPU, whatever else the shared machine runs meanwhile."""
    ids = [store._writer._pool.submit(threading.get_native_id).result()]
    unlinker = unlink_thread_id(store)
    if unlinker is not None:
        ids.append(unlinker)
    return {i: _thread_cpu_s(i) for i in ids}


def unlink_thread_id(store: ImpressStore) -> int | None:
    """The native id of the thread that deletes evicted files (``None`` before it starts)."""
    thread = store._leases.unlinker._thread
    return thread.native_id if thread is not None and thread.native_id else None


def _summary(windows: list[dict]) -> dict:
    """One phase from its windows: the median window's write rate, request and eviction
    percentiles over every request and write of the phase."""
    build = [x for w in windows for x in w["raw"]["build"]]
    gen = [x for w in windows for x in w["raw"]["gen"]]
    ev = [x for w in windows for x in w["raw"]["evict"]]
    return {
        "writes": sum(w["writes"] for w in windows),
        "write_prompts_per_s": statistics.median(w["write_prompts_per_s"] for w in windows),
        "write_prompts_per_s_windows": [w["write_prompts_per_s"] for w in windows],
        "cpu_ms_per_write": 1e3 * sum(w["cpu_s"] for w in windows) / sum(w["writes"] for w in windows),
        "cpu_ms_per_write_windows": [1e3 * w["cpu_s"] / w["writes"] for w in windows],
        "requests": len(build),
        "construct_ms_p50": 1e3 * _pct(build, 50), "construct_ms_p99": 1e3 * _pct(build, 99),
        "generate_ms_p50": 1e3 * _pct(gen, 50),
        "evicted_prefixes": sum(w["evicted_prefixes"] for w in windows),
        "eviction_ms_mean": 1e3 * statistics.fmean(ev) if ev else 0.0,
        "eviction_ms_p99": 1e3 * _pct(ev, 99) if ev else 0.0,
    }


def phases(model, store: ImpressStore, prompts: Prompts, start: int, args: argparse.Namespace) -> dict:
    """Writes below and at the budget in ``args.windows`` pairs of windows of
    ``args.writes // args.windows`` writes each, the two kinds interleaved (below, at,
    at, below, below, at, ...): both see the same machine, so a slow spell of the shared
    disk or CPU lands on both. Each at-budget window sets ``disk_bytes`` to what the
    store counts at its start (`StoreGC._used`: its bytes with the WAL's room), so every
    write in it removes about one stored prompt; below-budget windows lift the budget.
    Returns both phases (`_summary`) and the throughput ratio: the median over pairs of
    at / below."""
    per = max(1, args.writes // args.windows)
    n_req = max(1, args.requests // args.windows)
    runs: dict[str, list[dict]] = {"below": [], "at": []}
    written = start
    for pair in range(args.windows):
        for mode in ("below", "at") if pair % 2 == 0 else ("at", "below"):
            if mode == "at":
                room = wal_bound(store.disk_bytes())
                store._gc._trim_wal(room)  # the WAL a below window left past the room: not this window's
                store.config.disk_bytes = store._gc._used(room)
            else:
                store.config.disk_bytes = None
            runs[mode].append(window(model, store, prompts, written, per, written, n_req))
            written += per
    store.config.disk_bytes = None
    ratios = [a["write_prompts_per_s"] / b["write_prompts_per_s"] for a, b in zip(runs["at"], runs["below"])]

    def rate(side: list[dict]) -> float:  # all writes of a side over their time
        return sum(w["writes"] for w in side) / sum(w["writes"] / w["write_prompts_per_s"] for w in side)

    below, at = _summary(runs["below"]), _summary(runs["at"])
    below_cpu, at_cpu = below["cpu_ms_per_write"], at["cpu_ms_per_write"]
    return {
        "below": below, "at": at, "written": written,
        "throughput_ratio": statistics.median(ratios), "throughput_ratios": ratios,
        "throughput_ratio_total": rate(runs["at"]) / rate(runs["below"]),
        # CPU per write (writer and unlink threads) below over at: the writes' cost without
        # the noise of the shared machine's other jobs (which the wall-clock ratios carry)
        "cpu_ratio": below_cpu / at_cpu,
    }


_OPEN = r"""
import json, sys, time, gc
def rss():
    for line in open('/proc/self/status'):
        if line.startswith('VmRSS:'):
            return int(line.split()[1]) * 1024
from impress_cache import ImpressStore, ImpressConfig
import torch
torch.set_num_threads(1)
gc.collect(); r0 = rss(); t0 = time.perf_counter()
tiers = {} if sys.argv[2] == "tiers" else {"device_bytes": 0, "host_bytes": 0}
store = ImpressStore(sys.argv[1], None, ImpressConfig(reorg_idle_ms=None, **tiers))
t1 = time.perf_counter()
store.flush()  # the work open leaves to the writer thread (node statistics, crash-leftover scan)
t2 = time.perf_counter(); gc.collect(); r1 = rss()
tokens = sum(r.n_tokens for r in store._catalog.records.values())
out = {"open_s": t1 - t0, "ready_s": t2 - t0, "rss_bytes": r1 - r0, "stored_tokens": tokens, "nodes": len(store.tree),
       "files": len(store._catalog.records)}
# (after the measurement) what the largest arrays hold, in bytes; the rest of the RSS is
# the tree's node objects, the interpreter's and the C heap's slack and code pages
files, saved = store._catalog.records, store._values._saved
out["rss_parts"] = {
    "token_buffer": files.tokens.nbytes,
    "file_columns": sum(a.nbytes for a in [*vars(files).values(), *files._ints.values()]
                        if hasattr(a, "nbytes") and a is not files.tokens),
    "node_statistics": saved.nbytes + store._values._saved_ids.nbytes + store._values._waiting.nbytes,
}
store.close()
print(json.dumps(out))
"""


def open_once(path: Path, mode: str = "bare", src: Path | None = None) -> dict:
    """`_OPEN` of the store at ``path`` in a fresh process (``mode``: ``bare``, no memory
    tiers, or ``tiers``), with the package from ``src`` (default: this checkout's)."""
    src = src if src is not None else Path(__file__).resolve().parents[1] / "src"
    env = {**os.environ, "PYTHONPATH": str(src)}
    out = subprocess.run([sys.executable, "-c", _OPEN, str(path), mode], capture_output=True, text=True, env=env)
    if out.returncode != 0:
        raise RuntimeError(out.stderr)
    return json.loads(out.stdout.strip().splitlines()[-1])


def open_cost(path: Path) -> dict:
    """Open without memory tiers (``device_bytes=host_bytes=0``: the tree, the file table
    and the node statistics) and, for the RSS only, with the default tiers (which also
    load the saved block statistics of the requests that ran)."""
    runs: dict[str, list[dict]] = {"bare": [], "tiers": []}
    for _ in range(3):
        for mode in runs:
            runs[mode].append(open_once(path, mode))
    best = min(runs["bare"], key=lambda r: r["open_s"])
    best["open_s_median"] = statistics.median(r["open_s"] for r in runs["bare"])
    best["ready_s_median"] = statistics.median(r["ready_s"] for r in runs["bare"])
    best["rss_bytes_per_token"] = best["rss_bytes"] / max(1, best["stored_tokens"])
    best["rss_bytes_per_token_median"] = statistics.median(r["rss_bytes"] / max(1, r["stored_tokens"]) for r in runs["bare"])
    tiers = min(runs["tiers"], key=lambda r: r["rss_bytes"])
    best["rss_bytes_per_token_tiers"] = tiers["rss_bytes"] / max(1, tiers["stored_tokens"])
    return best


def match_latency(store: ImpressStore, prompts: Prompts, stored: int, n: int = 500) -> dict:
    rng = np.random.default_rng(7)
    xs, found = [], 0
    for _ in range(n):
        toks = np.asarray(prompts(int(rng.integers(0, stored))) + rng.integers(3, VOCAB, 8).tolist(), np.int32)
        t0 = time.perf_counter()
        m = store.match(toks)
        xs.append(time.perf_counter() - t0)
        found += m.length >= len(toks) - 8
    return {"match_us_p50": 1e6 * _pct(xs, 50), "match_us_p99": 1e6 * _pct(xs, 99), "match_found": found / n}


_OTHER_WRITER = r"""
import sys, time
from pathlib import Path
import numpy as np, torch
torch.set_num_threads(1)
sys.path.insert(0, sys.argv[4])
from scale import Prompts, _kv
from impress_cache import ImpressConfig, ImpressStore
path, first, stop = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3])
store = ImpressStore(path, None, ImpressConfig(reorg_idle_ms=None, device_bytes=0, host_bytes=0))
prompts, kv, i = Prompts(), {}, first
print("ready", flush=True)
while not stop.exists():
    toks = prompts(i)
    store.put(toks, *_kv(len(toks), kv))
    i += 1
store.close()
print(i - first, flush=True)
"""


def other_writers(model, store: ImpressStore, path: Path, prompts: Prompts, stored: int, k: int, n: int) -> dict:
    """ImpressCache construction p50/p99 of ``n`` requests alone, then while ``k`` other
    processes commit prompts to the same store (`_OTHER_WRITER`)."""

    def construct(seed: int) -> list[float]:
        rng = np.random.default_rng(seed)
        xs = []
        for _ in range(n):
            ids = torch.tensor([prompts(int(rng.integers(0, stored))) + rng.integers(3, VOCAB, 8).tolist()])
            t0 = time.perf_counter()
            ImpressCache(store, ids, attention_mask=torch.ones_like(ids), store_prompt=False)
            xs.append(time.perf_counter() - t0)
        return xs

    construct(1)  # warm
    alone = construct(2)
    stop = path.parent / "writers.stop"
    stop.unlink(missing_ok=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), str(Path(__file__).parent)) if p)}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _OTHER_WRITER, str(path), str(50_000_000 + 1_000_000 * j), str(stop), str(Path(__file__).parent)],
            stdout=subprocess.PIPE, text=True, env=env,
        )
        for j in range(k)
    ]
    try:
        for p in procs:
            assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        time.sleep(1.0)  # every writer committing
        before = store._catalog.refreshes
        t0 = time.perf_counter()
        loaded = construct(3)
        seconds = time.perf_counter() - t0
    finally:
        stop.touch()
        commits = [int((p.communicate(timeout=120)[0] or "0").split()[-1]) for p in procs]
        stop.unlink(missing_ok=True)
    stats = store.stats()
    return {
        "writer_processes": k, "requests": n, "writer_commits": commits, "seconds_with_writers": seconds,
        "construct_ms_p50_alone": 1e3 * _pct(alone, 50), "construct_ms_p99_alone": 1e3 * _pct(alone, 99),
        "construct_ms_p50": 1e3 * _pct(loaded, 50), "construct_ms_p99": 1e3 * _pct(loaded, 99),
        "construct_p99_ratio": _pct(loaded, 99) / _pct(alone, 99),
        "refreshes": store._catalog.refreshes - before,
        "log_applied": stats.get("log_applied"), "log_reloads": stats.get("log_reloads"),
        "loadavg": os.getloadavg(),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(1)
    model = tiny_llama()
    prompts = Prompts()
    root = Path(tempfile.mkdtemp(prefix="impress-scale-", dir=args.dir)) if args.keep is None else args.keep
    path = root / "store"
    reuse = path.exists() and args.reuse
    if path.exists() and not reuse:
        raise SystemExit(f"{path} exists: --keep needs a new directory (or --reuse)")
    if reuse and len(args.sizes) != 1:
        raise SystemExit("--reuse measures one size: give it as --sizes")
    # the request settings of results/scale.json (the library defaults of its day): sparse
    # prefill of 25% of the rows, the rest read after it, no re-computation of new tokens
    cfg = ImpressConfig(  # the store's (mutable) config
        reorg_idle_ms=None, fsync=not args.no_fsync, important_ratio=0.25, prefetch=True,
        refresh_new_tokens=False, guard_margin=0.0,
    )
    grow_cfg = ImpressConfig(reorg_idle_ms=None, fsync=not args.no_fsync)
    results: list[dict[str, Any]] = []
    # prompts 0 .. written - 1 went into the store (a reused one records how many)
    written = json.loads((root / "written.json").read_text())["written"] if reuse else 0
    try:
        store = ImpressStore(path, model, cfg)
        for size in args.sizes:
            t0 = time.perf_counter()
            store.config.fsync = False  # growth only: the measured phases below fsync
            grow = Writer(store, prompts, written, size if not reuse else written)
            grow.run()
            store.config.fsync = grow_cfg.fsync
            if grow.error is not None:
                raise grow.error
            written = size if not reuse else written
            print(f"[{size}] grown in {time.perf_counter() - t0:.1f} s ({grow.prompts_per_s:.0f} prompts/s)", flush=True)
            row: dict[str, Any] = {"prompts": size, "growth_prompts_per_s": grow.prompts_per_s}
            if not args.skip_phases:
                both = phases(model, store, prompts, written, args)
                written = both.pop("written")
                row.update(both)
            if args.writer_processes:
                row["other_writers"] = other_writers(
                    model, store, path, prompts, written, args.writer_processes, max(100, args.requests)
                )
                print(json.dumps(row["other_writers"], indent=1), flush=True)
                if args.skip_phases:
                    results.append(row)
                    continue
            if args.keep is not None:
                (root / "written.json").write_text(json.dumps({"written": written}))
            row["stored_prompts"] = sum(1 for n in store.tree.nodes() if not n.children)
            row.update(match_latency(store, prompts, written))
            row["disk_bytes"] = store.disk_bytes()
            store.close()
            row["du_bytes"] = du(path)
            row.update(open_cost(path))
            row["raw_kv_bytes"] = row["stored_tokens"] * store.spec.kv_bytes_per_token
            row["footprint_ratio"] = row["du_bytes"] / row["raw_kv_bytes"]
            b, a = row["below"], row["at"]
            row["construct_p99_ratio"] = a["construct_ms_p99"] / b["construct_ms_p99"]
            results.append(row)
            print(json.dumps(row, indent=1), flush=True)
            store = ImpressStore(path, model, cfg)
        store.close()
    finally:
        if args.keep is None:
            shutil.rmtree(root, ignore_errors=True)
    return {
        "benchmark": "scale",
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "loadavg_at_end": os.getloadavg()},
        "torch_threads": 1,
        "fsync": not args.no_fsync,
        "sizes": results,
    }


def plot(result: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["sizes"]
    x = [r["prompts"] for r in rows]
    fig, ax = plt.subplots(1, 4, figsize=(16, 3.6))
    ax[0].plot(x, [r["below"]["write_prompts_per_s"] for r in rows], "o-", label="below budget")
    ax[0].plot(x, [r["at"]["write_prompts_per_s"] for r in rows], "s-", label="at budget")
    ax[0].set_title("writes (prompts/s)")
    ax[1].plot(x, [r["at"]["eviction_ms_mean"] for r in rows], "o-", label="mean")
    ax[1].plot(x, [r["at"]["eviction_ms_p99"] for r in rows], "s-", label="p99")
    ax[1].set_title("eviction per write (ms)")
    ax[2].plot(x, [r["below"]["construct_ms_p99"] for r in rows], "o-", label="below budget")
    ax[2].plot(x, [r["at"]["construct_ms_p99"] for r in rows], "s-", label="at budget")
    ax[2].set_title("ImpressCache construction p99 (ms)")
    ax[3].plot(x, [r["open_s"] for r in rows], "o-", label="open (s)")
    ax3b = ax[3].twinx()
    ax3b.plot(x, [r["rss_bytes_per_token"] for r in rows], "s--", color="C1", label="RSS B/token")
    ax[3].set_title("open (s, o) and RSS per token (B, s)")
    for a in ax:
        a.set_xscale("log")
        a.set_xlabel("stored prompts")
    for a in ax[:3]:
        a.legend(fontsize=8)
        a.set_ylim(bottom=0)
    ax3b.set_ylim(bottom=0)
    ax[3].set_ylim(bottom=0)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="sizes 300, 1000, 3000; fewer writes and requests")
    ap.add_argument("--sizes", type=int, nargs="+", default=None)
    ap.add_argument("--writes", type=int, default=None, help="writes per phase (default 400, quick 100)")
    ap.add_argument("--windows", type=int, default=None,
                    help="pairs of below/at-budget windows the writes are split into (default 8, quick 4)")
    ap.add_argument("--requests", type=int, default=None, help="requests per phase at least (default 300, quick 30)")
    ap.add_argument("--no-fsync", action="store_true", help="ImpressConfig(fsync=False)")
    ap.add_argument("--dir", default=None, help="where the store is built (default: the temp directory)")
    ap.add_argument("--keep", type=Path, default=None,
                    help="build the store in KEEP/store and keep it (to profile the largest size afterwards)")
    ap.add_argument("--reuse", action="store_true",
                    help="with --keep: measure the store KEEP/store kept by an earlier run (one size, no growth)")
    ap.add_argument("--writer-processes", type=int, default=0,
                    help="K: also measure ImpressCache construction while K other processes commit (other_writers)")
    ap.add_argument("--skip-phases", action="store_true",
                    help="only the growth and, with --writer-processes, other_writers (no budget phases, no open)")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--plot", type=Path, default=None)
    args = ap.parse_args()
    args.sizes = args.sizes or ([300, 1000, 3000] if args.quick else [1000, 10000, 50000])
    args.writes = args.writes or (100 if args.quick else 400)
    args.windows = args.windows or (4 if args.quick else 8)
    args.requests = args.requests or (30 if args.quick else 300)
    result = run(args)
    text = json.dumps(result, indent=2)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    print(text)
    if args.plot:
        plot(result, args.plot)


if __name__ == "__main__":
    main()
