"""Where a sparse prefill's selection time goes, per layer and stage (SmolLM2, CPU, fp32).

    python benchmarks/select_stages.py --lengths 8000 --out results/select-stages.json
    PYTHONPATH=/path/to/other/src python benchmarks/select_stages.py ...   # another tree
    python benchmarks/select_stages.py --scores bounds --process-threads ...   # bounds on 2 threads

The prefix (``pydoc_data.topics`` prose, as ``benchmarks/ttft.py``) and its question are
stored once; then, per ``block_scores`` (``rows``, ``bounds``), ``important_ratio=0.25``
with ``decode="keep"`` answers ``--repeats`` guest-cold requests (first token only) after
one warm-up. Reported per request: ``RequestStats.select_seconds`` per layer (as
``ttft.py`` reports it), and from one more request run under ``cProfile`` the cumulative
time per layer of the stages below (profiled times run a little above plain ones; a
stage's time includes the stages it calls):

* ``scoring``: the probe keys scored (``probe_scores`` for rows, ``bound_unit_scores``
  for bounds);
* ``agreement``: the probe heads' top-k Jaccard similarity;
* ``choosing``: the shared set (``select_units`` / ``take_units`` / ``units_taken``);
* ``ranking``: the combined scores kept for the reorganiser (``normalised_sum``,
  ``unit_row_scores``), on the layer's path;
* ``ranking_deferred``: with bounds, the units' ranking spread over the rows once the
  layers are done (``_spread``, for the reorganiser's record; outside ``select_seconds``);
* ``gather``: the selected rows copied out of the blocks read (``LayerView.gather``);
* ``read``: starting and waiting for the block reads (``_read_units``: outside
  ``select_seconds``, which subtracts the I/O wait);
* ``select_total``: ``SparsePrefill.select`` as a whole (read included).

The machine's load average is recorded at start and end: on a shared machine the times
move with it.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from ttft import TIERS_OFF, prose_prompt, store_prefix  # noqa: E402

from impress_cache import ImpressCache, ImpressConfig, ImpressStore  # noqa: E402
from impress_cache.hf.compat import CACHE_KWARG  # noqa: E402
from impress_cache.tools import drop_page_cache, load_smollm2  # noqa: E402

#: stage -> the functions (by name) whose cumulative time it is
STAGES = {
    "scoring": ("probe_scores", "bound_unit_scores"),
    "agreement": ("top_jaccard", "mean_jaccard_of", "topk_indices"),
    "choosing": ("select_units", "take_units", "units_taken"),
    "ranking": ("normalised_sum", "unit_row_scores"),
    "ranking_deferred": ("_spread",),
    "gather": ("gather",),
    "read": ("_read_units",),
    "select_total": ("select",),
}
FILES = {"gather": "layout.py", "read": "sparse.py", "select_total": "sparse.py"}


def stages(prof: cProfile.Profile, layers: int) -> dict[str, float]:
    """Milliseconds per layer of every stage (this library's functions only; the
    functions of one stage do not call each other)."""
    cum: dict[tuple[str, str], float] = {}
    for (path, _, name), (_, _, _, ct, _) in pstats.Stats(prof).stats.items():  # type: ignore[attr-defined]
        # selection/small.py holds the host versions that the stages' functions call
        # (same names): counting them too would count their time twice
        if "impress_cache" in path and Path(path).name != "small.py":
            key = (Path(path).name, name)
            cum[key] = cum.get(key, 0.0) + ct
    out: dict[str, float] = {}
    for stage, names in STAGES.items():
        want = FILES.get(stage)
        total = sum(t for (file, name), t in cum.items() if name in names and (want is None or file == want))
        out[stage] = 1e3 * total / layers
    # bounds spread their ranking over the rows when the request's record is made, after
    # the layers (``_spread``, outside ``select_seconds``): not a stage of the layer's path
    out["ranking"] -= out["ranking_deferred"]
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", type=int, nargs="+", default=[8000])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--scores", nargs="+", default=["rows", "bounds"])
    p.add_argument("--out", default="results/select-stages.json")
    p.add_argument(
        "--process-threads", action="store_true",
        help="bounds selection on the process's torch threads too (not on one: what that gives)",
    )
    args = p.parse_args()
    if args.process_threads:
        import contextlib

        import impress_cache.hf.sparse as sparse

        sparse.intra_op_threads = lambda n: contextlib.nullcontext()  # type: ignore[assignment]
    torch.set_num_threads(2)
    model, tok = load_smollm2()
    layers = model.config.num_hidden_layers
    load_start = os.getloadavg()
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="select-stages-") as work:
        for length in args.lengths:
            prefix, question, ids = prose_prompt(tok, length)
            store_dir = Path(work) / f"store-{length}"
            store_prefix(model, store_dir, prefix, question)
            row: dict[str, Any] = {"prefix_tokens": len(prefix)}
            for scores in args.scores:
                cfg = ImpressConfig(important_ratio=0.25, decode="keep", block_scores=scores, **TIERS_OFF)
                with ImpressStore(store_dir, model, cfg) as store:

                    def once(prof: cProfile.Profile | None = None) -> tuple[float, float]:
                        drop_page_cache(store_dir)
                        cache = ImpressCache(store, ids, store_prompt=False)
                        t0 = time.perf_counter()
                        if prof is not None:
                            prof.enable()
                        model.generate(ids, max_new_tokens=1, do_sample=False, **{CACHE_KWARG: cache})
                        if prof is not None:
                            prof.disable()
                        return time.perf_counter() - t0, cache.stats.select_seconds

                    once()  # warm-up
                    runs = [once() for _ in range(args.repeats)]
                    prof = cProfile.Profile()
                    _, profiled_select = once(prof)
                    row[scores] = {
                        "ttft_s": statistics.median(r[0] for r in runs),
                        "select_ms_per_layer": 1e3 * statistics.median(r[1] for r in runs) / layers,
                        "select_ms_per_layer_runs": [round(1e3 * r[1] / layers, 2) for r in runs],
                        "profiled_select_ms_per_layer": 1e3 * profiled_select / layers,
                        "stages_ms_per_layer": stages(prof, layers),
                    }
                    print(length, scores, json.dumps(row[scores]), flush=True)
            results.append(row)
    out = {
        "command": " ".join(["benchmarks/select_stages.py", *sys.argv[1:]]),
        "library": str(Path(__import__("impress_cache").__file__).resolve().parent),
        "torch_threads": 2,
        "process_threads": args.process_threads,
        "load_average_at_start": load_start,
        "load_average_at_end": os.getloadavg(),
        "layers": layers,
        "lengths": results,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
