"""The dense loader alone: what reading a whole prefix costs, without the model's forward.

    python benchmarks/exact_read.py --lengths 4096 8000 --repeats 8 --out results/exact-read.json
    python benchmarks/exact_read.py --lengths 8000 --repeats 30 --ways pool --pause 5 --out /tmp/x.json &
    perf record -F 1999 -g -a -o perf.pool -- sleep 10     # once the pid is printed: a profile of the runs

SmolLM2-135M's shapes (30 layers, 3 KV heads, head_dim 64, float32, 16-token blocks),
random K/V stored once (``store.put``), memory tiers off. Each run builds a
`DenseLoader` for the whole prefix (as exact reuse does) and takes every layer's buffer
in order, guest-cold (``--warm``: from the page cache; ``O_DIRECT`` reads the device
even then). Three ways, alternating within one process: ``direct`` (rows read from
disk straight into the layer's buffer, `store/direct.py`, with ``O_DIRECT`` where the
file system allows it), ``buffered`` (the same through the page cache: the store's
``direct_io`` off) and ``pool`` (the store's ``start_rows`` switched off: blocks read
into a pool, then gathered into the buffer on the loader thread). Reported per way:
median wall seconds and median process CPU seconds (every thread; the CPU the reads
take from a prefill running beside them). The layer buffers are kept until the run
ends, as a cache keeps them.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from impress_cache import ImpressConfig, ImpressStore
from impress_cache.hf.loaders import DenseLoader
from impress_cache.stats import RequestStats
from impress_cache.tools import drop_page_cache, load_smollm2


def run_length(model, n: int, args: argparse.Namespace, work: Path) -> dict:  # type: ignore[no-untyped-def]
    path = work / f"store-{n}"
    cfg = ImpressConfig(important_ratio=1.0, device_bytes=0, host_bytes=0)
    out: dict = {"prefix_tokens": n}
    with ImpressStore(path, model, cfg) as store:
        spec = store.spec
        g = torch.Generator().manual_seed(n)
        toks = torch.randint(3, 40000, (n + 1,), generator=g).tolist()
        ks = [torch.randn(spec.num_kv_heads, n + 1, spec.head_dim, generator=g) for _ in range(spec.num_layers)]
        vs = [torch.randn(spec.num_kv_heads, n + 1, spec.head_dim, generator=g) for _ in range(spec.num_layers)]
        store.put(toks, ks, vs)
        lay = store.layout(store.match(toks[:n]).segments)
        direct = store.start_rows
        no_rows = lambda *a, **k: None  # noqa: E731
        ways = {w: f for w, f in (("direct", direct), ("buffered", direct), ("pool", no_rows)) if w in args.ways}
        if args.pause:  # time to attach a profiler: perf record -g -a -p PID
            print(f"pid {os.getpid()}: runs start in {args.pause} s", flush=True)
            time.sleep(args.pause)
        runs: dict[str, list[tuple[float, float]]] = {w: [] for w in ways}
        for _ in range(args.repeats):
            for way, start_rows in ways.items():
                store.start_rows = start_rows  # type: ignore[method-assign]
                store._io.direct_io = way == "direct"  # (the config's `direct_io`, switched per run)
                if not args.warm:
                    drop_page_cache(path)
                c0, t0 = time.process_time(), time.perf_counter()
                loader = DenseLoader(store, [lay], [0], n, 20, RequestStats())
                bufs = [loader.layer(layer) for layer in range(spec.num_layers)]
                runs[way].append((time.perf_counter() - t0, time.process_time() - c0))
                for i in range(0, spec.num_layers, 7):  # what was read is what was stored
                    assert torch.equal(bufs[i][0, 0, :, :n], ks[i][:, :n]) and torch.equal(bufs[i][1, 0, :, :n], vs[i][:, :n])
                del bufs
        store.start_rows = direct  # type: ignore[method-assign]
        st = store.stats()
        out["runs"] = {k: st[k] for k in ("runs_direct_io", "runs_buffered", "runs_direct_io_refused")}
    for way, rows in runs.items():
        out[way] = {
            "wall_s": statistics.median(r[0] for r in rows),
            "cpu_s": statistics.median(r[1] for r in rows),
            "wall_runs_s": [round(r[0], 4) for r in rows],
            "cpu_runs_s": [round(r[1], 4) for r in rows],
        }
        print(f"  {n:6d} {way:7s} wall {out[way]['wall_s']:.3f} s  cpu {out[way]['cpu_s']:.3f} s", flush=True)
    for a, b in (("direct", "pool"), ("direct", "buffered"), ("buffered", "pool")):
        if a in runs and b in runs:
            out[f"{a}_vs_{b}_wall"] = out[a]["wall_s"] / out[b]["wall_s"]
            out[f"{a}_vs_{b}_cpu"] = out[a]["cpu_s"] / out[b]["cpu_s"]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", type=int, nargs="+", default=[4096, 8000])
    p.add_argument("--repeats", type=int, default=8)
    p.add_argument("--warm", action="store_true", help="read from the page cache (default: guest-cold)")
    p.add_argument("--ways", nargs="+", choices=["direct", "buffered", "pool"], default=["direct", "buffered", "pool"])
    p.add_argument("--pause", type=float, default=0.0, help="print the pid and wait this long before the runs")
    p.add_argument("--out", default="results/exact-read.json")
    args = p.parse_args(argv)
    torch.set_num_threads(2)
    model, _ = load_smollm2()
    work = Path(tempfile.mkdtemp(prefix="exact-read-"))
    load_at_start = os.getloadavg()
    try:
        lengths = [run_length(model, n, args, work) for n in args.lengths]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result = {
        "command": " ".join(sys.argv),
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "warm": args.warm,
        "load_average_at_start": load_at_start,
        "load_average_at_end": os.getloadavg(),
        "lengths": lengths,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
