"""Selection and load time against prefix length, up to 131,072 tokens: rows vs bounds.

    python benchmarks/scaling.py --out results/scaling.json
    python benchmarks/scaling.py --lengths 1024 8192 --repeats 1 --out /tmp/scaling-quick.json

SmolLM2 stops at 8k positions, so this uses a tiny random Llama with many layers
(``--layers``, default 16; hidden 64, 4 query heads, 2 KV heads of 16, 1 torch thread)
and positions up to the longest prefix. For each length a prefix of random tokens is
stored with random K/V (`ImpressStore.put`: the chunk files, probe copies included, are
what a prefill would write; their values do not matter for time), then a request of the
prefix plus ``--new`` new tokens produces its first token (``generate``,
``max_new_tokens=1``), guest-cold (the chunk files dropped from the page cache first),
``--repeats`` times per method, medians reported:

* ``exact``: ``important_ratio=1.0``, every block read (the load time);
* ``rows``: ``important_ratio=0.25``, ``decode="keep"``, ``block_scores="rows"``: every
  prefix row scored by the probed query heads;
* ``bounds``: the same with ``block_scores="bounds"``: every block scored by its probe
  keys' per-channel minimum and maximum.

Per method: time to first token, and the request's `RequestStats` breakdown (load,
probe, select, I/O wait, prefill seconds), ``select ms per layer`` (``select_seconds``
over the layers: scoring, choosing and gathering the rows, without waiting for reads)
and ``select us per 1k rows``, which stays flat when the cost grows with the rows and
falls with the length when it grows with the blocks only. The machine may be shared:
timings are noisy, compare methods at the same length.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from impress_cache import ImpressCache, ImpressConfig, ImpressStore
from impress_cache.hf.compat import CACHE_KWARG
from impress_cache.tools import drop_page_cache

TIERS_OFF = {"device_bytes": 0, "host_bytes": 0}
METHODS: dict[str, dict[str, Any]] = {
    "exact": {"important_ratio": 1.0, **TIERS_OFF},
    "rows": {"important_ratio": 0.25, "decode": "keep", "block_scores": "rows", **TIERS_OFF},
    "bounds": {"important_ratio": 0.25, "decode": "keep", "block_scores": "bounds", **TIERS_OFF},
}
BREAKDOWN = ("load_seconds", "probe_seconds", "select_seconds", "io_wait_seconds", "prefill_seconds")


def tiny_llama(layers: int, positions: int) -> Any:
    cfg = LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=positions, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def store_prefix(store_dir: Path, model: Any, tokens: list[int]) -> None:
    """The prefix stored with random K/V of the model's shape."""
    cfg = model.config
    heads, dim = cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads
    g = torch.Generator().manual_seed(len(tokens))
    keys = [torch.randn(heads, len(tokens), dim, generator=g) for _ in range(cfg.num_hidden_layers)]
    values = [torch.randn(heads, len(tokens), dim, generator=g) for _ in range(cfg.num_hidden_layers)]
    with ImpressStore(store_dir, model, ImpressConfig(important_ratio=1.0, fsync=False, **TIERS_OFF)) as store:
        store.put(tokens, keys, values)


def one_request(store: ImpressStore, store_dir: Path, model: Any, ids: torch.Tensor) -> dict[str, Any]:
    drop_page_cache(store_dir)
    t0 = time.perf_counter()
    cache = ImpressCache(store, ids, store_prompt=False)
    with torch.no_grad():
        model.generate(ids, max_new_tokens=1, do_sample=False, **{CACHE_KWARG: cache})
    out: dict[str, Any] = {"ttft_s": time.perf_counter() - t0}
    out.update({k: getattr(cache.stats, k) for k in BREAKDOWN})
    out["bytes_read_disk"] = cache.stats.bytes_read_disk
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 16384, 65536, 131072])
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--new", type=int, default=24)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--methods", nargs="+", default=list(METHODS))
    p.add_argument("--out", default="results/scaling.json")
    p.add_argument("--workdir", default=None, help="where the stores go (default: a temporary directory)")
    args = p.parse_args()
    torch.set_num_threads(1)
    model = tiny_llama(args.layers, max(args.lengths) + args.new + 8)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="impress-scaling-"))
    results: dict[str, Any] = {
        "model": {"layers": args.layers, "hidden": 64, "q_heads": 4, "kv_heads": 2, "head_dim": 16},
        "new_tokens": args.new, "repeats": args.repeats, "lengths": {},
    }
    try:
        for length in args.lengths:
            g = torch.Generator().manual_seed(length)
            tokens = torch.randint(3, 256, (length + args.new,), generator=g)
            store_dir = work / f"store-{length}"
            store_prefix(store_dir, model, tokens[:length].tolist())
            ids = tokens.unsqueeze(0)
            per: dict[str, Any] = {}
            for name in args.methods:
                with ImpressStore(store_dir, model, ImpressConfig(**METHODS[name])) as store:
                    one_request(store, store_dir, model, ids[:, -args.new - 64 :])  # warm-up of the process
                    runs = [one_request(store, store_dir, model, ids) for _ in range(args.repeats)]
                row = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
                row["ttft_runs_s"] = [round(r["ttft_s"], 4) for r in runs]
                row["select_ms_per_layer"] = 1e3 * row["select_seconds"] / args.layers
                row["select_us_per_1k_rows"] = 1e6 * row["select_seconds"] / args.layers / (length / 1000)
                per[name] = row
                print(
                    f"{length:>7} {name:<7} ttft {row['ttft_s']:.3f} s  select {row['select_ms_per_layer']:.2f} ms/layer"
                    f"  io_wait {row['io_wait_seconds']:.3f} s  probe {row['probe_seconds']:.3f} s",
                    flush=True,
                )
            results["lengths"][str(length)] = per
            shutil.rmtree(store_dir, ignore_errors=True)
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
