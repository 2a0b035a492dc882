"""Where a write at the disk budget spends more than one below it, on a store kept by
`scale.py` (``--keep DIR``): CPU time per write by part, and pages the index's WAL gets
per write by table.

    python benchmarks/scale.py --sizes 50000 --keep DIR --writes 16 --windows 1 --requests 2
    python benchmarks/budget_costs.py DIR --out results/budget-costs.json

Writes run on the calling thread (`PromptWriter.write`, the removals and the check after
it included; no requests meanwhile), in windows of ``--writes`` below and at the budget,
in pairs of one of each, their order alternating (at, below, below, at, at, ...), after one
unmeasured window at the budget (the
eviction heap's start); each window ends by waiting for the evicted files' deletion.
CPU per write is the calling thread's and the deleting thread's (``/proc``). Parts are
timed with the thread's CPU clock around the store's own methods (they nest: the
write's transaction includes the removals and the forgetting); the WAL is
checkpointed empty before each window and its frames after it are mapped to their tables
through the ``dbstat`` table (a window in which SQLite checkpointed is left out of the
page counts). The store grows by the windows' prompts; the
prompts written are recorded in ``DIR/written.json`` as `scale.py` does.
"""

from __future__ import annotations

import argparse
import collections
import json
import struct
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import scale  # noqa: E402

from impress_cache import ImpressConfig, ImpressStore  # noqa: E402
from impress_cache.index.radix import as_tokens  # noqa: E402
from impress_cache.index.sqlite import Index  # noqa: E402
from impress_cache.store import catalog as catalog_mod  # noqa: E402
from impress_cache.store import changes as changes_mod  # noqa: E402
from impress_cache.store import gc as gc_mod  # noqa: E402
from impress_cache.store import values as values_mod  # noqa: E402
from impress_cache.store.gc import wal_bound  # noqa: E402

#: (class, method, name) timed with the thread's CPU clock
PARTS = [
    (gc_mod.StoreGC, "evict_within", "removals in the write's transaction"),
    (values_mod.NodeValues, "pop", "  heap pops"),
    (changes_mod.TreeChanges, "remove_leaf", "  leaf removals (statement)"),
    (changes_mod.TreeChanges, "drop_file_if_unreferenced", "  file removals (statement)"),
    (gc_mod.Removal, "settle", "after the commit: the tree, the file table, forgetting the removed (tiers, statistics)"),
    (gc_mod.StoreGC, "enforce", "the check after the write"),
    (catalog_mod.Catalog, "commit_prompt", "the write's index transaction and tree update (the removals and the forgetting included)"),
]


def _timed(acc: dict, mode: list[str]) -> None:
    for cls, method, name in PARTS:
        fn = getattr(cls, method)

        def wrapper(*a: Any, _fn=fn, _name=name, **k: Any) -> Any:
            t0 = time.thread_time()
            try:
                return _fn(*a, **k)
            finally:
                acc[(mode[0], _name)] += time.thread_time() - t0

        setattr(cls, method, wrapper)


#: the part the thread that deletes evicted files takes
UNLINK = "deleting the removed files (their own thread)"


def _unlink_cpu(store: ImpressStore) -> float:
    """CPU seconds of the thread that deletes evicted files so far (0 before it starts)."""
    tid = scale.unlink_thread_id(store)
    return scale._thread_cpu_s(tid) if tid is not None else 0.0


def _wal_pages(index: Index) -> collections.Counter:
    """Frames in the WAL by the table or index each page belongs to."""
    data = Path(f"{index.path}-wal").read_bytes()
    page_size = struct.unpack(">I", data[8:12])[0]
    pages, off = [], 32
    while off + 24 + page_size <= len(data):
        pages.append(struct.unpack(">I", data[off : off + 4])[0])
        off += 24 + page_size
    owner = dict(index._conn.execute("SELECT pageno, name FROM dbstat").fetchall())
    return collections.Counter(owner.get(p, "(free list)") for p in pages)


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(1)
    root: Path = args.dir
    written = json.loads((root / "written.json").read_text())["written"]
    model, prompts = scale.tiny_llama(), scale.Prompts()
    acc: dict = collections.defaultdict(float)
    mode = ["warm"]
    _timed(acc, mode)
    store = ImpressStore(root / "store", model, ImpressConfig(reorg_idle_ms=None, fsync=True))
    out: dict[str, Any] = {"writes_per_window": args.writes, "windows": args.windows}
    try:
        store.flush()
        index, writer, kv = store.index, store._writer, {}
        total = collections.defaultdict(float)
        pages: dict[str, collections.Counter] = {"below": collections.Counter(), "at": collections.Counter()}
        evicted = {"below": 0, "at": 0}
        counted = {"below": 0, "at": 0}  # writes whose WAL pages were counted
        for w in range(2 * args.windows + 1):
            pair, second = divmod(w - 1, 2)  # (every pair has one window of each kind)
            mode[0] = "warm" if w == 0 else (("at", "below") if pair % 2 == 0 else ("below", "at"))[second]
            at = mode[0] != "below"
            index.checkpoint()  # (an empty WAL: a window's frames are its writes')
            store._catalog.remeasure()  # (the checkpoint grew the index file)
            store.config.disk_bytes = store._gc._used(wal_bound(store.disk_bytes())) if at else None
            before, sizes = store.stats()["prefixes_evicted"], [0]
            unlinker = store._leases.unlinker
            unlink0 = _unlink_cpu(store)
            for j in range(args.writes):
                toks = as_tokens(prompts(written + j)).copy()
                ks, vs = scale._kv(len(toks), kv)
                c0 = time.thread_time()
                writer.write(toks, ks, vs)
                total[mode[0]] += time.thread_time() - c0
                sizes.append(index.wal_bytes())
            unlinker.drain()  # (the window's evicted files deleted: their CPU counted)
            unlink_cpu = _unlink_cpu(store) - unlink0
            total[mode[0]] += unlink_cpu
            acc[(mode[0], UNLINK)] += unlink_cpu
            written += args.writes
            if mode[0] != "warm":
                if all(a <= b for a, b in zip(sizes, sizes[1:])):  # no checkpoint restarted the WAL
                    pages[mode[0]] += _wal_pages(index)
                    counted[mode[0]] += args.writes
                evicted[mode[0]] += store.stats()["prefixes_evicted"] - before
        store.config.disk_bytes = None
        n = args.writes * args.windows
        for m in ("below", "at"):
            out[m] = {
                "cpu_ms_per_write": 1e3 * total[m] / n,
                "parts_cpu_ms_per_write": {name: 1e3 * acc[(m, name)] / n for name in [*(p[2] for p in PARTS), UNLINK]},
                "wal_pages_per_write": sum(pages[m].values()) / max(1, counted[m]),
                "wal_pages_by_table": {k: v / max(1, counted[m]) for k, v in pages[m].most_common()},
                "wal_pages_counted_writes": counted[m],
                "removed_leaves_per_write": evicted[m] / n,
            }
    finally:
        store.close()
        (root / "written.json").write_text(json.dumps({"written": written}))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dir", type=Path, help="the --keep directory of a scale.py run")
    ap.add_argument("--writes", type=int, default=30,
                    help="writes per window (default 30: few enough that SQLite does not checkpoint within one)")
    ap.add_argument("--windows", type=int, default=8, help="windows of each kind (default 8)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    text = json.dumps(run(args), indent=2)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
