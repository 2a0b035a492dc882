"""A layer's selection alone, replayed: the CPU work of `select_row` without the request around it.

    python benchmarks/select_replay.py --scores bounds --out results/select-replay-bounds.json
    PYTHONPATH=/path/to/other/src python benchmarks/select_replay.py ...   # another tree

One guest-cold request like ``benchmarks/select_stages.py``'s (SmolLM2, fp32, the
8000-token prose prefix, ``important_ratio=0.25``, ``decode="keep"``) runs with every
layer's `select_row` call recorded: its arguments and the blocks it read. Then every
layer's call is repeated ``--repeats`` times in a row with the recorded blocks (no I/O,
no model; the layer's buffer is a tensor of its own), on the threads the sparse prefill
uses (one for bounds, the process's two for rows), and checked to choose and gather
exactly what the request did. Reported: milliseconds per layer of the whole replay
(median over the repeats of the mean over the layers).

What it leaves out is what a request adds: caches emptied by the model's layers between
two selections, the probe loader's and the reads' threads and other processes on the
other core, the buffer's allocation and the thread switch. ``select_seconds`` in a request
(`select_stages.py`) is therefore higher and noisier; the replay measures the selection's
own work and moves little with the machine's load.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from ttft import TIERS_OFF, prose_prompt, store_prefix  # noqa: E402

import impress_cache.hf.sparse as sparse  # noqa: E402
from impress_cache import ImpressCache, ImpressConfig, ImpressStore  # noqa: E402
from impress_cache.hf.compat import CACHE_KWARG  # noqa: E402
from impress_cache.tools import drop_page_cache, load_smollm2  # noqa: E402



def record(model: Any, ids: torch.Tensor, store_dir: Path, scores: str) -> list[dict[str, Any]]:
    """Every layer's `select_row` call of one request: arguments, blocks read, result."""
    calls: list[dict[str, Any]] = []
    select_row = sparse.select_row

    def spy(**kw: Any) -> Any:
        reads: dict[tuple[int, ...], Any] = {}
        read = kw["read_units"]

        def read_units(units: Any, rows: Any) -> Any:
            blocks = reads[tuple(units)] = read(units, rows)
            return blocks

        sel = select_row(**dict(kw, read_units=read_units))
        out = kw.get("out")
        calls.append({
            "kw": dict(kw, out=None if out is None else torch.empty_like(out)), "reads": reads,
            "rows": sel.rows.clone(), "keys": sel.keys.clone(), "values": sel.values.clone(),
        })
        return sel

    cfg = ImpressConfig(important_ratio=0.25, decode="keep", block_scores=scores, **TIERS_OFF)
    sparse.select_row = spy  # type: ignore[assignment]
    try:
        with ImpressStore(store_dir, model, cfg) as store:
            drop_page_cache(store_dir)
            cache = ImpressCache(store, ids, store_prompt=False)
            model.generate(ids, max_new_tokens=1, do_sample=False, **{CACHE_KWARG: cache})
    finally:
        sparse.select_row = select_row  # type: ignore[assignment]
    return calls


def replay(call: dict[str, Any]) -> Any:
    reads = call["reads"]
    return sparse.select_row(**dict(call["kw"], read_units=lambda units, rows: reads[tuple(units)]))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--length", type=int, default=8000)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--scores", nargs="+", default=["rows", "bounds"])
    p.add_argument("--out", default="results/select-replay.json")
    args = p.parse_args()
    torch.set_num_threads(2)
    model, tok = load_smollm2()
    load_start = os.getloadavg()
    prefix, question, ids = prose_prompt(tok, args.length)
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="select-replay-") as work:
        store_dir = Path(work) / "store"
        store_prefix(model, store_dir, prefix, question)
        for scores in args.scores:
            calls = record(model, ids, store_dir, scores)
            for call in calls:  # the replay chooses and gathers what the request did
                sel = replay(call)
                assert torch.equal(sel.rows, call["rows"]) and torch.equal(sel.keys, call["keys"])
                assert torch.equal(sel.values, call["values"])
            torch.set_num_threads(1 if scores == "bounds" else 2)  # as `SparsePrefill.select`
            times = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                for call in calls:
                    replay(call)
                times.append(1e3 * (time.perf_counter() - t0) / len(calls))
            torch.set_num_threads(2)
            out[scores] = {
                "ms_per_layer": statistics.median(times), "ms_per_layer_min": min(times),
                "layers": len(calls), "heads_disagreed_layers": sum(1 for c in calls if c["rows"].dim() == 2),
            }
            print(scores, json.dumps(out[scores]), flush=True)
    result = {
        "command": " ".join(["benchmarks/select_replay.py", *sys.argv[1:]]),
        "library": str(Path(__import__("impress_cache").__file__).resolve().parent),
        "prefix_tokens": len(prefix), "repeats": args.repeats,
        "load_average_at_start": load_start, "load_average_at_end": os.getloadavg(), "scores": out,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
