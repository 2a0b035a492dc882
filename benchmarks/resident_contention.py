"""Exact reuse of a prefix held in the memory tiers against transformers' in-memory reuse,
per torch thread count: where the time of a resident prefix goes (issue 26, "blocks in
memory").

Both alternatives run in one process on the same stored prefix (held in the memory tier,
as ttft.py's ``impress_1.0_memory``), alternating, ``--repeats`` times each, medians. With
``--profile`` the model thread's functions with the most own time are printed for each
(cProfile: the loader thread is not in it, only what it costs the model). ``stages``
times, in the main thread and outside any request, what each alternative does to have
every layer's prefix rows in a buffer of its own: the deep copy of the DynamicCache, the
per-block path (memory-tier lookups, one copy per block: `BlockIO.start_layout` and
`LayerView.gather_into`) and the slab path (`BlockIO.resident_rows`, one copy per
layer), medians of ``--repeats`` in milliseconds: the work that competes with the
prefill, apart from the contention.

    python benchmarks/resident_contention.py --length 4096 --threads 1 2 --out results/resident-contention.json
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import io
import json
import os
import platform
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fidelity import corpus_tokens  # noqa: E402
from ttft import MEMORY, QUESTION, TIERS_OFF  # noqa: E402

from impress_cache import ImpressCache, ImpressConfig, ImpressStore  # noqa: E402
from impress_cache.hf.compat import CACHE_KWARG  # noqa: E402
from impress_cache.hf.loaders import prefix_buffer  # noqa: E402
from impress_cache.storage.base import KV  # noqa: E402
from impress_cache.tools import load_smollm2  # noqa: E402


def _top(prof: cProfile.Profile, n: int = 8) -> list[str]:
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(n)
    return [line.strip() for line in out.getvalue().splitlines() if "{" in line or ".py:" in line][:n]


def _stages(store: ImpressStore, prefix: list[int], dyn: Any, repeats: int) -> dict[str, float]:
    """Milliseconds (medians) to get every layer's prefix rows into buffers of their own."""
    lay = store.layout(store.match(prefix).segments)
    layers, n = store.spec.num_layers, len(prefix)

    def per_block() -> None:
        for layer in range(layers):
            view = lay.at(layer)
            units = view.units_all()
            blocks = store.start_layout(lay, KV, [layer], units, place_hits=False).result()
            view.gather_into(units, blocks, prefix_buffer(store, 1, n, 1, False)[:, 0, :, :n])

    def slabs() -> None:
        for layer in range(layers):
            parts = store.resident_rows(lay, layer)
            assert parts is not None, "the prefix is not in slabs"
            buf, at = prefix_buffer(store, 1, n, 1, False), 0
            for part in parts:
                buf[:, 0, :, at : at + part.shape[2]].copy_(part)
                at += part.shape[2]

    fns = {"deep_copy": lambda: copy.deepcopy(dyn), "per_block": per_block, "slabs": slabs}
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(1000 * (time.perf_counter() - t0))
        store.tiers.settle()
    return {k: round(statistics.median(v), 2) for k, v in times.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args(argv)
    model, tok = load_smollm2()
    prefix = corpus_tokens(tok, "prose", args.length)
    ids = torch.tensor([prefix + tok(QUESTION)["input_ids"]])
    with torch.no_grad():
        dyn = model(torch.tensor([prefix]), use_cache=True).past_key_values

    def generate(cache: Any) -> None:
        with torch.no_grad():
            model.generate(ids, max_new_tokens=1, do_sample=False, **{CACHE_KWARG: cache})

    result: dict[str, Any] = {
        "command": " ".join(["python", "benchmarks/resident_contention.py", *(argv if argv is not None else sys.argv[1:])]),
        "machine": f"{platform.node()} {platform.machine()}, {os.cpu_count()} cores",
        "load_average_at_start": os.getloadavg(), "prefix_tokens": len(prefix), "runs": {},
    }
    with tempfile.TemporaryDirectory(prefix="resident-") as work:
        with ImpressStore(work, model, ImpressConfig(important_ratio=1.0, **TIERS_OFF)) as store, torch.no_grad():
            first = torch.tensor([prefix + ids[0, len(prefix) :][:1].tolist()])
            model(first, use_cache=True, **{CACHE_KWARG: ImpressCache(store, first)})
        with ImpressStore(work, model, ImpressConfig(important_ratio=1.0, **MEMORY)) as store:
            generate(ImpressCache(store, ids, store_prompt=False))  # into the memory tier

            def dynamic_memory() -> float:
                t0 = time.perf_counter()
                generate(copy.deepcopy(dyn))
                return time.perf_counter() - t0

            def impress_memory() -> float:
                t0 = time.perf_counter()
                generate(ImpressCache(store, ids, store_prompt=False))
                return time.perf_counter() - t0

            for n in args.threads:
                torch.set_num_threads(n)
                times: dict[str, list[float]] = {"dynamic_memory": [], "impress_1.0_memory": []}
                for _ in range(args.repeats):
                    times["dynamic_memory"].append(dynamic_memory())
                    times["impress_1.0_memory"].append(impress_memory())
                med = {k: statistics.median(v) for k, v in times.items()}
                run: dict[str, Any] = {
                    "median_s": med, "runs_s": times,
                    "ratio": med["impress_1.0_memory"] / med["dynamic_memory"],
                }
                run["stages_ms"] = _stages(store, prefix, dyn, args.repeats)
                print(f"threads {n}: stages (ms) {run['stages_ms']}", flush=True)
                if args.profile:
                    for name, fn in (("dynamic_memory", dynamic_memory), ("impress_1.0_memory", impress_memory)):
                        prof = cProfile.Profile()
                        prof.enable()
                        for _ in range(3):
                            fn()
                        prof.disable()
                        run[f"profile_{name}"] = _top(prof)
                result["runs"][str(n)] = run
                print(f"threads {n}: dynamic {med['dynamic_memory']:.3f} s, impress memory "
                      f"{med['impress_1.0_memory']:.3f} s ({run['ratio']:.2f}x)", flush=True)
    result["load_average_at_end"] = os.getloadavg()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
