"""Block size sweep: what ``chunk_tokens`` costs and buys, on SmolLM2-135M.

    python benchmarks/chunk_size.py --out results/chunk_size.json     # ~6 min

A disk block holds ``chunk_tokens`` rows of one layer; it is the unit of disk I/O and of
block selection. Smaller blocks let a sparse prefill take the rows it wants with less
collateral (better fidelity for the same bytes) but mean more blocks to look up, verify
and copy (more per-block overhead). For every prefix (2k and 7.5k tokens of prose and of
standard-library code, the fidelity benchmark's corpora) the K/V is computed once and
stored with each block size, then, per block size:

* first-token agreement and first-step KL divergence of a sparse prefill
  (``important_ratio=0.25``, block selection) against dense reuse, over the fidelity
  benchmark's main question and its four extra questions per corpus;
* bytes read before the first token, over the bytes of the full prefix;
* time to first token of dense reuse (``important_ratio=1.0``) and of the sparse
  prefill, from guest-cold chunk files, ``--reps`` times each (main question only).

No memory tiers (every block comes from disk), K/V stored in float32, int4 probe copies.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from fidelity import EXTRA_QUESTIONS, QUESTION, corpus_tokens, first_step, forced_run, model_kv_bytes_per_token
from impress_cache import ImpressConfig, ImpressStore
from impress_cache.tools import drop_page_cache, load_smollm2


def store_prefix(model: Any, prefix: list[int], dirs: dict[int, Path]) -> None:
    """Compute the prefix's K/V once and store it with every block size."""
    with torch.no_grad():
        out = model.model(input_ids=torch.tensor([prefix]), use_cache=True)
    layers = out.past_key_values.layers
    keys = [layer.keys[0] for layer in layers]
    values = [layer.values[0] for layer in layers]
    for ct, path in dirs.items():
        with ImpressStore(path, model, ImpressConfig(chunk_tokens=ct, important_ratio=1.0)) as store:
            store.put(prefix, keys, values)
            store.flush()


def measure(model: Any, tok: Any, kind: str, length: int, ct: int, path: Path, reps: int) -> dict[str, Any]:
    prefix = corpus_tokens(tok, kind, length)
    questions = [QUESTION[kind], *EXTRA_QUESTIONS[kind]]
    base = dict(chunk_tokens=ct, device_bytes=0, host_bytes=0)
    dense_cfg = ImpressConfig(important_ratio=1.0, **base)
    sparse_cfg = ImpressConfig(important_ratio=0.25, selection="block", decode="full", **base)
    full_bytes = length * model_kv_bytes_per_token(model)
    agree, kls, prefill = [], [], []
    ttft: dict[str, list[float]] = {"dense": [], "sparse": []}
    for qi, text in enumerate(questions):
        ids = torch.tensor([prefix + tok(text, add_special_tokens=False)["input_ids"]])
        runs = reps if qi == 0 else 1
        for name, cfg in (("dense", dense_cfg), ("sparse", sparse_cfg)):
            for _ in range(runs):
                with ImpressStore(path, model, cfg) as store:
                    drop_page_cache(path)
                    res = forced_run(model, store, ids, [0])
                if qi == 0:
                    ttft[name].append(res["ttft_s"])
            if name == "dense":
                ref = res["logp"][0]
        a, kl = first_step(ref, res["logp"][0])
        agree.append(a)
        kls.append(kl)
        prefill.append((res["bytes_read_probe"] + res["bytes_read_rows"]) / full_bytes)
    return {
        "corpus": kind, "prefix_tokens": length, "chunk_tokens": ct, "questions": len(questions),
        "first_token": statistics.fmean(agree), "kl_first": statistics.fmean(kls), "kl_first_each": kls,
        "prefill_bytes_vs_full": statistics.fmean(prefill),
        "ttft_dense_s": statistics.median(ttft["dense"]), "ttft_sparse_s": statistics.median(ttft["sparse"]),
        "ttft_dense_each_s": ttft["dense"], "ttft_sparse_each_s": ttft["sparse"],
    }


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for ct in sorted({r["chunk_tokens"] for r in rows}):
        rs = [r for r in rows if r["chunk_tokens"] == ct]
        longest = max(r["prefix_tokens"] for r in rs)
        out[str(ct)] = {
            "first_token": statistics.fmean(r["first_token"] for r in rs),
            "prompts": sum(r["questions"] for r in rs),
            "mean_kl_first": statistics.fmean(r["kl_first"] for r in rs),
            "prefill_bytes_vs_full": statistics.fmean(r["prefill_bytes_vs_full"] for r in rs),
            f"ttft_dense_s_at_{longest}": statistics.fmean(r["ttft_dense_s"] for r in rs if r["prefix_tokens"] == longest),
            f"ttft_sparse_s_at_{longest}": statistics.fmean(r["ttft_sparse_s"] for r in rs if r["prefix_tokens"] == longest),
        }
    return out


def markdown(result: dict[str, Any]) -> str:
    s = result["summary"]
    keys = [k for k in next(iter(s.values())) if k.startswith("ttft")]
    lines = [
        "| chunk_tokens | first token | prompts | mean first-step KL | prefill bytes / full | " + " | ".join(keys) + " |",
        "|---:|---:|---:|---:|---:|" + "---:|" * len(keys),
    ]
    for ct, v in s.items():
        lines.append(
            f"| {ct} | {v['first_token']:.3f} | {v['prompts']} | {v['mean_kl_first']:.4f} | {v['prefill_bytes_vs_full']:.3f} | "
            + " | ".join(f"{v[k]:.2f}" for k in keys) + " |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="results/chunk_size.json")
    p.add_argument("--chunk-tokens", type=int, nargs="+", default=[16, 32, 64])
    p.add_argument("--lengths", type=int, nargs="+", default=[2048, 7680])
    p.add_argument("--corpora", nargs="+", default=["prose", "code"])
    p.add_argument("--reps", type=int, default=3, help="timed runs of the main question per configuration")
    p.add_argument("--report", metavar="JSON", help="print the Markdown table of an earlier run and exit")
    args = p.parse_args(argv)
    if args.report:
        print(markdown(json.loads(Path(args.report).read_text())))
        return 0
    if any(ct < 1 for ct in args.chunk_tokens) or args.reps < 1:
        p.error("--chunk-tokens and --reps must be positive")
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    t0 = time.perf_counter()
    print("loading SmolLM2-135M-Instruct...", file=sys.stderr)
    model, tok = load_smollm2()
    rows = []
    with tempfile.TemporaryDirectory(prefix="impress-chunks-") as work:
        for kind in args.corpora:
            for length in args.lengths:
                dirs = {ct: Path(work) / f"{kind}-{length}-{ct}" for ct in args.chunk_tokens}
                print(f"prefix: {kind}, {length} tokens", file=sys.stderr, flush=True)
                store_prefix(model, corpus_tokens(tok, kind, length), dirs)
                for ct, path in dirs.items():
                    row = measure(model, tok, kind, length, ct, path, args.reps)
                    print(f"  chunk_tokens {ct}: first-step KL {row['kl_first']:.4f}, "
                          f"TTFT dense {row['ttft_dense_s']:.2f} s, sparse {row['ttft_sparse_s']:.2f} s", file=sys.stderr, flush=True)
                    rows.append(row)
    result = {
        "meta": {
            "command": "python benchmarks/chunk_size.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            "model": "SmolLM2-135M-Instruct (Q4_1 GGUF dequantised to float32), K/V stored in float32, int4 probes",
            "machine": f"{platform.machine()}, {os.cpu_count()} cores, torch threads {torch.get_num_threads()}",
            "disk": "guest-cold chunk files (fsync + POSIX_FADV_DONTNEED before every run), no memory tiers",
            "ttft": "median over --reps runs of the main question; ImpressCache construction included",
            "seconds": round(time.perf_counter() - t0, 1),
        },
        "summary": summarize(rows),
        "rows": rows,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(markdown(result))
    print(f"wrote {out} in {result['meta']['seconds']} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
